import threading

import numpy as np
import pytest
import torch

from kvtier.common.entry import checksum
from kvtier.common.layout import detect_layout
from kvtier.transfer.cpu import CpuCopier
from kvtier.transfer.engine import TransferEngine, TransferJob
from kvtier.transfer.host_buffer import allocate_host_buffer
from kvtier.worker import tensor_info

NB, BS = 64, 4


def make_engine(num_slots=64, threads=2, checksums=False):
    tensors = [torch.randint(-1000, 1000, (NB, 2, BS, 5), dtype=torch.int16) for _ in range(3)]  # 80-byte runs
    layout = detect_layout([tensor_info(t) for t in tensors], NB, BS)
    host = allocate_host_buffer(num_slots, layout.slot_bytes, pin=False)
    engine = TransferEngine(CpuCopier(layout, tensors, host, threads, checksums=checksums))
    return engine, tensors, host, layout


def drain(engine, count):
    results = []
    while len(results) < count:
        engine.wait(set(range(10**6)) - {r.job_id for r in results}, timeout=0.01)
        results += engine.poll()
    return results


def test_every_job_is_reported_exactly_once_with_many_in_flight():
    engine, tensors, _, _ = make_engine()
    rng = np.random.default_rng(0)
    ids = [engine.submit(TransferJob(rng.choice(NB, 8, replace=False), rng.choice(64, 8, replace=False), True))
           for _ in range(200)]
    results = drain(engine, 200)
    assert sorted(r.job_id for r in results) == sorted(ids) and all(r.success for r in results)
    assert engine.poll() == [] and engine.num_in_flight == 0
    engine.close()


def test_submission_from_many_threads_loses_nothing():
    engine, *_ = make_engine()
    rng = np.random.default_rng(1)
    jobs = [TransferJob(rng.choice(NB, 4, replace=False), rng.choice(64, 4, replace=False), bool(i % 2))
            for i in range(120)]
    threads = [threading.Thread(target=lambda part=part: [engine.submit(j) for j in part])
               for part in (jobs[0::3], jobs[1::3], jobs[2::3])]
    for t in threads:
        t.start()
    collected = []
    while len(collected) < 120:
        collected += engine.poll()
    for t in threads:
        t.join()
    assert len({r.job_id for r in collected}) == 120
    engine.close()


def test_a_bad_job_is_a_failed_result_not_an_exception():
    engine, *_ = make_engine()
    job_id = engine.submit(TransferJob(np.array([NB + 5]), np.array([0]), True))
    (result,) = drain(engine, 1)
    assert result.job_id == job_id and not result.success and "out of range" in result.error
    engine.close()


def test_store_then_load_is_byte_exact_with_scattered_ids():
    engine, tensors, _, _ = make_engine()
    block_ids, slot_ids = np.array([7, 3, 50, 51, 52, 9]), np.array([10, 11, 2, 3, 4, 40])
    before = [t[block_ids].clone() for t in tensors]
    engine.submit(TransferJob(block_ids, slot_ids, True))
    drain(engine, 1)
    for t in tensors:
        t[block_ids] = 0
    engine.submit(TransferJob(block_ids, slot_ids, False))
    drain(engine, 1)
    assert all(torch.equal(t[block_ids], b) for t, b in zip(tensors, before))
    engine.close()


