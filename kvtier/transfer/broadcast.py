"""Tensor parallelism with replicated KV: rank 0 reads, then broadcasts in shards.

When every rank holds the same KV (MLA models; one KV head replicated by the
engine), storing it once is enough. On a hit, rank 0 has the blocks in its host
slots and sends them to the other ranks in shards of ``shard_blocks`` blocks:

    for shard i:  start broadcast of shard i+1   (async)
                  wait for shard i, copy it into the KV cache, drop its buffer

so shard i+1 travels while shard i is copied, and at most two shard buffers are
alive on a rank, whatever the prompt's length.

Every rank makes the same collective calls in the same order, on a process group
of kvtier's own (never the engine's, whose collectives run on another thread):
first rank 0 broadcasts which blocks it has; then all ranks agree, with one
all-reduce, that each of them is ready; only then do the shards move. A failure
anywhere (rank 0 missing blocks, a rank unable to take part) makes every rank
fall back to recompute together; no rank skips or substitutes a collective.

A rank that leaves the protocol half-way (an error on it between two collectives,
or a collective past the group's timeout because another rank did) is ``broken``
from then on: it never calls another collective, since a late one could pair with
the wrong call of another rank and deliver another job's bytes. Its later loads
fail at once (recompute), and the other ranks, timing out on it, break likewise.
The shard it had already posted is still in gloo's hands (it ends at the group's
timeout at the latest) and keeps its buffer alive; ``close`` waits for it, so that no
collective is still running when the process group and the process go away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from kvtier._native import copy_runs
from kvtier.common.layout import KVLayout


@dataclass
class BroadcastResult:
    ok: bool  # all ranks agreed and every shard arrived
    received: np.ndarray  # bool per block: which blocks this rank now has in its KV cache
    peak_buffer_bytes: int  # the most shard-buffer bytes alive at once on this rank
    seconds: float


class ShardedBroadcaster:
    """Runs on every rank, on its own thread; ``load`` is a collective call."""

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], group, shard_blocks: int,
                 src_rank: int = 0):
        self.layout = layout
        self.tensors = list(tensors)  # kept alive: copies use their addresses
        self.addresses = [t.data_ptr() for t in self.tensors]
        self.group = group
        self.shard_blocks = shard_blocks
        self.src_rank = src_rank
        self.rank = dist.get_rank(group)
        self.broken = False
        self._posted: list[tuple[np.ndarray, torch.Tensor, object]] = []  # shards sent, not yet waited for
        self._abandoned: list[tuple[np.ndarray, torch.Tensor, object]] = []  # what a failed load left running

    def load(self, block_ids: Sequence[int], host_slots: np.ndarray | None = None,
             slot_ids: Sequence[int] | None = None, available: np.ndarray | None = None,
             ready: bool = True) -> BroadcastResult:
        """Deliver ``block_ids`` (the same list on every rank) into every rank's KV cache.

        On rank 0, ``host_slots`` is the ``[num_slots, slot_bytes]`` uint8 host pool,
        ``slot_ids[i]`` the slot holding ``block_ids[i]``, and ``available`` marks which
        of them it has; other ranks pass none of these. The slots must stay pinned until
        this returns. ``ready`` is this rank's own ability to take part.
        """
        if self.broken:
            return BroadcastResult(False, np.zeros(len(block_ids), dtype=bool), 0, 0.0)
        try:
            return self._load(block_ids, host_slots, slot_ids, available, ready)
        except Exception:
            self.broken = True  # out of step with the other ranks: no collective ever again
            self._abandoned += self._posted  # with their buffers, which gloo may still fill or read
            self._posted = []
            raise

    def close(self, timeout_s: float) -> None:
        """Wait, up to ``timeout_s``, for the collectives a failed load left running: the
        group (and the process) must not be torn down under one."""
        deadline = time.monotonic() + timeout_s
        while self._abandoned:
            _, _, work = self._abandoned.pop()
            try:
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except Exception:  # it failed or timed out: either way it is over or past waiting for
                pass

    def _load(self, block_ids, host_slots, slot_ids, available, ready) -> BroadcastResult:
        began = time.perf_counter()
        n = len(block_ids)
        # 1. Which blocks rank 0 has: every rank learns the same mask.
        mask = torch.zeros(n, dtype=torch.uint8)
        if self.rank == self.src_rank:
            mask[:] = torch.from_numpy(np.asarray(available, dtype=np.uint8))
        dist.broadcast(mask, self.src_rank, group=self.group)
        # 2. Agreement: all ranks ready, or all fall back.
        flag = torch.tensor([1 if ready else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        received = np.zeros(n, dtype=bool)
        if int(flag.item()) == 0:
            return BroadcastResult(False, received, 0, time.perf_counter() - began)
        sendable = np.flatnonzero(mask.numpy().astype(bool))  # same on every rank
        shards = [sendable[i:i + self.shard_blocks] for i in range(0, len(sendable), self.shard_blocks)]
        slot_bytes = self.layout.slot_bytes
        slots_of_blocks = np.asarray(slot_ids, dtype=np.int64) if self.rank == self.src_rank else None
        live_bytes = peak = 0
        pending = self._posted = []

        def post(shard: np.ndarray):
            nonlocal live_bytes, peak
            if self.rank == self.src_rank:
                # Rank 0 gathers this shard's slots into one buffer: one shard at a time, never the prompt.
                buffer = torch.from_numpy(host_slots[slots_of_blocks[shard]])
            else:
                buffer = torch.empty((len(shard), slot_bytes), dtype=torch.uint8)
            live_bytes += buffer.numel()
            peak = max(peak, live_bytes)
            work = dist.broadcast(buffer, self.src_rank, group=self.group, async_op=True)
            pending.append((shard, buffer, work))

        if shards:
            post(shards[0])
        for i in range(len(shards)):
            if i + 1 < len(shards):
                post(shards[i + 1])  # the next shard travels while this one is copied
            shard, buffer, work = pending.pop(0)
            work.wait()  # the buffer is complete (and, on rank 0, no longer read) only now
            if self.rank != self.src_rank:
                ids = np.asarray(block_ids, dtype=np.int64)[shard]
                dst, src, lengths = self.layout.copy_runs(self.addresses, buffer.data_ptr(), ids,
                                                          np.arange(len(shard)), to_host=False)
                copy_runs.copy(dst, src, lengths)
            received[shard] = True
            live_bytes -= buffer.numel()
            del buffer  # released as soon as its copy is done: at most two shards alive
        return BroadcastResult(True, received, peak, time.perf_counter() - began)
