"""Transfer engine: copies blocks between the engine's KV cache and host slots.

This class runs in the worker. ``submit(job)`` returns at once; ``poll()`` returns
each finished job exactly once, with success or failure. It is thread-safe:
submission and completion may happen on different threads, and a completion is
never lost between calls.

The device work sits behind ``DeviceCopier``: ``CpuCopier`` copies on worker
threads, ``CudaCopier`` on pooled streams. A failure is a result (``success=False``
with the error's text), never an exception out of ``poll``.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TransferJob:
    """Copy ``block_ids[i]`` <-> ``slot_ids[i]``; ``to_host`` is a store."""

    block_ids: np.ndarray
    slot_ids: np.ndarray
    to_host: bool
    job_id: int = -1  # set by submit when left at -1
    tensor_indices: tuple[int, ...] | None = None  # only these KV tensors (one layer); None: all
    # A load whose copy takes each slot's checksum as it reads it (``TransferResult.checksums``), for
    # the load to compare with its entries' (only where the copier ``takes_checksums``).
    checked: bool = False


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    success: bool
    num_bytes: int
    seconds: float
    error: str | None = None
    # Where the copier took them (a store of whole slots, a checked load): each slot's xxh3-64, in job order.
    checksums: np.ndarray | None = None


class DeviceCopier(ABC):
    """The device-specific half of the transfer engine."""

    # Whether a copy of whole slots takes their checksums: a store's always, a load's where the job
    # is ``checked``. Where it does, entries are framed and checked with them (``kvtier.worker``).
    takes_checksums = False

    @abstractmethod
    def start(self, job: TransferJob, on_done) -> None:
        """Begin the copies of ``job`` without blocking; arrange for
        ``on_done(result)`` to be called exactly once when they have finished,
        or for ``poll_done`` to report them."""

    def poll_done(self) -> list[TransferResult]:
        """Results of jobs whose completion is detected by polling (CUDA events)."""
        return []

    def start_inline(self, job: TransferJob, on_done) -> bool:
        """Copy ``job`` on the calling thread and call ``on_done`` before returning, where the
        device can (False: nothing was done, use ``start``)."""
        return False

    @abstractmethod
    def job_bytes(self, job: TransferJob) -> int: ...

    def order_compute_after(self, job_ids) -> bool:
        """Order the engine's next compute after these jobs without waiting on the host, if
        the device can (CUDA: a stream waits for events). False: the caller must wait."""
        return False

    def close(self) -> None:
        return None


class TransferEngine:
    def __init__(self, copier: DeviceCopier, on_complete=None):
        self._copier = copier
        self._on_complete = on_complete  # called on the completing thread, after the result is queued
        self._results: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._job_ids = itertools.count()
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        self._done = threading.Condition(self._lock)
        self._suspended = False  # sleep mode: the device memory is released

    def submit(self, job: TransferJob, inline: bool = False) -> int:
        """Start ``job``; with ``inline``, copy it on this thread where the device can (a thread
        of kvtier's own that would otherwise hand it to a copy thread and wait)."""
        if job.job_id < 0:
            job = dataclasses.replace(job, job_id=next(self._job_ids))
        with self._lock:
            self._in_flight.add(job.job_id)
            copier = None if self._suspended else self._copier
        try:
            if copier is None:
                raise RuntimeError("the KV cache is released (sleep mode): no device copy until it is restored")
            if not (inline and copier.start_inline(job, self._complete)):
                copier.start(job, self._complete)
        except Exception as error:  # a failed submission is a failed job, reported once
            self._complete(TransferResult(job.job_id, False, 0, 0.0, f"{type(error).__name__}: {error}"))
        return job.job_id

    def _complete(self, result: TransferResult) -> None:
        # Runs on copy threads: the queue is the only state shared with poll().
        self._results.put(result)
        with self._done:
            self._in_flight.discard(result.job_id)
            self._done.notify_all()
        if self._on_complete is not None:
            self._on_complete()

    def poll(self) -> list[TransferResult]:
        for result in self._copier.poll_done():
            self._complete(result)
        finished = []
        while True:
            try:
                finished.append(self._results.get_nowait())
            except queue.Empty:
                return finished

    def wait(self, job_ids, timeout: float | None = None) -> bool:
        """Block until none of ``job_ids`` is in flight; True if they all finished."""
        job_ids = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for result in self._copier.poll_done():  # CUDA: completion is found by polling events
                self._complete(result)
            with self._done:
                if not (job_ids & self._in_flight):
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._done.wait(timeout=0.001)

    @property
    def takes_checksums(self) -> bool:
        """Whether copies of whole slots take their checksums (``DeviceCopier.takes_checksums``)."""
        return self._copier.takes_checksums

    def order_compute_after(self, job_ids) -> bool:
        """True if the device orders the next compute after ``job_ids`` (see DeviceCopier)."""
        return self._copier.order_compute_after(job_ids)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def suspend(self, timeout: float) -> None:
        """Stop touching the device's memory (the engine is about to release it: sleep mode).

        From now on every submitted job fails at once (a result, never a copy); the copies
        in flight get up to ``timeout`` to finish, then the copier and everything it bound
        to device addresses are dropped. Raises, changing nothing, if copies are still
        running at the deadline: the memory must not be released under them. Idempotent."""
        with self._lock:
            if self._suspended:
                return
            self._suspended = True  # under the lock: a submit either is in _in_flight below or fails
            pending = set(self._in_flight)
        if not self.wait(pending, timeout):  # the copier still polls its own completions
            with self._lock:
                self._suspended = False  # nothing changed: the copier goes on, its copies get reported
            raise RuntimeError(f"kvtier: device copies still running after {timeout} s; "
                               f"the KV cache cannot be released under them")
        self._copier.close()

    def resume(self, copier: DeviceCopier) -> None:
        """Copy again, with a copier bound to the device memory as it is now."""
        with self._lock:
            self._copier, self._suspended = copier, False

    @property
    def suspended(self) -> bool:
        return self._suspended

    def close(self) -> None:
        with self._lock:
            pending = set(self._in_flight)
        self.wait(pending, timeout=60)
        self._copier.close()

