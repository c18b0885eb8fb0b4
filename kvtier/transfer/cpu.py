"""CPU device: blocks are copied by a native loop (``copy_blocks``, GIL released) on copy threads.

A copy of whole slots can take each slot's checksum in the same loop, piece by piece while
its bytes are in cache (``checksums``): a store's, so that the I/O process frames the
slot's entries for every tier without reading the slot again; a checked load's, so that
the I/O process need not read an entry's bytes to check them before the load does."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from kvtier._native import copy_runs
from kvtier.common.layout import KVLayout
from kvtier.transfer.engine import DeviceCopier, TransferJob, TransferResult


logger = logging.getLogger("kvtier.transfer")


class CpuCopier(DeviceCopier):
    """Copies run on ``num_threads`` threads; ``start`` only enqueues."""

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], host_buffer: torch.Tensor, num_threads: int,
                 head_bytes: int = 0, checksums: bool = False):
        """``host_buffer`` holds the slots, each after a head of ``head_bytes`` (``kvtier.common.host_slots``).
        ``checksums``: a store of whole slots, and a ``checked`` load of them, report each slot's xxh3-64
        (``TransferResult.checksums``)."""
        self._layout = layout
        # Copies use raw addresses: hold the tensors so their memory outlives every copy.
        self._tensors = list(tensors)
        self._host_buffer = host_buffer
        self._tensor_addresses = [t.data_ptr() for t in self._tensors]
        self._host_address = host_buffer.data_ptr() + head_bytes  # slot 0's first byte
        self._slot_pitch = head_bytes + layout.slot_bytes
        self._num_slots = host_buffer.numel() // self._slot_pitch
        # Segment tables by tensor_indices: all tensors, and each alone (a layer-wise job).
        self._segments: dict[tuple[int, ...] | None, np.ndarray] = {
            indices: layout.segment_table(self._tensor_addresses, indices)
            for indices in [None, *((i,) for i in range(len(self._tensors)))]}
        # A checksum covers a slot: only where the segments write every byte of it, in order.
        table = self._segments[None]
        self.takes_checksums = checksums and bool(np.array_equal(table[:, 2], np.cumsum(table[:, 3]) - table[:, 3])
                                                  and table[:, 3].sum() == layout.slot_bytes)
        self._num_threads = num_threads
        # Plain threads on a SimpleQueue: a put is far cheaper for the caller (the compute
        # thread, once per layer) than an executor's submit, which creates a Future and
        # takes locks on the way to waking an idle thread.
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"kvtier-copy-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            function, *args = task
            try:
                function(*args)  # both task kinds report their own errors; this keeps the thread alive
            except Exception:
                logger.exception("kvtier: copy task failed")

    def job_bytes(self, job: TransferJob) -> int:
        return len(job.block_ids) * sum(s.nbytes for s in self._layout.segments_of(job.tensor_indices))

    def start(self, job: TransferJob, on_done: Callable[[TransferResult], None]) -> None:
        # Only enqueue, so that a caller on the engine's compute thread (a layer-wise
        # store after each layer) returns at once.
        self._tasks.put((self._copy, job, on_done))

    def start_inline(self, job: TransferJob, on_done: Callable[[TransferResult], None]) -> bool:
        # On the caller's thread, in one part: no handoff to a copy thread, each of which costs
        # up to a GIL switch interval while the engine's thread is busy.
        self._copy(job, on_done, split=False)
        return True

    def _copy(self, job: TransferJob, on_done: Callable[[TransferResult], None], split: bool = True) -> None:
        began = time.perf_counter()
        try:
            segments = self._segments.get(job.tensor_indices)
            if segments is None:  # another subset of tensors: its table made on first use
                segments = self._segments.setdefault(
                    job.tensor_indices, self._layout.segment_table(self._tensor_addresses, job.tensor_indices))
            block_ids = np.ascontiguousarray(job.block_ids, np.int64)
            slot_ids = np.ascontiguousarray(job.slot_ids, np.int64)
            if block_ids.shape != slot_ids.shape:
                raise ValueError("block_ids and slot_ids must have the same length")
            whole = self.takes_checksums and (job.to_host or job.checked) and job.tensor_indices is None
            sums = np.empty(block_ids.size, np.uint64) if whole else None
        except Exception as error:  # a bad job is a failed job, reported once
            on_done(TransferResult(job.job_id, False, 0, 0.0, f"{type(error).__name__}: {error}"))
            return
        if not split or self._num_threads == 1 or block_ids.size < 2:
            # One part: copied here and reported at once. The shortest path: the copy thread
            # holds the GIL around the copy as briefly as it can (a layer-wise job's compute
            # thread may be waiting for it between two ops).
            try:
                num_bytes = copy_runs.copy_blocks(segments, block_ids, slot_ids, self._host_address,
                                                  self._layout.slot_bytes, self._layout.num_blocks, self._num_slots,
                                                  job.to_host, self._slot_pitch, sums)
                result = TransferResult(job.job_id, True, num_bytes, time.perf_counter() - began, checksums=sums)
            except Exception as error:
                result = TransferResult(job.job_id, False, 0, 0.0, f"{type(error).__name__}: {error}")
            on_done(result)
            return
        # Split by blocks: every block of a job has the same size, so parts are equal in bytes.
        parts = [slice(p[0], p[-1] + 1) for p in np.array_split(np.arange(block_ids.size), self._num_threads) if p.size]
        remaining = [len(parts)]
        copied = [0]
        errors: list[str] = []
        lock = threading.Lock()

        def run(part: slice) -> None:
            try:
                num_bytes = copy_runs.copy_blocks(segments, block_ids[part], slot_ids[part], self._host_address,
                                                  self._layout.slot_bytes, self._layout.num_blocks, self._num_slots,
                                                  job.to_host, self._slot_pitch, None if sums is None else sums[part])
            except Exception as error:
                num_bytes = 0
                with lock:
                    errors.append(f"{type(error).__name__}: {error}")
            with lock:
                copied[0] += num_bytes
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:  # exactly one thread reports the job, after every part has finished
                on_done(TransferResult(job.job_id, not errors, copied[0], time.perf_counter() - began,
                                       errors[0] if errors else None, sums))  # every part's sums are in

        for part in parts[1:]:  # the other copy threads take these; this one copies the first
            self._tasks.put((run, part))
        run(parts[0])

    def close(self) -> None:
        for _ in self._threads:  # after the tasks already queued: every started job is reported
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()
