"""The CUDA copier on a real GPU: byte-exact round trips, pools, and ordering against compute.

Every test here needs a CUDA device and skips without one. The ordering tests queue a
long kernel (``torch.cuda._sleep``) on the compute stream before the work that writes
or reads the KV, so that a copy not ordered against the compute stream would run in
the middle of it and see (or leave) the wrong bytes. With the copier's stream waits
removed, they fail (scripts/gpu_check.sh makes those mutations and expects the failures).
"""

import dataclasses
import time

import numpy as np
import pytest
import torch

from test_tiering import VLLM_LAYOUTS, vllm_layer_views

from kvtier.common.layout import detect_layout
from kvtier.transfer.engine import TransferEngine, TransferJob
from kvtier.transfer.host_buffer import allocate_host_buffer
from kvtier.worker import tensor_info

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NB, BS = 96, 16
LONG = 200_000_000  # GPU cycles: about 0.1 s, far longer than any copy here


def flash_tensors(num_layers=4, heads=8, head_size=128, num_blocks=NB, block_size=BS):
    """vLLM CUDA FlashAttention layout: per layer [2, num_blocks, block_size, heads, head_size]."""
    tensors = [torch.empty(2, num_blocks, block_size, heads, head_size, device="cuda", dtype=torch.bfloat16)
               for _ in range(num_layers)]
    for t in tensors:
        t.view(torch.int16).random_()  # raw random bits: compared as bytes, never as numbers
    return tensors


def make_engine(tensors, num_slots=NB, **copier_options):
    from kvtier.transfer.cuda import CudaCopier
    layout = detect_layout([tensor_info(t) for t in tensors], NB, BS)
    host = allocate_host_buffer(num_slots, layout.slot_bytes, pin=True)
    copier = CudaCopier(layout, tensors, host, **copier_options)
    return TransferEngine(copier), copier, host.view(num_slots, layout.slot_bytes), layout


def finish(engine, job_ids, timeout=30.0):
    assert engine.wait(job_ids, timeout=timeout), "transfers did not finish"
    results = {r.job_id: r for r in engine.poll()}
    assert set(job_ids) <= set(results)
    return results


def block_bytes(tensors, block_id):
    return torch.cat([t[:, block_id].reshape(-1).view(torch.uint8) for t in tensors]).cpu()


# --- byte-exact round trips --------------------------------------------------------------
def cuda_layouts():
    return [
        ("kv_first", lambda: [torch.zeros(2, 48, 4, 3, 5, dtype=torch.float16, device="cuda") for _ in range(2)]),
        ("mla", lambda: [torch.zeros(48, 4, 9, dtype=torch.float32, device="cuda") for _ in range(2)]),
        ("cross_layer", lambda: [torch.zeros(48, 3, 2, 4, 7, dtype=torch.bfloat16, device="cuda")]),
        ("blocks_first", lambda: [torch.zeros(48, 2, 4, 3, 8, dtype=torch.bfloat16, device="cuda") for _ in range(3)]),
    ] + [(f"vllm_{name}", lambda name=name: vllm_layer_views(name, 3, 2, 6, device="cuda"))  # vLLM 0.33+
         for name in VLLM_LAYOUTS]


@pytest.mark.parametrize("name, make", cuda_layouts(), ids=[n for n, _ in cuda_layouts()])
def test_device_host_disk_host_device_round_trip_is_byte_exact(name, make, disk_dir):
    from test_tiering import Engine, _block, keys_of, randomize

    tensors = make()
    engine = Engine(tensors, disk_dir, host_blocks=6, kind="cross_layer" if name == "cross_layer" else None,
                    verify_loads=True)
    randomize(tensors)
    blocks = [1, 2, 3, 17, 30, 31]
    original = [t.clone() for t in tensors]
    engine.store(keys_of(range(6)), blocks)  # device -> host slots -> disk
    engine.store(keys_of(range(100, 106)), [40, 41, 42, 43, 44, 45])  # evicts the first store from host
    assert engine.manager.host.lookup(keys_of([0])) == 0 and all(engine.manager.tier('disk').lookup(keys_of(range(6))))
    for t in tensors:
        t.zero_()
    job, report = engine.load(keys_of(range(6)), [5, 6, 7, 8, 9, 10])  # disk -> host slots -> other device blocks
    assert report.success and len(job.fill_block_ids) == 6
    torch.cuda.synchronize()
    for source, target in zip(blocks, [5, 6, 7, 8, 9, 10]):
        for t, o in zip(tensors, original):
            assert torch.equal(_block(t, target, name).view(torch.uint8), _block(o, source, name).view(torch.uint8))
    assert engine.worker.num_verify_failures == 0 and engine.manager.host.num_pins == 0
    engine.close()


