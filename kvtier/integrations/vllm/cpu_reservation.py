"""What vLLM's CPU build reserves for its other processes beside a KV connector, and what kvtier advises.

vLLM's CPU worker binds its OpenMP threads, one per CPU, to the CPUs left after a reservation for
the other processes (the API server, the engine core, a connector's own). In its default layout
(each worker a process of its own) it reserves one core per rank, and one more per rank whenever
any KV connector is configured (``vllm/utils/ompmultiprocessing.py``, for NIXL's transfer
threads); ``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides both. Where the reservation reaches the
machine's CPUs it is dropped and the worker takes them all. In the one-process layout
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) nothing is bound.

kvtier's I/O process and copy threads run beside the engine core on the reserved cores and mostly
wait on storage, so kvtier's advice is the reservation vLLM makes without a connector: one core per
rank (``docs/deployment.md`` has the measurements behind it). Configuring kvtier then changes
nothing of the engine's own CPUs, and a comparison with a run without a connector is fair.
"""

from __future__ import annotations

import os


def reserved_by_vllm(local_world_size: int, connector: bool, env=os.environ) -> tuple[int, bool]:
    """(cores vLLM's CPU build reserves in its default layout, whether the environment set it)."""
    if env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "") != "":
        return int(env["VLLM_CPU_NUM_OF_RESERVED_CPU"]), True
    return local_world_size * (2 if connector else 1), False


def advice(local_world_size: int, bound_cpus: int | None, env=os.environ) -> str:
    """One line for kvtier's start-up log and ``kvtier doctor``: what vLLM reserves beside kvtier, the
    CPUs this worker computes on, and what kvtier advises."""
    in_process = env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    reserved, explicit = reserved_by_vllm(local_world_size, connector=True, env=env)
    recommended = local_world_size
    threads = f"this worker computes on {bound_cpus} CPUs" if bound_cpus else "CPUs of this worker unknown"
    if in_process:
        return (f"vLLM's CPU build, one-process layout: it binds no CPU, with or without a connector ({threads}); "
                f"nothing to set")
    said = "VLLM_CPU_NUM_OF_RESERVED_CPU" if explicit else \
        f"its default with a KV connector, {local_world_size} more than without one"
    verdict = ("as kvtier advises" if reserved == recommended else
               f"kvtier advises VLLM_CPU_NUM_OF_RESERVED_CPU={recommended}, what vLLM reserves without a connector: "
               f"kvtier's I/O runs on the reserved cores and the model keeps its own (see docs/deployment.md)")
    return f"vLLM's CPU build reserves {reserved} cores for its other processes ({said}); {threads}; {verdict}"
