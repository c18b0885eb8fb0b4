"""Sharded broadcast across real processes on torch.distributed (gloo)."""

import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvtier.common.layout import detect_layout
from kvtier.transfer.broadcast import ShardedBroadcaster
from kvtier.worker import tensor_info

NB, BS, LAYERS = 40, 4, 3


def _rank_main(rank, world, init_file, scenario, shard_blocks, results, barrier):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    truth = [torch.randint(-30000, 30000, (NB, 1, BS, 10), dtype=torch.int16) for _ in range(LAYERS)]  # 80-byte runs
    tensors = [t.clone() if rank == 0 else torch.zeros_like(t) for t in truth]
    layout = detect_layout([tensor_info(t) for t in tensors], NB, BS)
    block_ids = [3, 4, 5, 17, 30, 31, 32, 8, 9, 1, 0]
    source = slot_ids = available = None
    if rank == 0:  # the blocks sit in the host pool in reverse order, one free slot at the front
        rows = [np.concatenate([t[b].view(torch.uint8).numpy().reshape(-1) for t in truth]) for b in block_ids]
        source = np.stack([np.zeros_like(rows[0])] + rows[::-1])
        slot_ids = [len(block_ids) - i for i in range(len(block_ids))]
        available = np.ones(len(block_ids), dtype=bool)
        if scenario == "rank0-missing":
            available[[2, 6]] = False
    group = dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(seconds=3))  # kvtier's own group
    broadcaster = ShardedBroadcaster(layout, tensors, group, shard_blocks)
    if scenario == "rank0-fails-between-collectives":
        # Rank 0's host pool lacks the slots it names: it fails after the agreement, in the middle
        # of the protocol. Every rank must come out (the others at the group's timeout), broken,
        # and then fail every later load at once, with no collective that could pair wrongly.
        began = time.monotonic()
        try:
            broadcaster.load(block_ids, source[:2] if rank == 0 else None, slot_ids, available)
            raised = None
        except Exception as error:
            raised = type(error).__name__
        took = time.monotonic() - began
        began = time.monotonic()
        again = broadcaster.load(block_ids, source, slot_ids, available)
        again_took = time.monotonic() - began
        barrier.wait()  # as in a server, rank 0 stays up: the others come out by the group's timeout
        left = [work for _, _, work in broadcaster._abandoned]
        broadcaster.close(timeout_s=10)
        results[rank] = (raised, took, broadcaster.broken, again.ok, bool(again.received.any()), again_took,
                         len(left), all(work.is_completed() for work in left))
        barrier.wait()
        dist.destroy_process_group()  # no collective still running under it
        return
    result = broadcaster.load(block_ids, source, slot_ids, available, ready=not (scenario == "rank1-not-ready" and rank == 1))
    exact = all(torch.equal(t[b], r[b]) == bool(result.received[i] or rank == 0)
                for t, r in zip(tensors, truth) for i, b in enumerate(block_ids))
    untouched = all(torch.equal(t[b], r[b]) if rank == 0 else not t[b].any()
                    for t, r in zip(tensors, truth) for b in set(range(NB)) - set(block_ids))
    results[rank] = (result.ok, result.received.tolist(), result.peak_buffer_bytes, layout.slot_bytes, exact,
                     untouched)
    dist.destroy_process_group()


def run(world, scenario, shard_blocks, tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_main, args=(world, str(tmp_path / "init"), scenario, shard_blocks, results,
                               manager.Barrier(world, timeout=60)), nprocs=world, join=True)
    return dict(results)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_exact_bytes_with_at_most_two_shards_alive(world, tmp_path):
    results = run(world, "normal", shard_blocks=3, tmp_path=tmp_path)
    for rank, (ok, received, peak, slot_bytes, exact, untouched) in results.items():
        assert ok and all(received) and exact and untouched, rank
        assert peak <= 2 * 3 * slot_bytes  # the bound: two shards of three blocks


def test_blocks_rank0_lacks_are_not_sent_and_others_arrive(tmp_path):
    results = run(3, "rank0-missing", shard_blocks=4, tmp_path=tmp_path)
    for rank, (ok, received, _, _, exact, untouched) in results.items():
        assert ok and received == [i not in (2, 6) for i in range(11)] and exact and untouched, rank


def test_a_rank_that_cannot_take_part_makes_all_fall_back_together(tmp_path):
    results = run(3, "rank1-not-ready", shard_blocks=4, tmp_path=tmp_path)  # returns: nobody hangs
    for rank, (ok, received, peak, _, exact, untouched) in results.items():
        assert not ok and not any(received) and peak == 0 and exact and untouched, rank


def test_a_rank_that_fails_between_collectives_leaves_nobody_waiting_or_out_of_step(tmp_path):
    results = run(3, "rank0-fails-between-collectives", shard_blocks=4, tmp_path=tmp_path)
    assert results[0][0] == "IndexError"  # rank 0's own error
    for rank, (raised, took, broken, ok, received, again_took, left, ended) in results.items():
        assert raised is not None and broken, rank  # the others: the group's timeout, not 30 minutes
        assert took < 30 and not ok and not received and again_took < 0.5, rank
        assert ended, rank  # close waited for what the failed load had left running
        if rank:
            assert took >= 2.5 and left == 1, rank  # shard 1 was posted when shard 0's wait timed out