def test_the_one_launch_mover_is_used_where_triton_is_installed():
    pytest.importorskip("triton")
    _, copier, _, _ = make_engine(flash_tensors(num_layers=2))
    assert copier._block_mover is not None


MOVERS = ["auto", None]  # Triton's one-launch mover; torch ops, one per segment
MOVER_IDS = ["triton", "torch-ops"]


def runtime_without_batches():
    from kvtier.transfer.cuda_runtime import CudaRuntime, load_cuda_runtime
    return CudaRuntime(load_cuda_runtime()._library, batch=False)


RUNTIMES = ["auto", "no-batch", None]  # batched DMAs; one call per run; torch's copies
RUNTIME_IDS = ["cudart-batch", "cudart-per-run", "torch-copies"]


@pytest.mark.parametrize("runtime", RUNTIMES, ids=RUNTIME_IDS)
@pytest.mark.parametrize("mover", MOVERS, ids=MOVER_IDS)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "two-lanes"])
def test_scattered_whole_slot_jobs_are_byte_exact(chunked, mover, runtime):
    if runtime == "no-batch":
        runtime = runtime_without_batches()
    tensors = flash_tensors()
    layout_bytes = sum(t[:, 0].nbytes for t in tensors)
    engine, copier, slots, _ = make_engine(tensors, staging_bytes=(6 * layout_bytes) if chunked else 128 << 20,
                                           block_mover=mover, runtime=runtime)
    if runtime == "auto":
        assert copier._runtime is not None and copier._runtime.can_batch, "the driver's batched copy was not found"
    rng = np.random.default_rng(0)
    block_ids, slot_ids = rng.choice(NB // 2, 40, replace=False), rng.permutation(NB)[:40]
    expected = [block_bytes(tensors, b) for b in block_ids]
    finish(engine, [engine.submit(TransferJob(block_ids, slot_ids, True))])
    assert all(torch.equal(slots[s], e) for s, e in zip(slot_ids, expected))
    targets = block_ids + NB // 2  # other blocks
    finish(engine, [engine.submit(TransferJob(targets, slot_ids, False))])
    assert all(torch.equal(block_bytes(tensors, t), e) for t, e in zip(targets, expected))
    engine.close()


@pytest.mark.parametrize("mover", MOVERS, ids=MOVER_IDS)
@pytest.mark.parametrize("runtime", ["auto", None], ids=["cudart", "torch-copies"])
def test_layer_jobs_move_only_their_layer_and_are_byte_exact(runtime, mover):
    tensors = flash_tensors()
    engine, copier, slots, layout = make_engine(tensors, runtime=runtime, block_mover=mover)
    if runtime == "auto":
        assert copier._runtime is not None, "torch's CUDA runtime was not found"
    block_ids, slot_ids = np.array([3, 4, 5, 60, 7]), np.array([10, 11, 12, 40, 41])  # two runs of slots
    slots[:] = 0
    layer = 2
    finish(engine, [engine.submit(TransferJob(block_ids, slot_ids, True, tensor_indices=(layer,)))])
    segs = layout.segments_of((layer,))
    columns = slice(segs[0].slot_offset, segs[-1].slot_offset + segs[-1].nbytes)
    for block, slot in zip(block_ids, slot_ids):
        assert torch.equal(slots[slot, columns], tensors[layer][:, block].reshape(-1).view(torch.uint8).cpu())
        assert int(slots[slot, :columns.start].count_nonzero()) == 0  # other layers untouched
        assert int(slots[slot, columns.stop:].count_nonzero()) == 0
    expected = tensors[layer][:, block_ids].clone()
    tensors[layer].zero_()
    finish(engine, [engine.submit(TransferJob(block_ids, slot_ids, False, tensor_indices=(layer,)))])
    assert torch.equal(tensors[layer][:, block_ids].view(torch.int16), expected.view(torch.int16))
    engine.close()


# --- pools ------------------------------------------------------------------------------
def test_200_jobs_in_flight_are_each_reported_once_and_every_stream_returns():
    tensors = flash_tensors(num_layers=2)
    engine, copier, _, _ = make_engine(tensors, staging_bytes=1 << 20)  # several chunks a job: both lanes
    rng = np.random.default_rng(1)
    ids = [engine.submit(TransferJob(rng.choice(NB, 12, replace=False), rng.choice(NB, 12, replace=False),
                                     bool(i % 2))) for i in range(200)]
    results = finish(engine, ids)
    assert sorted(results) == sorted(ids) and all(r.success for r in results.values())
    assert engine.num_in_flight == 0 and engine.poll() == []
    assert copier.lane_pool.idle() == copier.lane_pool.made() and min(copier.lane_pool.made()) > 0
    engine.close()


def test_a_failed_job_returns_its_stream_and_event_and_the_copier_goes_on():
    tensors = flash_tensors(num_layers=2)
    engine, copier, slots, _ = make_engine(tensors)
    finish(engine, [engine.submit(TransferJob(np.array([1]), np.array([0]), True))])  # one stream made
    made = copier.lane_pool.made()
    bad = [engine.submit(TransferJob(np.array([1, NB]), np.array([0, 1]), True)),  # block id out of range
           engine.submit(TransferJob(np.array([1, 2]), np.array([0, NB]), False)),  # slot id out of range
           engine.submit(TransferJob(np.array([1, 2]), np.array([0]), True))]  # lengths differ
    results = engine.poll()
    assert {r.job_id for r in results} == set(bad) and not any(r.success for r in results)
    assert all("out of range" in r.error or "same length" in r.error for r in results)
    assert copier.lane_pool.made() == made and copier.lane_pool.idle() == made
    good = engine.submit(TransferJob(np.array([5, 6]), np.array([2, 3]), True))
    assert finish(engine, [good])[good].success
    torch.cuda.synchronize()  # the context is healthy: no device-side assert was raised
    assert torch.equal(slots[2], block_bytes(tensors, 5))
    engine.close()


class FailingRuntime:
    """A fake CUDA runtime: torch's own copies, until ``failing`` is set; then every copy
    fails, after the job's gather is already queued."""

    def __init__(self):
        from kvtier.transfer.cuda_runtime import load_cuda_runtime
        self.real = load_cuda_runtime()
        self.failing = False

    def memcpy_2d(self, *args):
        if self.failing:
            raise RuntimeError("cudaMemcpy2DAsync failed with CUDA error 1")
        self.real.memcpy_2d(*args)

    def memcpy(self, *args):
        if self.failing:
            raise RuntimeError("cudaMemcpyAsync failed with CUDA error 1")
        self.real.memcpy(*args)

    can_batch = False  # whole-slot runs go through memcpy


def test_a_job_that_fails_mid_launch_returns_its_stream_and_event():
    tensors = flash_tensors(num_layers=2)
    runtime = FailingRuntime()
    engine, copier, _, _ = make_engine(tensors, runtime=runtime)
    made = copier.lane_pool.made()
    runtime.failing = True
    job = engine.submit(TransferJob(np.arange(8), np.arange(8), True, tensor_indices=(0,)))
    (result,) = engine.poll()
    assert result.job_id == job and not result.success and "cudaMemcpy2DAsync failed" in result.error
    whole = engine.submit(TransferJob(np.arange(8), np.arange(8), True))  # whole slots: plain DMAs fail too
    (result,) = engine.poll()
    assert result.job_id == whole and not result.success and "cudaMemcpyAsync failed" in result.error
    assert copier.lane_pool.made() == made  # the pooled stream, event and buffer served both
    assert copier.lane_pool.idle() == made
    runtime.failing = False
    job = engine.submit(TransferJob(np.arange(8), np.arange(8), True))
    assert finish(engine, [job])[job].success
    engine.close()


# --- ordering against the compute stream -------------------------------------------------
def test_a_store_copies_what_the_compute_stream_writes_late():
    tensors = flash_tensors()
    engine, _, slots, _ = make_engine(tensors)
    block_ids, slot_ids = np.arange(8, 40), np.arange(32)
    final = [torch.empty_like(t).view(torch.int16).random_().view(t.dtype) for t in tensors]
    torch.cuda._sleep(LONG)  # the model's forward, still running when the store is submitted ...
    for t, f in zip(tensors, final):
        t.copy_(f)  # ... writes the KV at its very end
    job = engine.submit(TransferJob(block_ids, slot_ids, True))
    finish(engine, [job])
    for block, slot in zip(block_ids, slot_ids):
        assert torch.equal(slots[slot], block_bytes(final, block)), f"block {block}: the store read stale KV"
    engine.close()


def test_submitting_a_store_does_not_wait_for_the_compute_stream():
    tensors = flash_tensors()
    engine, _, _, _ = make_engine(tensors)
    engine.submit(TransferJob(np.arange(4), np.arange(4), True))  # first use: pinned ids, pools, allocator
    engine.wait(range(10))
    engine.poll()
    torch.cuda._sleep(5 * LONG)
    compute_done = torch.cuda.Event()
    compute_done.record()
    job = engine.submit(TransferJob(np.arange(32), np.arange(32), True))
    # Had submit waited on the host for the compute stream, the long kernel would be over.
    assert not compute_done.query(), "submitting a store waited for the model's queued compute"
    finish(engine, [job])
    engine.close()


def test_a_layer_store_waits_for_its_layer_and_not_for_later_layers():
    tensors = flash_tensors()
    engine, _, slots, layout = make_engine(tensors)
    block_ids, slot_ids = np.arange(0, 32), np.arange(32, 64)
    final = [torch.empty_like(t).view(torch.int16).random_().view(t.dtype) for t in tensors]
    torch.cuda._sleep(LONG)
    tensors[0].copy_(final[0])  # layer 0's attention writes its KV late ...
    first = engine.submit(TransferJob(block_ids, slot_ids, True, tensor_indices=(0,)))  # ... and its store follows
    torch.cuda._sleep(10 * LONG)  # layer 1's compute: long
    tensors[1].copy_(final[1])
    layer1_done = torch.cuda.Event()
    layer1_done.record()
    finish(engine, [first])
    assert not layer1_done.query(), "layer 0's store waited for layer 1's compute"
    second = engine.submit(TransferJob(block_ids, slot_ids, True, tensor_indices=(1,)))
    finish(engine, [second])
    for layer in (0, 1):
        segs = layout.segments_of((layer,))
        columns = slice(segs[0].slot_offset, segs[-1].slot_offset + segs[-1].nbytes)
        for block, slot in zip(block_ids, slot_ids):
            assert torch.equal(slots[slot, columns], final[layer][:, block].reshape(-1).view(torch.uint8).cpu()), \
                f"layer {layer} block {block}: the store read stale KV"
    engine.close()


@pytest.mark.parametrize("layer", [None, 1], ids=["whole", "layer"])
def test_compute_reads_loaded_blocks_only_after_the_load(layer):
    tensors = flash_tensors(num_layers=4, heads=16)  # 256 KiB a layer's block: a load takes a while
    engine, _, slots, _ = make_engine(tensors)
    block_ids, slot_ids = np.arange(0, 64), np.arange(64)
    slots.view(torch.int16).random_()
    for t in tensors:
        t.zero_()
    torch.cuda._sleep(LONG)  # the previous step's compute: the load starts after it
    indices = None if layer is None else (layer,)
    job = engine.submit(TransferJob(block_ids, slot_ids, False, tensor_indices=indices))
    assert engine.order_compute_after([job])  # wait_for_layer_load / the next forward
    seen = [t.clone() for t in tensors]  # the next forward reads the blocks, on the compute stream
    finish(engine, [job])
    torch.cuda.synchronize()
    for index, (t, s) in enumerate(zip(tensors, seen)):
        if layer is None or index == layer:
            assert torch.equal(s.view(torch.int16), t.view(torch.int16)), "compute read a block before its load"
    engine.close()


def test_a_load_does_not_overwrite_blocks_that_queued_compute_still_reads():
    tensors = flash_tensors()
    engine, _, slots, _ = make_engine(tensors)
    block_ids, slot_ids = np.arange(0, 32), np.arange(32)
    slots.view(torch.int16).random_()
    before = [t.clone() for t in tensors]
    torch.cuda._sleep(LONG)
    seen = [t.clone() for t in tensors]  # queued compute that still reads the blocks' old contents
    job = engine.submit(TransferJob(block_ids, slot_ids, False))
    finish(engine, [job])
    torch.cuda.synchronize()
    assert all(torch.equal(s.view(torch.int16), b.view(torch.int16)) for s, b in zip(seen, before)), \
        "a load overwrote blocks before queued compute read them"
    engine.close()


def mla_tensors(num_layers=4, num_blocks=NB, block_size=BS, latent=576):
    """vLLM CUDA MLA layout: per layer [num_blocks, block_size, kv_lora_rank + rope dim]."""
    tensors = [torch.empty(num_blocks, block_size, latent, device="cuda", dtype=torch.bfloat16)
               for _ in range(num_layers)]
    for t in tensors:
        t.view(torch.int16).random_()
    return tensors


@pytest.mark.parametrize("per_layer", [True, False])
@pytest.mark.parametrize("layout", ["flash", "mla"])
def test_worker_layerwise_load_and_store_through_the_compute_stream(disk_dir, layout, per_layer):
    """TierWorker on CUDA: layer-wise stores after each layer's write, then loads within the step
    (layer by layer, or one copy of every layer) that the compute stream waits for (no host wait)."""
    from test_tiering import BS as ENGINE_BS, NB as ENGINE_NB, Engine, keys_of

    make = flash_tensors if layout == "flash" else mla_tensors
    tensors = make(num_blocks=ENGINE_NB, block_size=ENGINE_BS)
    blocks = (lambda t, ids: t[:, ids]) if layout == "flash" else (lambda t, ids: t[ids])
    engine = Engine(tensors, disk_dir, host_blocks=32, layerwise=True)
    worker = engine.worker
    block_ids = list(range(10, 26))
    final = [torch.empty_like(t).view(torch.int16).random_().view(t.dtype) for t in tensors]
    job = engine.manager.plan_store("r", keys_of(range(16)), block_ids)
    worker.prepare_store_layers(job)
    for layer, (t, f) in enumerate(zip(tensors, final)):
        torch.cuda._sleep(LONG // 4)  # the layer's attention ...
        t.copy_(f)  # ... writes its KV, then its store is enqueued
        worker.submit_store_layer(job, layer)
    worker.submit_store(job)
    assert worker.wait_for_device_reads([job.job_id])  # the end of the step: blocks may be reused next
    for t in tensors:
        t.zero_()  # the next step overwrites them, on the compute stream
    reports = []
    deadline = time.monotonic() + 30
    while not reports:
        assert time.monotonic() < deadline
        reports = worker.poll()
    engine.manager.on_reports(reports)
    assert reports[0].success
    targets = list(range(26, 42))
    load = engine.manager.plan_load("r", keys_of(range(16)), targets)
    assert not load.fill_keys  # every block is in host slots: a layer-wise load
    load = dataclasses.replace(load, in_step=True)
    worker.submit_load_in_step(load, per_layer=per_layer)
    seen = []
    for layer in range(len(tensors)):
        assert worker.wait_for_layer([load.job_id], layer)  # one copy of every layer: any layer waits for it
        seen.append(blocks(tensors[layer], targets).clone())  # this layer's attention reads its blocks
    torch.cuda.synchronize()
    for s, f in zip(seen, final):
        assert torch.equal(s.view(torch.int16), blocks(f, block_ids).view(torch.int16))
    reports = []
    while not reports:
        reports = worker.poll()
    engine.manager.on_reports(reports)
    assert reports[0].success and engine.manager.host.num_pins == 0
    engine.close()


# --- the I/O process beside a CUDA worker -------------------------------------------------
def test_a_copy_submitted_while_the_progress_thread_idles_is_reported_without_its_idle_wait(disk_dir, monkeypatch):
    """A CUDA copy's end is seen only by asking its event: the engine's step (``poll``) asks, so a
    store or a host hit submitted while the worker's progress thread sleeps out its idle wait is
    reported at a step after its copy, not after that wait (a host hit took a multiple of its copy
    time on an H200)."""
    from test_tiering import BS as ENGINE_BS, NB as ENGINE_NB, Engine, keys_of

    monkeypatch.setattr("kvtier.worker.tier_worker.IDLE_WAIT_S", 600.0)  # nothing else would wake it
    tensors = flash_tensors(num_blocks=ENGINE_NB, block_size=ENGINE_BS)
    engine = Engine(tensors, disk_dir, host_blocks=16)
    expected = [block_bytes(tensors, b) for b in (1, 2, 3, 4)]
    began = time.monotonic()
    engine.store(keys_of(range(4)), [1, 2, 3, 4])  # Engine.run fails past 30 s
    job, report = engine.load(keys_of(range(4)), [20, 21, 22, 23])
    assert time.monotonic() - began < 30 and report.success and len(job.ready_block_ids) == 4  # host hits
    torch.cuda.synchronize()
    assert all(torch.equal(block_bytes(tensors, 20 + i), expected[i]) for i in range(4))
    engine.close()



def test_the_host_pool_is_shared_memory_pinned_for_dma_and_a_store_reaches_disk_with_no_poll(disk_dir):
    """The worker's host pool is the memfd its I/O process maps, registered with CUDA; a store's
    device copy is found finished by kvtier's own thread and written with no engine step."""
    from test_io_process import _entries, _wait_until
    from test_tiering import BS as ENGINE_BS, NB as ENGINE_NB, Engine, keys_of

    tensors = flash_tensors(num_blocks=ENGINE_NB, block_size=ENGINE_BS)
    engine = Engine(tensors, disk_dir, host_blocks=16)
    assert engine.worker.host_buffer.is_pinned() and engine.worker.memory.fd >= 0
    keys = keys_of(range(8))
    job = engine.manager.plan_store("r", keys, list(range(1, 9)))
    torch.cuda._sleep(LONG)  # the step's compute, still queued when the store is submitted
    engine.worker.submit_store(job)  # nobody calls poll() below
    assert _wait_until(lambda: all(_entries(disk_dir, engine.worker.rank_fingerprint, keys)), 5.0)
    engine.run([], None, expect=1)  # the report, taken afterwards
    assert engine.manager.host.num_pins == 0
    engine.close()


def test_the_io_process_killed_mid_load_on_cuda_gives_a_recompute_and_the_next_load_is_exact(disk_dir):
    from test_io_process import kill_the_io_process_mid_load
    from test_tiering import BS as ENGINE_BS, NB as ENGINE_NB, Engine, keys_of

    tensors = flash_tensors(num_blocks=ENGINE_NB, block_size=ENGINE_BS)
    engine = Engine(tensors, disk_dir, host_blocks=4)
    expected = [block_bytes(tensors, b) for b in (1, 2, 3, 4)]
    kill_the_io_process_mid_load(engine)
    lanes = engine.worker.transfers._copier.lane_pool
    assert lanes.idle() == lanes.made()  # every stream, event and staging buffer of the failed load is back
    for t in tensors:
        t[:, 20:24].zero_()
    _, report = engine.load(keys_of(range(4)), [20, 21, 22, 23])  # through the new process's mapping
    assert report.success
    torch.cuda.synchronize()
    assert all(torch.equal(block_bytes(tensors, 20 + i), expected[i]) for i in range(4))
    assert engine.manager.host.num_pins == 0
    engine.close()


def test_after_the_kv_cache_is_released_and_mapped_elsewhere_loads_go_to_the_new_memory(disk_dir):
    """Sleep mode on CUDA: the worker's copies stop while the cache is released, then the
    copier's device address tables are rebuilt for the cache at its new addresses."""
    from test_tiering import BS as ENGINE_BS, NB as ENGINE_NB, Engine, keys_of

    tensors = flash_tensors(num_blocks=ENGINE_NB, block_size=ENGINE_BS)
    engine = Engine(tensors, disk_dir, host_blocks=16)
    expected = [block_bytes(tensors, b) for b in (1, 2, 3, 4)]
    engine.store(keys_of(range(4)), [1, 2, 3, 4])
    engine.worker.suspend_device(timeout=30)
    stale = [t.detach() for t in tensors]  # the old mapping
    for t in tensors:
        t.set_(torch.zeros_like(t))  # the cache comes back at other addresses
    for s in stale:
        s.zero_()
    _, report = engine.load(keys_of(range(4)), [10, 11, 12, 13])  # while released: no copy, a recompute
    assert not report.success and sorted(report.failed_block_ids) == [10, 11, 12, 13]
    engine.worker.resume_device()
    _, report = engine.load(keys_of(range(4)), [20, 21, 22, 23])
    assert report.success
    torch.cuda.synchronize()
    assert all(torch.equal(block_bytes(tensors, 20 + i), expected[i]) for i in range(4))
    assert all(int(s.count_nonzero()) == 0 for s in stale)  # nothing went to the old mapping
    engine.store(keys_of(range(50, 52)), [20, 21])  # stores read the new mapping
    assert engine.manager.host.num_pins == 0
    engine.close()


def test_concurrent_jobs_with_random_aborts_on_cuda_release_every_pin(disk_dir):
    from test_tiering import BS as ENGINE_BS, NB as ENGINE_NB, Engine, run_with_random_aborts

    tensors = flash_tensors(num_blocks=ENGINE_NB, block_size=ENGINE_BS)
    run_with_random_aborts(Engine(tensors, disk_dir, host_blocks=12, disk_blocks=40), rounds=60, seed=1)
