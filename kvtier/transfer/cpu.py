"""CPU device: blocks are copied by a native memcpy loop on worker threads."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from kvtier._native import copy_runs
from kvtier.layout import KVLayout
from kvtier.transfer.engine import DeviceCopier, TransferJob, TransferResult


def split_by_bytes(lengths: np.ndarray, num_parts: int) -> list[slice]:
    """Cut a run list into at most ``num_parts`` consecutive parts of about equal bytes."""
    if lengths.size == 0:
        return []
    if num_parts <= 1 or lengths.size == 1:
        return [slice(0, int(lengths.size))]  # the common case on the hot path: nothing to compute
    ends = np.cumsum(lengths)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, num_parts) / num_parts, side="right")
    bounds = sorted({0, int(lengths.size), *(int(c) for c in cuts)})
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


logger = logging.getLogger("kvtier.transfer")


class CpuCopier(DeviceCopier):
    """Copies run on ``num_threads`` threads; ``start`` only enqueues."""

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], host_buffer: torch.Tensor, num_threads: int):
        self._layout = layout
        # Copies use raw addresses: hold the tensors so their memory outlives every copy.
        self._tensors = list(tensors)
        self._host_buffer = host_buffer
        self._tensor_addresses = [t.data_ptr() for t in self._tensors]
        self._host_address = host_buffer.data_ptr()
        self._num_threads = num_threads
        # Plain threads on a SimpleQueue: a put is far cheaper for the caller (the compute
        # thread, once per layer) than an executor's submit, which creates a Future and
        # measured 50 to 230 us here when it woke an idle thread.
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
        # Only enqueue: the runs are planned on a copy thread too, so that a caller on the
        # engine's compute thread (a layer-wise store after each layer) returns at once.
        self._tasks.put((self._plan_and_copy, job, on_done))

    def _plan_and_copy(self, job: TransferJob, on_done: Callable[[TransferResult], None]) -> None:
        began = time.perf_counter()
        try:
            dst, src, lengths = job.runs or self._layout.copy_runs(
                self._tensor_addresses, self._host_address, job.block_ids, job.slot_ids, job.to_host, job.tensor_indices)
        except Exception as error:  # a bad plan is a failed job, reported once
            on_done(TransferResult(job.job_id, False, 0, 0.0, f"{type(error).__name__}: {error}"))
            return
        parts = split_by_bytes(lengths, self._num_threads)
        if not parts:
            on_done(TransferResult(job.job_id, True, 0, 0.0))
            return
        remaining = [len(parts)]
        errors: list[str] = []
        lock = threading.Lock()

        def run(part: slice) -> None:
            try:
                copy_runs.copy(dst[part], src[part], lengths[part])
            except Exception as error:
                with lock:
                    errors.append(f"{type(error).__name__}: {error}")
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:  # exactly one thread reports the job, after every part has finished
                on_done(TransferResult(job.job_id, not errors, int(lengths.sum()),
                                       time.perf_counter() - began, errors[0] if errors else None))

        for part in parts[1:]:  # the other copy threads take these; this one copies the first
            self._tasks.put((run, part))
        run(parts[0])

    def close(self) -> None:
        for _ in self._threads:  # after the tasks already queued: every started job is reported
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()
