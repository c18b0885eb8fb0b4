"""``kvtier bench transfer --device cuda``: the CUDA copier against plain copies.

A FlashAttention-layout KV cache (per layer ``[2, num_blocks, block_size, kv_heads,
head_size]``, bf16) on the GPU and kvtier's own host pool: the shared memory (memfd) that
its I/O process maps, registered with CUDA (``cudaHostRegister``), as the worker makes it.
kvtier's offload (device -> host slots) and load (host slots -> device) of ``gib`` GiB of blocks, scattered
(random device blocks, random slots) and in contiguous runs, are timed from submit
to the job's completion on the host. The peer is one plain ``copy_`` of the same
number of bytes between a buffer of CUDA's own pinned memory (``cudaHostAlloc``) and
device memory (a ``cudaMemcpyAsync``),
timed the same way, in the same run: each direction alone, and both directions at
once beside kvtier's store and load at once. Every figure is the median of
``repeats`` runs. Host memory: kvtier's pool and the peer's pinned buffers, ``2 * gib`` GiB each.

It also measures what a store costs the model's step: the host time of submitting
a 32-block store (64 MiB) after each of a chain of matrix products on the compute
stream (a model step's worth of compute each), polling for finished jobs each step as the
connector does, and how much longer the chain takes on the compute stream then.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np
import torch

from kvtier.common.layout import detect_layout
from kvtier.transfer.cuda import CudaCopier
from kvtier.transfer.engine import TransferEngine, TransferJob
from kvtier.transfer.host_buffer import SharedHostMemory, allocate_host_buffer
from kvtier.worker import tensor_info


def _timed(function) -> float:
    began = time.perf_counter()
    function()
    return time.perf_counter() - began


def run(gib: float = 4.0, num_layers: int = 32, block_size: int = 16, kv_heads: int = 8, head_size: int = 128,
        repeats: int = 5, progress=None, block_mover="auto") -> dict:
    device = torch.device("cuda")
    block_bytes = 2 * block_size * kv_heads * head_size * 2  # one layer's K and V of one block, bf16
    slot_bytes = block_bytes * num_layers
    num_moved = max(1, int(gib * (1 << 30)) // slot_bytes)
    num_blocks = 2 * num_moved + num_moved // 4  # two disjoint sets (store and load at once), and spare
    tensors = [torch.empty((2, num_blocks, block_size, kv_heads, head_size), dtype=torch.bfloat16, device=device)
               for _ in range(num_layers)]
    for tensor in tensors:
        tensor.view(torch.int16).random_()
    layout = detect_layout([tensor_info(t) for t in tensors], num_blocks, block_size)
    with contextlib.ExitStack() as cleanup:  # on every path: the engine stops, then the pool is unregistered
        memory = SharedHostMemory(2 * num_moved * slot_bytes, pin=True)  # the worker's host pool
        cleanup.callback(memory.close)
        copier = CudaCopier(layout, tensors, memory.tensor, block_mover=block_mover)
        engine = TransferEngine(copier)
        cleanup.callback(engine.close)
        return _measure(engine, copier, memory, tensors, num_blocks, num_moved, slot_bytes, block_bytes,
                        repeats, progress)


def _measure(engine, copier, memory, tensors, num_blocks: int, num_moved: int, slot_bytes: int, block_bytes: int,
             repeats: int, progress) -> dict:
    device = tensors[0].device
    moved_bytes = num_moved * slot_bytes
    rng = np.random.default_rng(0)
    shuffled = rng.permutation(num_blocks)
    cases = {
        "scattered": (shuffled[:num_moved], rng.permutation(num_moved),
                      shuffled[num_moved: 2 * num_moved], num_moved + rng.permutation(num_moved)),
        "contiguous": (np.arange(num_moved), np.arange(num_moved),
                       np.arange(num_moved, 2 * num_moved), np.arange(num_moved, 2 * num_moved)),
    }

    def kvtier(*jobs: TransferJob) -> float:
        def go():
            ids = [engine.submit(job) for job in jobs]
            assert engine.wait(ids, timeout=600)
            results = engine.poll()
            assert len(results) == len(jobs) and all(r.success for r in results), results
        return _timed(go)

    pinned = allocate_host_buffer(2, moved_bytes, pin=True).view(2, -1)  # the peer's: two pinned regions
    plain_device = torch.empty((2, moved_bytes), dtype=torch.uint8, device=device)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]

    def plain(*directions: bool) -> float:
        def go():
            for index, to_host in enumerate(directions):
                with torch.cuda.stream(streams[index]):
                    if to_host:
                        pinned[index].copy_(plain_device[index], non_blocking=True)
                    else:
                        plain_device[index].copy_(pinned[index], non_blocking=True)
            for stream in streams[:len(directions)]:
                stream.synchronize()
        return _timed(go)

    results: dict = {"bytes": moved_bytes, "blocks": num_moved, "slot_bytes": slot_bytes,
                     "layer_block_bytes": block_bytes, "device": torch.cuda.get_device_name(device),
                     "host_pool": "memfd, cudaHostRegister", "host_pool_huge_bytes": memory.huge_bytes,
                     "mover": "triton" if copier._block_mover is not None else "torch ops"}
    for name, (store_ids, store_slots, load_ids, load_slots) in cases.items():
        samples: dict[str, list[float]] = {k: [] for k in ("offload", "load", "both", "d2h", "h2d", "plain_both")}
        for _ in range(repeats):
            samples["d2h"].append(plain(True))
            samples["offload"].append(kvtier(TransferJob(store_ids, store_slots, True)))
            samples["h2d"].append(plain(False))
            samples["load"].append(kvtier(TransferJob(store_ids, store_slots, False)))
            samples["plain_both"].append(plain(True, False))
            samples["both"].append(kvtier(TransferJob(store_ids, store_slots, True),
                                          TransferJob(load_ids, load_slots, False)))
            if progress:
                progress()
        median = {k: statistics.median(v) for k, v in samples.items()}
        figures = {
            "offload_gbps": moved_bytes / median["offload"] / 1e9,
            "load_gbps": moved_bytes / median["load"] / 1e9,
            "memcpy_d2h_gbps": moved_bytes / median["d2h"] / 1e9,
            "memcpy_h2d_gbps": moved_bytes / median["h2d"] / 1e9,
            "both_gbps": 2 * moved_bytes / median["both"] / 1e9,
            "memcpy_both_gbps": 2 * moved_bytes / median["plain_both"] / 1e9,
        }
        figures["offload_vs_memcpy"] = figures["offload_gbps"] / figures["memcpy_d2h_gbps"]
        figures["load_vs_memcpy"] = figures["load_gbps"] / figures["memcpy_h2d_gbps"]
        figures["both_vs_memcpy"] = figures["both_gbps"] / figures["memcpy_both_gbps"]
        results[name] = figures
    results["exact"] = _round_trip_is_exact(engine, tensors, *cases["scattered"])
    results.update(_step_cost(engine, tensors, num_blocks))
    return results


def _round_trip_is_exact(engine, tensors, store_ids, store_slots, load_ids, load_slots) -> bool:
    """Offload scattered blocks, load them into other blocks, compare every byte on the GPU."""
    engine.wait([engine.submit(TransferJob(store_ids, store_slots, True))])
    engine.poll()
    for tensor in tensors:
        tensor[:, load_ids] = 0
    engine.wait([engine.submit(TransferJob(load_ids, store_slots, False))])
    engine.poll()
    torch.cuda.synchronize()
    return all(torch.equal(t[:, load_ids].view(torch.int16), t[:, store_ids].view(torch.int16)) for t in tensors)


def _step_cost(engine, tensors, num_blocks: int, step_blocks: int = 32, steps: int = 100) -> dict:
    """What submitting a store costs the model: host time, and time on the compute stream."""
    rng = np.random.default_rng(2)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)  # a product: a step's compute on a large GPU
    # Each step's store into slots of its own: jobs in flight never share a slot.
    jobs = [TransferJob(rng.choice(num_blocks, step_blocks, replace=False),
                        np.arange(step_blocks) + (i % 8) * step_blocks, True) for i in range(steps)]
    engine.wait([engine.submit(jobs[0])])  # warm: pools, pinned ids, allocator
    engine.poll()

    def compute_chain(with_stores: bool) -> tuple[float, list[float]]:
        submit_times, job_ids = [], []
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        began.record()
        for job in jobs:
            a.matmul(a)  # one step of the model, on the compute stream
            if with_stores:
                submitted = time.perf_counter()
                job_ids.append(engine.submit(TransferJob(job.block_ids, job.slot_ids, True)))
                submit_times.append(time.perf_counter() - submitted)
                engine.poll()  # as the connector does each step (vLLM's get_finished)
        ended.record()
        ended.synchronize()
        assert engine.wait(job_ids, timeout=120)
        engine.poll()
        return began.elapsed_time(ended) / 1e3, submit_times

    alone, with_stores = [], []
    submit_times: list[float] = []
    for _ in range(3):
        alone.append(compute_chain(False)[0])
        seconds, times = compute_chain(True)
        with_stores.append(seconds)
        submit_times += times
    return {
        "store_submit_us_median": statistics.median(submit_times) * 1e6,
        "store_submit_us_p99": float(np.percentile(submit_times, 99)) * 1e6,
        "store_step_bytes": step_blocks * sum(t[:, 0].nbytes for t in tensors),
        "compute_seconds_alone": statistics.median(alone),
        "compute_seconds_with_stores": statistics.median(with_stores),
        "compute_slowdown": statistics.median(with_stores) / statistics.median(alone) - 1,
    }


def disk_hit(disk_dir: str, num_moved: int = 256, num_layers: int = 32, block_size: int = 16, kv_heads: int = 8,
             head_size: int = 128, repeats: int = 5, device: str = "cuda") -> dict:
    """A disk hit through kvtier's whole load path, against what its bytes cost alone, in one run.

    ``num_moved`` blocks are stored through ``TierWorker`` and ``TierManager`` (device -> the
    registered host pool -> the I/O process -> disk), then pushed out of the host pool by as
    many other blocks, and loaded into other device blocks: disk -> host slots (the I/O
    process) -> device, timed from submit to the report. Loaded again at once, the same
    blocks are host hits: the copy into the device alone. The peers, timed the same way in
    the same run: one plain ``copy_`` of the same bytes from CUDA's pinned memory into device
    memory, and a read of the same bytes from a file in the page cache into pinned memory.
    Every load is compared byte for byte with what was stored. ``device="cpu"`` runs the
    same steps without a GPU (the test suite's check of this function).
    """
    from kvtier.common.config import KVTierConfig
    from kvtier.common.entry import HEADER_BYTES
    from kvtier.common.keys import Namespace
    from kvtier.scheduler.manager import TierManager
    from kvtier.worker import TierWorker

    num_blocks = 3 * num_moved  # the stored set, the set that pushes it out of the host pool, the load's targets
    tensors = [torch.empty((2, num_blocks, block_size, kv_heads, head_size), dtype=torch.bfloat16, device=device)
               for _ in range(num_layers)]
    for tensor in tensors:
        tensor.view(torch.int16).random_()
    on_cuda = tensors[0].is_cuda
    synchronize = torch.cuda.synchronize if on_cuda else (lambda: None)
    slot_bytes = sum(t[:, 0].nbytes for t in tensors)
    namespace = Namespace("bench-disk-hit", "bfloat16", "kv_first", (2, block_size, kv_heads * head_size),
                          num_layers, block_size)
    config = KVTierConfig.from_sources({"host_bytes": num_moved * slot_bytes, "disk_dir": disk_dir,
                                        "disk_bytes": 4 * num_moved * (slot_bytes + HEADER_BYTES)}, environ={})
    worker = TierWorker(config, tensors, num_blocks, block_size, namespace)
    manager = TierManager(config, worker.layout.slot_bytes, [worker.rank_fingerprint])

    def run_job(job, submit) -> float:
        began = time.perf_counter()
        submit(job)
        reports: list = []
        while not reports:
            if time.perf_counter() - began > 120:
                raise TimeoutError("a job of bench disk_hit did not finish")
            reports = worker.poll()
            manager.on_released(worker.released_slots())
        seconds = time.perf_counter() - began
        manager.on_reports(reports)
        if not all(r.success for r in reports):
            raise RuntimeError(f"a job of bench disk_hit failed: {reports}")
        return seconds

    def planned_load(source: str):
        job = manager.plan_load("bench", keys(0), targets)
        found = len(job.fill_block_ids) if source == "disk" else len(job.ready_block_ids)
        if not job.final or job.missing_block_ids or found != num_moved:
            raise RuntimeError(f"bench disk_hit: a load planned {found} of {num_moved} blocks from {source}")
        return job

    def keys(first: int) -> list[bytes]:
        return [(first + i).to_bytes(16, "little") for i in range(num_moved)]

    stored, pushing, targets = (list(range(k * num_moved, (k + 1) * num_moved)) for k in range(3))
    expected = [t[:, stored].clone() for t in tensors]
    samples: dict[str, list[float]] = {"disk_hit": [], "host_hit": [], "plain_h2d": [], "file_read": []}
    moved_bytes = num_moved * slot_bytes
    pinned = allocate_host_buffer(1, moved_bytes, pin=on_cuda).view(-1)
    plain_device = torch.empty(moved_bytes, dtype=torch.uint8, device=device)
    file_path = f"{disk_dir}/peer-read.bin"
    with open(file_path, "wb") as f:
        f.write(pinned.numpy().tobytes())  # the peer's file: the same number of bytes, in the page cache
    exact = True
    try:
        run_job(manager.plan_store("bench", keys(0), stored), worker.submit_store)  # written through to disk
        for round_ in range(repeats + 1):  # round 0 warms every path and is not counted
            run_job(manager.plan_store("bench", keys(num_moved), pushing), worker.submit_store)
            if manager.host.lookup(keys(0)[:1]) != 0:
                raise RuntimeError("bench disk_hit: the stored blocks are still in the host pool")
            for t in tensors:
                t[:, targets].zero_()
            synchronize()
            disk = run_job(planned_load("disk"), worker.submit_load)
            synchronize()
            exact &= all(torch.equal(t[:, targets].view(torch.int16), e.view(torch.int16))
                         for t, e in zip(tensors, expected))
            host = run_job(planned_load("host"), worker.submit_load)
            synchronize()
            began = time.perf_counter()
            plain_device.copy_(pinned, non_blocking=on_cuda)
            synchronize()
            plain = time.perf_counter() - began
            began = time.perf_counter()
            with open(file_path, "rb", buffering=0) as f:
                view = memoryview(pinned.numpy())
                done = 0
                while done < moved_bytes:
                    done += f.readinto(view[done:])
            read = time.perf_counter() - began
            if round_:
                for name, value in zip(samples, (disk, host, plain, read)):
                    samples[name].append(value)
    finally:
        worker.close()
        manager.close()
    median = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "disk_hit_bytes": moved_bytes, "disk_hit_blocks": num_moved, "disk_hit_exact": exact,
        "disk_hit_ms": median["disk_hit"] * 1e3, "host_hit_ms": median["host_hit"] * 1e3,
        "plain_h2d_ms": median["plain_h2d"] * 1e3, "page_cache_read_ms": median["file_read"] * 1e3,
        "host_hit_vs_plain_copy": median["host_hit"] / median["plain_h2d"],
        "disk_hit_vs_read_plus_copy": median["disk_hit"] / (median["file_read"] + median["plain_h2d"]),
    }
