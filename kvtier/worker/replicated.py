"""Tensor parallelism with replicated KV (``save_only_first_rank``), around the worker's paths
(``ReplicatedLoadPath``, ``ReplicaStores``, put together by ``kvtier.worker.wrappers``).

Only rank 0 stores and reads the tiers. On a load, rank 0 fills its host slots as
usual and then broadcasts the blocks (``ShardedBroadcaster``); the other ranks
take them straight into their KV cache and never touch a tier. One thread per
rank runs the broadcasts, in job order, so every rank enters the same
collectives in the same order.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Sequence

import numpy as np
import torch

from kvtier.common.layout import KVLayout
from kvtier.common.plans import JobReport, LoadJob
from kvtier.transfer.broadcast import ShardedBroadcaster
from kvtier.worker.loads import LoadPath
from kvtier.worker.stores import StorePath

logger = logging.getLogger("kvtier.worker.replicated")


class ReplicatedLoads:
    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], group, shard_blocks: int,
                 host_slots: np.ndarray, is_source: bool):
        self.is_source = is_source  # rank 0: reads the tiers and sends; the others receive
        self.broadcaster = ShardedBroadcaster(layout, tensors, group, shard_blocks)
        self._host_slots = host_slots
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-broadcast")
        self._received: queue.SimpleQueue[JobReport] = queue.SimpleQueue()

    def rebind(self, tensors: Sequence[torch.Tensor]) -> None:
        self.broadcaster.addresses = [t.data_ptr() for t in tensors]

    def send(self, job: LoadJob, wait_for_fills, usable_blocks) -> None:
        """Rank 0: queue the broadcast now (job order); it sends once ``wait_for_fills()``
        returns, the blocks that ``usable_blocks()`` then names."""
        self._thread.submit(self._send, job, wait_for_fills, usable_blocks)

    def _send(self, job: LoadJob, wait_for_fills, usable_blocks) -> None:
        order = job.ready_block_ids + job.fill_block_ids  # the same list on every rank
        slots = job.ready_slot_ids + job.fill_slot_ids
        try:
            wait_for_fills()
            usable = usable_blocks()
            available = np.array([block in usable for block in order], dtype=bool)
        except Exception as error:  # still enter the collectives, offering nothing: the others fall back
            logger.error("kvtier: load job %d could not be prepared for broadcast: %r", job.job_id, error)
            available = np.zeros(len(order), dtype=bool)
        try:
            result = self.broadcaster.load(order, self._host_slots, slots, available)
        except Exception as error:  # the other ranks report their blocks as failed
            logger.error("kvtier: broadcast of load job %d failed: %r", job.job_id, error)
            return
        if not result.ok:
            logger.warning("kvtier: broadcast of load job %d fell back to recompute on every rank", job.job_id)

    def receive(self, job: LoadJob) -> None:
        """Other ranks: take rank 0's blocks into the KV cache; reported by ``poll``."""
        self._thread.submit(self._receive, job)

    def _receive(self, job: LoadJob) -> None:
        order, began = job.ready_block_ids + job.fill_block_ids, time.monotonic()
        try:
            result = self.broadcaster.load(order)
            missing, seconds = [block for block, got in zip(order, result.received) if not got], result.seconds
        except Exception as error:  # reported as failed blocks, so the request is recomputed, never stuck
            logger.error("kvtier: broadcast of load job %d failed: %r", job.job_id, error)
            missing, seconds = list(order), 0.0
        self._received.put(JobReport(job.job_id, is_load=True, success=not missing and not job.missing_block_ids,
                                     failed_block_ids=missing + list(job.missing_block_ids), seconds=seconds,
                                     began_at=began, filled_at=began, finished_at=time.monotonic()))

    def poll(self) -> list[JobReport]:
        reports = []
        while not self._received.empty():
            reports.append(self._received.get_nowait())
        return reports

    def close(self, timeout_s: float) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.broadcaster.close(timeout_s)  # a broken load's collectives end before the group goes

    def counters(self) -> dict[str, int]:
        return {}


class ReplicatedLoadPath(LoadPath):
    """Rank 0 loads as every worker does and broadcasts each load's blocks once its reads are in;
    the other ranks take them from the broadcast and never read a tier."""

    replicated: ReplicatedLoads

    def __init__(self, *args, **kwargs):
        # No checksums in the copy: other ranks get rank 0's slots before its copy has checked them.
        super().__init__(*args, **{**kwargs, "check_in_copy": False})

    def submit(self, job: LoadJob) -> None:
        if not self.replicated.is_source:
            self.replicated.receive(job)  # the blocks come from rank 0's broadcast, never from the tiers
            return
        super().submit(job)

    def _began(self, load) -> None:
        # Queued before any read or copy starts: the broadcasts enter their collectives in job order.
        self.replicated.send(load.job, load.fills_settled.wait, partial(self._usable_blocks, load))

    def _usable_blocks(self, load) -> set[int]:
        with self.book.lock:
            usable = load.usable if not load.abandoned else load.usable[:len(load.job.ready_block_ids)]
            return {block for block, _, _ in usable}


class ReplicaStores(StorePath):
    """Ranks other than 0: rank 0 stores each block once for every rank; here a store copies
    nothing and is reported done."""

    def submit(self, job) -> None:
        with self.book.lock:
            if job.job_id not in self.book.stores:
                self.book.finish(JobReport(job.job_id, is_load=False, success=True))

    def submit_layer(self, job, layer: int) -> None:
        self.submit(job)

    def prepare_layers(self, job):
        return None
