"""kvtier's storage path as a benchmark drives it: a host pool in shared memory and an I/O
process running one tier's store, fed with jobs as a worker feeds them."""

from __future__ import annotations

import functools
import threading
import time

import numpy as np

from kvtier._native import copy_runs
from kvtier.common.entry import HEADER_BYTES
from kvtier.common.host_slots import HostSlots
from kvtier.io.client import IOProcess
from kvtier.tiers.base import TierSpec
from kvtier.transfer.host_buffer import SharedHostMemory


class IOPath:
    def __init__(self, spec: TierSpec, num_slots: int, slot_bytes: int, fingerprint: bytes = b"\x07" * 16,
                 head_bytes: int = HEADER_BYTES):
        """Slots with heads of ``head_bytes``, as a CPU worker's (0: as a CUDA worker's)."""
        layout = HostSlots(num_slots, slot_bytes, head_bytes)
        self.memory = SharedHostMemory(layout.num_bytes, pin=False)
        self.slots, _ = layout.views(self.memory.tensor.numpy())
        self.fingerprint = fingerprint
        self.io = IOProcess(self.memory.fd, [spec], fingerprint, layout)
        self.tier = spec.name
        self._layout = layout

    def fill(self, rows: np.ndarray) -> list[int]:
        """Copy ``rows`` into slots 0.. as a CPU worker's store copies blocks (the native copy, which
        takes each slot's checksum as it writes it); those checksums, which its writes carry."""
        rows = np.ascontiguousarray(rows, np.uint8)
        ids, sums = np.arange(len(rows), dtype=np.int64), np.empty(len(rows), np.uint64)
        segment = np.array([[rows.ctypes.data, rows.strides[0], 0, rows.shape[1]]], np.int64)
        copy_runs.copy_blocks(segment, ids, ids, self.memory.tensor.data_ptr() + self._layout.head_bytes,
                              self._layout.slot_bytes, len(rows), self._layout.num_slots, True, self._layout.pitch,
                              sums)
        return sums.tolist()

    def run(self, write: bool, keys: list[bytes], batch: int, in_flight: int = 2,
            checksums: list[int] | None = None, check_in_copy: bool = False) -> float:
        """Seconds to write (or read) ``keys[i]`` from (into) slot i, ``batch`` blocks per job,
        at most ``in_flight`` jobs at once (a worker with several requests' jobs under way); a
        write carries ``checksums[i]`` for slot i where given (``fill``). A read with
        ``check_in_copy`` leaves the entries' checksums to the caller, as a CPU worker's load
        leaves them to its copy: ``answered_sums[i]`` is slot i's entry's."""
        free = threading.Semaphore(in_flight)
        done = threading.Semaphore(0)
        failures: list[str] = []
        self.answered_sums: list[int | None] = [None] * len(keys)

        def answered(part, reasons, sums=None, deleted=None):  # deleted: a bounded store's, not counted here
            failures.extend(r for r in reasons if r is not None)
            if sums is not None:
                self.answered_sums[part.start:part.stop] = sums
            free.release()
            done.release()

        starts = range(0, len(keys), batch)
        began = time.perf_counter()
        for start in starts:
            free.acquire()
            part = range(start, min(start + batch, len(keys)))
            self.io.submit(self.tier, write, [keys[i] for i in part], list(part), list(part), time.monotonic() + 60,
                           functools.partial(answered, part),
                           None if checksums is None else checksums[part.start:part.stop], check_in_copy)
        for _ in starts:
            done.acquire()
        elapsed = time.perf_counter() - began
        if failures:
            raise RuntimeError(f"{len(failures)} blocks failed: {failures[0]}")
        return elapsed

    def job(self, write: bool, keys: list[bytes], slot_ids: list[int], checksums: list[int] | None = None,
            check_in_copy: bool = False) -> float:
        """Seconds for one job: ``keys[i]`` written from (read into) slot ``slot_ids[i]``, whose
        checksum a write carries where given; a read with ``check_in_copy`` leaves its entries'
        checksums in ``answered_sums`` (as ``run``)."""
        answered = threading.Event()
        reasons: list = []
        self.answered_sums = [None] * len(keys)

        def callback(answer, sums=None, deleted=None):
            reasons.extend(answer)
            if sums is not None:
                self.answered_sums = list(sums)
            answered.set()

        began = time.perf_counter()
        self.io.submit(self.tier, write, keys, slot_ids, slot_ids, time.monotonic() + 60, callback, checksums,
                       check_in_copy)
        answered.wait()
        elapsed = time.perf_counter() - began
        failed = [r for r in reasons if r is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} blocks failed: {failed[0]}")
        return elapsed

    def close(self) -> None:
        self.io.close(10.0)
        self.memory.close()