@pytest.mark.parametrize("threads", [1, 2])  # one part copied in place; parts on several threads
def test_a_store_of_whole_slots_and_a_checked_load_report_each_slots_checksum_and_nothing_else_does(threads):
    """``checksums``: a store's result carries each slot's xxh3-64 in the job's order (what its tier
    writes frame the entries with), and so does a ``checked`` load's (what the load compares with its
    entries'); a layer's copy, an unchecked load, and a copier without them carry none."""
    engine, tensors, host, layout = make_engine(threads=threads, checksums=True)
    assert engine.takes_checksums
    slots = host.numpy().reshape(64, layout.slot_bytes)
    block_ids, slot_ids = np.array([7, 3, 50, 51, 52, 9, 60]), np.array([10, 11, 2, 3, 4, 40, 63])
    stores = [engine.submit(TransferJob(block_ids, slot_ids, True)),
              engine.submit(TransferJob(block_ids, slot_ids, True, tensor_indices=(1,))),
              engine.submit(TransferJob(block_ids, slot_ids, False))]
    results = {r.job_id: r for r in drain(engine, 3)}
    assert all(r.success for r in results.values())
    assert results[stores[0]].checksums.tolist() == [checksum(slots[s]) for s in slot_ids]
    assert results[stores[1]].checksums is None and results[stores[2]].checksums is None
    slots[slot_ids[2]] ^= 0x5A  # the load reports what it read
    loaded = engine.submit(TransferJob(block_ids[::-1], slot_ids, False, checked=True))
    result, = drain(engine, 1)
    assert result.job_id == loaded and result.success
    assert result.checksums.tolist() == [checksum(slots[s]) for s in slot_ids]
    assert all(torch.equal(t[block_ids[::-1][2]].view(-1).view(torch.uint8), torch.from_numpy(
        slots[slot_ids[2]][i * t[0].nbytes:(i + 1) * t[0].nbytes])) for i, t in enumerate(tensors))
    engine.close()
    plain, *_ = make_engine(threads=threads)
    assert not plain.takes_checksums
    plain.submit(TransferJob(block_ids, slot_ids, True))
    plain.submit(TransferJob(block_ids, slot_ids, False, checked=True))
    assert [r.checksums for r in drain(plain, 2)] == [None, None]
    plain.close()


@pytest.mark.parametrize("threads", [1, 2])  # one part copied in place; parts on several threads
def test_a_job_with_a_bad_id_fails_and_the_copier_goes_on(threads):
    engine, tensors, _, _ = make_engine(num_slots=8, threads=threads)
    bad = engine.submit(TransferJob(np.array([1, 2]), np.array([0, 8]), True))  # slot 8 of 8
    good = engine.submit(TransferJob(np.array([1, 2]), np.array([0, 1]), True))
    results = {r.job_id: r for r in drain(engine, 2)}
    assert not results[bad].success and "out of range" in results[bad].error
    assert results[good].success and results[good].num_bytes == 2 * sum(t[0].nbytes for t in tensors)
    engine.close()


def test_the_cuda_copier_checks_every_id_on_the_host_before_it_queues_a_copy():
    """Pure host code, run here without a device: an id out of range would be a device-side assert
    on the GPU, which poisons the engine's CUDA context."""
    from kvtier.transfer.cuda import checked_ids

    blocks, slots = checked_ids(TransferJob([3, 0, 9], np.array([1, 7, 0]), True), num_blocks=10, num_slots=8)
    assert blocks.dtype == slots.dtype == np.int64 and blocks.tolist() == [3, 0, 9] and slots.tolist() == [1, 7, 0]
    assert checked_ids(TransferJob([], [], False), 10, 8)[0].size == 0
    for block_ids, slot_ids, why in (([10], [0], "block id out of range"), ([-1], [0], "block id out of range"),
                                     ([0], [8], "slot id out of range"), ([0], [-1], "slot id out of range"),
                                     ([0, 1], [0], "same length"), ([[0]], [[0]], "1-D")):
        with pytest.raises(ValueError, match=why):
            checked_ids(TransferJob(np.array(block_ids), np.array(slot_ids), True), 10, 8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copier_round_trip_on_pooled_streams():
    from kvtier.transfer.cuda import CudaCopier
    tensors = [torch.randn(2, NB, BS, 3, 8, device="cuda", dtype=torch.float16) for _ in range(2)]
    layout = detect_layout([tensor_info(t) for t in tensors], NB, BS)
    host = allocate_host_buffer(32, layout.slot_bytes, pin=True)
    engine = TransferEngine(CudaCopier(layout, tensors, host))
    block_ids, slot_ids = np.array([5, 6, 7, 20]), np.array([3, 4, 5, 9])
    before = [t[:, block_ids].clone() for t in tensors]
    engine.submit(TransferJob(block_ids, slot_ids, True))
    drain(engine, 1)
    for t in tensors:
        t[:, block_ids] = 0
    engine.submit(TransferJob(block_ids, slot_ids, False))
    drain(engine, 1)
    torch.cuda.synchronize()
    assert all(torch.equal(t[:, block_ids], b) for t, b in zip(tensors, before))
    engine.close()
