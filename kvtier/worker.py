"""Worker side of kvtier: carries out the scheduler's load and store jobs.

This class runs in each worker (one per tensor-parallel rank) and owns the
tensors: the host pool's memory, the transfer engine and the disk tier's I/O.
Nothing here blocks the engine's step on storage I/O: disk reads and writes run
on I/O threads, device copies on the transfer engine.

A load: read the ``fill`` blocks from disk into their host slots (I/O threads),
then copy all blocks host -> device (transfer engine), then report.
A store: copy device -> host (transfer engine); once that is done the device
blocks are free to reuse; then write the disk keys through (I/O threads), then
report. Each job is reported exactly once by ``poll``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvtier.config import KVTierConfig
from kvtier.entry import checksum
from kvtier.keys import Namespace
from kvtier.layout import KVLayout, TensorInfo, detect_layout
from kvtier.manager import num_host_slots
from kvtier.plans import JobReport, LoadJob, StoreJob
from kvtier.tiers.disk import DiskStore
from kvtier.transfer.engine import TransferEngine, TransferJob, TransferResult
from kvtier.transfer.host_buffer import allocate_host_buffer

logger = logging.getLogger("kvtier.worker")


def tensor_info(tensor: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(), tensor.data_ptr())


@dataclass
class _Load:
    job: LoadJob
    report: JobReport
    usable_block_ids: list[int] = field(default_factory=list)
    usable_slot_ids: list[int] = field(default_factory=list)
    usable_keys: list[bytes] = field(default_factory=list)


@dataclass
class _Store:
    job: StoreJob
    report: JobReport
    device_reads_done: bool = False  # the device -> host copy finished: the blocks may be reused
    reportable: bool = False  # every step finished: report, then the scheduler releases the slots


class TierWorker:
    def __init__(self, config: KVTierConfig, tensors: Sequence[torch.Tensor], num_blocks: int, block_size: int,
                 namespace: Namespace, tp_rank: int = 0, layout_kind: str | None = None):
        self.config = config
        self.tensors = list(tensors)  # kept alive: copies use their addresses
        self.layout: KVLayout = detect_layout([tensor_info(t) for t in self.tensors], num_blocks, block_size,
                                              layout_kind)
        device_layout = f"{self.layout.kind}{list(self.layout.block_shape)}{self.tensors[0].dtype}"
        self.rank_fingerprint = namespace.for_rank(tp_rank, device_layout).fingerprint()
        self.num_slots = num_host_slots(config.host_bytes, self.layout.slot_bytes)
        if self.num_slots == 0:
            raise ValueError(f"host_bytes={config.host_bytes} is smaller than one block ({self.layout.slot_bytes} bytes)")
        self.device_is_cuda = self.tensors[0].is_cuda
        self.host_buffer = allocate_host_buffer(self.num_slots, self.layout.slot_bytes, pin=self.device_is_cuda)
        self._host_slots = self.host_buffer.numpy().reshape(self.num_slots, self.layout.slot_bytes)
        if self.device_is_cuda:
            from kvtier.transfer.cuda import CudaCopier
            copier = CudaCopier(self.layout, self.tensors, self.host_buffer)
        else:
            from kvtier.transfer.cpu import CpuCopier
            copier = CpuCopier(self.layout, self.tensors, self.host_buffer, config.copy_threads)
        self.transfers = TransferEngine(copier)
        self.disk = DiskStore(config.disk_dir, self.rank_fingerprint, self.layout.slot_bytes) if config.disk_dir else None
        self._io = ThreadPoolExecutor(config.disk_io_threads, thread_name_prefix="kvtier-io")
        self._io_done: queue.SimpleQueue = queue.SimpleQueue()  # finished disk writes, from I/O threads
        self._loads: dict[int, _Load] = {}
        self._stores: dict[int, _Store] = {}
        self._job_of_transfer: dict[int, tuple[bool, int]] = {}  # transfer id -> (is_load, job id)
        self._lock = threading.Lock()  # guards _job_of_transfer: loads submit their copy from I/O threads
        self._transfer_ids = itertools.count()
        self._slot_checksums: dict[int, int] = {}  # verify_loads: checksum of the bytes each slot received
        self.num_verify_failures = 0

    # --- submission ---------------------------------------------------------
    def submit_load(self, job: LoadJob) -> None:
        report = JobReport(job.job_id, is_load=True, success=True, failed_block_ids=list(job.missing_block_ids))
        load = _Load(job, report, list(job.ready_block_ids), list(job.ready_slot_ids), list(job.ready_keys))
        self._loads[job.job_id] = load
        if not job.fill_keys:
            self._submit_load_copy(load)
            return
        if self.disk is None:
            report.failed_block_ids += job.fill_block_ids
            report.bad_keys += job.fill_keys
            self._submit_load_copy(load)
            return
        remaining = [len(job.fill_keys)]
        fill_lock = threading.Lock()

        def fill(block_id: int, slot_id: int, key: bytes) -> None:
            why = self.disk.read_into(key, memoryview(self._host_slots[slot_id]))
            if why is None and self.config.verify_loads:
                self._slot_checksums[slot_id] = checksum(self._host_slots[slot_id])
            with fill_lock:
                if why is None:
                    load.usable_block_ids.append(block_id)
                    load.usable_slot_ids.append(slot_id)
                    load.usable_keys.append(key)
                else:
                    logger.warning("kvtier: disk entry %s is a miss (%s); its block will be recomputed", key.hex(), why)
                    report.failed_block_ids.append(block_id)
                    report.bad_keys.append(key)
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:  # every fill has landed in its slot: the slots may now be read
                self._submit_load_copy(load)

        for block_id, slot_id, key in zip(job.fill_block_ids, job.fill_slot_ids, job.fill_keys):
            self._io.submit(fill, block_id, slot_id, key)

    def _submit_load_copy(self, load: _Load) -> None:
        with self._lock:  # register before submit, so a fast completion always finds its job
            transfer = TransferJob(np.asarray(load.usable_block_ids, np.int64),
                                   np.asarray(load.usable_slot_ids, np.int64), False, next(self._transfer_ids))
            self._job_of_transfer[transfer.job_id] = (True, load.job.job_id)
        self.transfers.submit(transfer)

    def submit_store(self, job: StoreJob) -> None:
        self._stores[job.job_id] = _Store(job, JobReport(job.job_id, is_load=False, success=True))
        with self._lock:
            transfer = TransferJob(np.asarray(job.block_ids, np.int64), np.asarray(job.slot_ids, np.int64), True,
                                   next(self._transfer_ids))
            self._job_of_transfer[transfer.job_id] = (False, job.job_id)
        self.transfers.submit(transfer)

    # --- completion ---------------------------------------------------------
    def poll(self) -> list[JobReport]:
        """Jobs finished since the last call, each exactly once."""
        finished: list[JobReport] = []
        for result in self.transfers.poll():
            with self._lock:
                is_load, job_id = self._job_of_transfer.pop(result.job_id)
            if is_load:
                finished.append(self._finish_load(self._loads.pop(job_id), result))
            else:
                self._after_store_copy(self._stores[job_id], result)
        while True:
            try:
                self._stores[self._io_done.get_nowait()].reportable = True
            except queue.Empty:
                break
        for job_id in [job_id for job_id, store in self._stores.items() if store.reportable]:
            finished.append(self._stores.pop(job_id).report)
        return finished

    def _finish_load(self, load: _Load, result: TransferResult) -> JobReport:
        report = load.report
        report.num_bytes, report.seconds = result.num_bytes, result.seconds
        if not result.success:
            logger.warning("kvtier: load job %d failed (%s); its blocks will be recomputed", load.job.job_id, result.error)
            report.failed_block_ids += load.usable_block_ids
        elif self.config.verify_loads:
            self._verify(load)
        report.success = not report.failed_block_ids
        return report

    def _after_store_copy(self, store: _Store, result: TransferResult) -> None:
        store.device_reads_done = True  # from here on the device blocks may be reused
        report = store.report
        report.num_bytes, report.seconds = result.num_bytes, result.seconds
        if not result.success:
            logger.warning("kvtier: store job %d failed (%s)", store.job.job_id, result.error)
            report.success = False
            report.failed_disk_keys = list(store.job.disk_keys)
            store.reportable = True
            return
        if self.config.verify_loads:
            for slot in store.job.slot_ids:
                self._slot_checksums[slot] = checksum(self._host_slots[slot])
        if store.job.disk_keys:
            self._write_through(store)
        else:
            store.reportable = True

    def _write_through(self, store: _Store) -> None:
        job = store.job
        remaining = [len(job.disk_keys)]
        lock = threading.Lock()

        def write(key: bytes, slot_id: int) -> None:
            try:
                self.disk.write(key, memoryview(self._host_slots[slot_id]))
            except OSError as error:
                logger.warning("kvtier: disk write of %s failed: %s", key.hex(), error)
                with lock:
                    store.report.failed_disk_keys.append(key)
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:  # the host slots are no longer read: the job may be reported and its pins released
                self._io_done.put(job.job_id)

        if self.disk is None:
            store.report.failed_disk_keys = list(job.disk_keys)
            self._io_done.put(job.job_id)
            return
        for key, slot_id in zip(job.disk_keys, job.disk_slot_ids):
            self._io.submit(write, key, slot_id)

    def _verify(self, load: _Load) -> None:
        """Test mode: read the loaded device blocks back and compare them with the
        bytes their host slot received (from the device or from a disk entry)."""
        if self.device_is_cuda:
            return
        from kvtier._native import copy_runs
        scratch = np.empty((1, self.layout.slot_bytes), np.uint8)
        addresses = [t.data_ptr() for t in self.tensors]
        for block_id, slot_id, key in zip(load.usable_block_ids, load.usable_slot_ids, load.usable_keys):
            expected = self._slot_checksums.get(slot_id)
            if expected is None:
                continue
            dst, src, lengths = self.layout.copy_runs(addresses, scratch.ctypes.data, np.array([block_id]),
                                                      np.array([0]), to_host=True)
            copy_runs.copy(dst, src, lengths)
            if checksum(scratch[0]) != expected:
                self.num_verify_failures += 1
                logger.error("kvtier: loaded block %d (key %s) differs from what was stored", block_id, key.hex())
                load.report.failed_block_ids.append(block_id)

    # --- ordering helpers ---------------------------------------------------
    def device_reads_done(self, store_job_id: int) -> bool:
        store = self._stores.get(store_job_id)
        return store is None or store.device_reads_done

    def wait_for_device_reads(self, store_job_ids: Sequence[int], timeout: float = 60.0) -> bool:
        """Block until the stores' device -> host copies are done (before their blocks are reused)."""
        with self._lock:
            wanted = {t for t, (is_load, j) in self._job_of_transfer.items() if not is_load and j in set(store_job_ids)}
        return self.transfers.wait(wanted, timeout)

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._loads) + len(self._stores)

    def close(self) -> None:
        self.transfers.close()
        self._io.shutdown(wait=True)
