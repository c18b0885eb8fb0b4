"""Worker side of kvtier: carries out the scheduler's load and store jobs.

This class runs in each worker (one per tensor-parallel rank) and owns the
tensors: the host pool's memory, the transfer engine and the storage I/O. Nothing
here blocks the engine's step on storage: disk and pool I/O run on I/O threads,
device copies on the transfer engine.

A load: read the ``fill`` blocks into their host slots (disk entries on the disk
threads, pool entries in one batch on a pool thread), then copy all blocks
host -> device, then report. A fill not done within ``load_timeout_s`` abandons
the load: it is reported failed at once (the engine recomputes), and its slots
are reported released only when the late reads have returned.
A store: copy device -> host; from then on the device blocks may be reused; then
write through to disk and the pool; then report. Each job is reported once.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvtier.config import KVTierConfig
from kvtier.entry import HEADER_BYTES, check_entry, checksum, encode_header
from kvtier.keys import Namespace
from kvtier.layout import KVLayout, TensorInfo, detect_layout
from kvtier.manager import num_host_slots
from kvtier.plans import JobReport, LoadJob, StoreJob
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.remote import RemoteTier, remote_key
from kvtier.transfer.engine import TransferEngine, TransferJob, TransferResult
from kvtier.transfer.host_buffer import allocate_host_buffer

logger = logging.getLogger("kvtier.worker")


def _merged(first: TransferResult | None, second: TransferResult) -> TransferResult:
    """One result for a job made of several transfers (its layers)."""
    if first is None:
        return second
    return TransferResult(second.job_id, first.success and second.success, first.num_bytes + second.num_bytes,
                          max(first.seconds, second.seconds), first.error or second.error)


def tensor_info(tensor: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(), tensor.data_ptr())


@dataclass
class _Load:
    job: LoadJob
    report: JobReport
    deadline: float
    fills_left: int
    usable_block_ids: list[int] = field(default_factory=list)
    usable_slot_ids: list[int] = field(default_factory=list)
    usable_keys: list[bytes] = field(default_factory=list)
    abandoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    fills_settled: threading.Event = field(default_factory=threading.Event)  # every fill landed, failed or abandoned
    transfers_left: int = 1  # layer-wise: one transfer per layer
    layer_transfer_ids: dict[int, int] = field(default_factory=dict)
    copy_result: TransferResult | None = None


@dataclass
class _Store:
    job: StoreJob
    report: JobReport
    device_reads_done: bool = False  # the device -> host copy finished: the blocks may be reused
    writes_left: int = 0
    reportable: bool = False  # every step finished: report, then the scheduler releases the slots
    transfers_left: int = 1  # layer-wise: one transfer per layer
    copy_result: TransferResult | None = None
    layer_transfers: list[TransferJob | None] | None = None  # layer-wise: each layer's, until it is sent


class TierWorker:
    def __init__(self, config: KVTierConfig, tensors: Sequence[torch.Tensor], num_blocks: int, block_size: int,
                 namespace: Namespace, tp_rank: int = 0, layout_kind: str | None = None, broadcast_group=None):
        self.config = config
        self.tensors = list(tensors)  # kept alive: copies use their addresses
        self.layout: KVLayout = detect_layout([tensor_info(t) for t in self.tensors], num_blocks, block_size,
                                              layout_kind)
        device_layout = f"{self.layout.kind}{list(self.layout.block_shape)}{self.tensors[0].dtype}"
        # Replicated KV (save_only_first_rank): every rank's blocks are rank 0's, stored once, by rank 0.
        replicated = config.save_only_first_rank and broadcast_group is not None
        self.is_source = not replicated or tp_rank == 0
        self.rank_fingerprint = namespace.for_rank(0 if replicated else tp_rank, device_layout).fingerprint()
        self._broadcaster = None
        if replicated:
            from kvtier.transfer.broadcast import ShardedBroadcaster
            self._broadcaster = ShardedBroadcaster(self.layout, self.tensors, broadcast_group,
                                                   config.broadcast_shard_blocks)
            # One thread: every rank enters the collectives of its load jobs in the same (job) order.
            self._broadcast_thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-broadcast")
            self._broadcast_done: queue.SimpleQueue[JobReport] = queue.SimpleQueue()
        self.num_slots = num_host_slots(config.host_bytes, self.layout.slot_bytes)
        if self.num_slots == 0:
            raise ValueError(f"host_bytes={config.host_bytes} is smaller than one block ({self.layout.slot_bytes} bytes)")
        self.device_is_cuda = self.tensors[0].is_cuda
        self.host_buffer = allocate_host_buffer(self.num_slots, self.layout.slot_bytes, pin=self.device_is_cuda)
        self._host_slots = self.host_buffer.numpy().reshape(self.num_slots, self.layout.slot_bytes)
        self._headers = np.zeros((self.num_slots, HEADER_BYTES), np.uint8)  # a pool entry's header, per slot
        self.transfers = TransferEngine(self._make_copier())
        self.disk = DiskStore(config.disk_dir, self.rank_fingerprint, self.layout.slot_bytes) if config.disk_dir else None
        self.remote = None
        if config.remote_url:
            self.remote = RemoteTier(config.remote_url, config.remote_timeout_s, config.remote_retry_s)
            # Zero-copy where the pool allows: it reads from and writes into these directly.
            self.remote.register(self.host_buffer.data_ptr(), self.host_buffer.numel())
            self.remote.register(self._headers.ctypes.data, self._headers.nbytes)
        self._io = ThreadPoolExecutor(config.disk_io_threads, thread_name_prefix="kvtier-io")
        self._remote_io = ThreadPoolExecutor(2, thread_name_prefix="kvtier-pool")
        self._writes_done: queue.SimpleQueue[int] = queue.SimpleQueue()  # store job ids, from I/O threads
        self._released: queue.SimpleQueue[int] = queue.SimpleQueue()  # held slots, from I/O threads
        self._loads: dict[int, _Load] = {}
        self._stores: dict[int, _Store] = {}
        self._job_of_transfer: dict[int, tuple[bool, int]] = {}  # transfer id -> (is_load, job id)
        self._lock = threading.Lock()  # guards _job_of_transfer: loads submit their copy from I/O threads
        self._transfer_ids = itertools.count()
        self._slot_checksums: dict[int, int] = {}  # verify_loads: checksum of the bytes each slot received
        self._finished_early: list[JobReport] = []  # loads finished during wait_for_stores, for the next poll
        self.num_verify_failures = 0

    def _make_copier(self, first: bool = True):
        """The device half, bound to the KV cache's addresses as they are now. Only the
        first one warms up through host slot 0: later, the slot may hold a stored block."""
        if self.device_is_cuda:
            from kvtier.transfer.cuda import CudaCopier
            return CudaCopier(self.layout, self.tensors, self.host_buffer, warm_up=first)
        from kvtier.transfer.cpu import CpuCopier
        return CpuCopier(self.layout, self.tensors, self.host_buffer, self.config.copy_threads)

    # --- sleep mode: the engine releases the KV cache and maps it again --------
    def suspend_device(self, timeout: float) -> None:
        """Before the KV cache is released: no copy runs or starts until ``resume_device``.
        The tiers keep every block (host slots, disk, pool); jobs submitted meanwhile fail
        and their blocks are recomputed. Idempotent."""
        self.transfers.suspend(timeout)

    def resume_device(self) -> None:
        """After the KV cache is mapped again, perhaps elsewhere: every address-bound part
        (the copier's tables, the broadcaster's addresses) is rebuilt from the tensors."""
        if not self.transfers.suspended:
            return
        layout = detect_layout([tensor_info(t) for t in self.tensors], self.layout.num_blocks,
                               self.layout.block_size, self.layout.kind)
        if (layout.slot_bytes, layout.block_shape) != (self.layout.slot_bytes, self.layout.block_shape):
            raise RuntimeError(f"kvtier: the KV cache came back as {layout.kind} {list(layout.block_shape)}, "
                               f"not {self.layout.kind} {list(self.layout.block_shape)}")
        self.layout = layout
        if self._broadcaster is not None:
            self._broadcaster.addresses = [t.data_ptr() for t in self.tensors]
        self.transfers.resume(self._make_copier(first=False))

    @property
    def num_layers(self) -> int:
        """Layers that can move separately: one per KV tensor (a cross-layer cache has one)."""
        return len(self.tensors)

    # --- loads --------------------------------------------------------------
    def submit_load_layers(self, job: LoadJob) -> None:
        """Layer-wise load of host-resident blocks: every layer's copy is submitted now,
        in layer order, so that layer i can be waited for alone (``wait_for_layer``)."""
        if job.fill_keys:
            raise ValueError(f"load job {job.job_id}: a layer-wise load reads only host slots")
        report = JobReport(job.job_id, is_load=True, success=True, failed_block_ids=list(job.missing_block_ids))
        load = _Load(job, report, time.monotonic() + self.config.load_timeout_s, 0, list(job.ready_block_ids),
                     list(job.ready_slot_ids), list(job.ready_keys), transfers_left=self.num_layers)
        self._loads[job.job_id] = load
        block_ids, slot_ids = np.asarray(load.usable_block_ids, np.int64), np.asarray(load.usable_slot_ids, np.int64)
        for layer in range(self.num_layers):
            load.layer_transfer_ids[layer] = self._submit_transfer(block_ids, slot_ids, False, (True, job.job_id),
                                                                   (layer,))

    def wait_for_layer(self, load_job_ids: Sequence[int], layer: int, timeout: float = 60.0) -> bool:
        """Block until ``layer`` of these layer-wise loads is in the device cache."""
        wanted = {self._loads[j].layer_transfer_ids[layer] for j in load_job_ids
                  if j in self._loads and layer in self._loads[j].layer_transfer_ids}
        if self.transfers.order_compute_after(wanted):
            return True  # CUDA: the compute stream waits for the layer's copy; the host goes on
        return self.transfers.wait(wanted, timeout)

    def submit_load(self, job: LoadJob) -> None:
        if self._broadcaster is not None and not self.is_source:
            # Not rank 0: the blocks come from rank 0's broadcast, never from the tiers.
            self._broadcast_thread.submit(self._receive_broadcast, job)
            return
        report = JobReport(job.job_id, is_load=True, success=True, failed_block_ids=list(job.missing_block_ids))
        load = _Load(job, report, time.monotonic() + self.config.load_timeout_s, len(job.fill_keys),
                     list(job.ready_block_ids), list(job.ready_slot_ids), list(job.ready_keys))
        self._loads[job.job_id] = load
        if self._broadcaster is not None:
            self._broadcast_thread.submit(self._send_broadcast, load)  # queued now: job order on every rank
        if not job.fill_keys:
            load.fills_settled.set()
            self._submit_load_copy(load)
            return
        fills = list(zip(job.fill_block_ids, job.fill_slot_ids, job.fill_keys, job.fill_from))
        for block_id, slot_id, key, source in fills:
            if source == "disk":
                self._io.submit(self._fill_from_disk, load, block_id, slot_id, key)
        from_remote = [f[:3] for f in fills if f[3] == "remote"]
        if from_remote:
            self._remote_io.submit(self._fill_from_remote, load, from_remote)

    # Every task on an I/O thread ends in an outcome, whatever it raises: an executor
    # swallows exceptions, and a task that never reports would hold its pins for good.
    def _fill_from_disk(self, load: _Load, block_id: int, slot_id: int, key: bytes) -> None:
        try:
            why = self.disk.read_into(key, memoryview(self._host_slots[slot_id])) if self.disk else "no disk tier"
        except Exception as error:
            why = f"read failed: {error!r}"
        self._filled(load, [(block_id, slot_id, key, why)])

    def _fill_from_remote(self, load: _Load, fills: list[tuple[int, int, bytes]]) -> None:
        try:
            outcomes = self._read_remote(fills)
        except Exception as error:
            outcomes = [(block_id, slot_id, key, f"read failed: {error!r}") for block_id, slot_id, key in fills]
        self._filled(load, outcomes)

    def _read_remote(self, fills: list[tuple[int, int, bytes]]) -> list[tuple[int, int, bytes, str | None]]:
        names = [remote_key(self.rank_fingerprint, key) for _, _, key in fills]
        headers = [memoryview(self._headers[slot]) for _, slot, _ in fills]
        payloads = [memoryview(self._host_slots[slot]) for _, slot, _ in fills]
        found = self.remote.call("get_into", names, headers, payloads) if self.remote else None
        outcomes = []
        for i, (block_id, slot_id, key) in enumerate(fills):
            if found is None:
                why = "pool unavailable"
            elif not found[i]:
                why = "missing or wrong size in the pool"
            else:
                why = check_entry(bytes(self._headers[slot_id]), self._host_slots[slot_id], self.rank_fingerprint,
                                  key, self.layout.slot_bytes)
            outcomes.append((block_id, slot_id, key, why))
        return outcomes

    def _filled(self, load: _Load, outcomes: list[tuple[int, int, bytes, str | None]]) -> None:
        """Runs on I/O threads when fills have landed (or failed) in their slots."""
        for block_id, slot_id, key, why in outcomes:
            if why is None and self.config.verify_loads:
                self._slot_checksums[slot_id] = checksum(self._host_slots[slot_id])
        with load.lock:
            for block_id, slot_id, key, why in outcomes:
                if why is None:
                    load.usable_block_ids.append(block_id)
                    load.usable_slot_ids.append(slot_id)
                    load.usable_keys.append(key)
                else:
                    logger.warning("kvtier: entry %s is a miss (%s); its block will be recomputed", key.hex(), why)
                    load.report.failed_block_ids.append(block_id)
                    load.report.bad_keys.append(key)
            load.fills_left -= len(outcomes)
            last, abandoned = load.fills_left == 0, load.abandoned
            if last:
                load.fills_settled.set()
        if last and abandoned:  # the late reads are over: the held slots may now be reused
            for slot_id in load.job.fill_slot_ids:
                self._released.put(slot_id)
        elif last:  # every fill has landed in its slot: the slots may now be read
            self._submit_load_copy(load)

    def _submit_load_copy(self, load: _Load) -> None:
        self._submit_transfer(load.usable_block_ids, load.usable_slot_ids, False, (True, load.job.job_id))

    def _submit_transfer(self, block_ids, slot_ids, to_host: bool, owner: tuple[bool, int],
                         tensor_indices: tuple[int, ...] | None = None) -> int:
        transfer = self._registered_transfer(block_ids, slot_ids, to_host, owner, tensor_indices)
        self.transfers.submit(transfer)
        return transfer.job_id

    def _registered_transfer(self, block_ids, slot_ids, to_host: bool, owner: tuple[bool, int],
                             tensor_indices: tuple[int, ...] | None) -> TransferJob:
        with self._lock:  # registered before it is submitted, so a fast completion always finds its job
            transfer = TransferJob(np.asarray(block_ids, np.int64), np.asarray(slot_ids, np.int64), to_host,
                                   next(self._transfer_ids), tensor_indices)
            self._job_of_transfer[transfer.job_id] = owner
        return transfer

    def _abandon_overdue_loads(self, now: float) -> list[JobReport]:
        abandoned = []
        for job_id, load in list(self._loads.items()):
            with load.lock:
                if load.fills_left == 0 or now < load.deadline:
                    continue
                load.abandoned = True
                load.fills_settled.set()  # a broadcast waiting on these fills sends without them
            logger.warning("kvtier: load job %d not filled in %.1f s; its blocks will be recomputed", job_id,
                           self.config.load_timeout_s)
            del self._loads[job_id]
            job = load.job
            report = load.report
            report.failed_block_ids = job.ready_block_ids + job.fill_block_ids + job.missing_block_ids
            report.held_slot_ids = list(job.fill_slot_ids)
            report.success = False
            abandoned.append(report)
        return abandoned

    def _send_broadcast(self, load: _Load) -> None:
        """Rank 0, on the broadcast thread: once its fills have landed, send every block it has."""
        load.fills_settled.wait()
        job = load.job
        order = job.ready_block_ids + job.fill_block_ids  # the same list on every rank
        slots = job.ready_slot_ids + job.fill_slot_ids
        with load.lock:
            usable = set(load.usable_block_ids) if not load.abandoned else set(job.ready_block_ids)
        available = np.array([block in usable for block in order], dtype=bool)
        try:
            result = self._broadcaster.load(order, self._host_slots, slots, available)
        except Exception as error:  # the other ranks report their blocks as failed
            logger.error("kvtier: broadcast of load job %d failed: %r", job.job_id, error)
            return
        if not result.ok:
            logger.warning("kvtier: broadcast of load job %d fell back to recompute on every rank", job.job_id)

    def _receive_broadcast(self, job: LoadJob) -> None:
        """Other ranks, on the broadcast thread: take rank 0's blocks into the KV cache."""
        order = job.ready_block_ids + job.fill_block_ids
        try:
            result = self._broadcaster.load(order)
            missing, seconds = [block for block, got in zip(order, result.received) if not got], result.seconds
        except Exception as error:  # reported as failed blocks, so the request is recomputed, never stuck
            logger.error("kvtier: broadcast of load job %d failed: %r", job.job_id, error)
            missing, seconds = list(order), 0.0
        self._broadcast_done.put(JobReport(job.job_id, is_load=True, success=not missing and not job.missing_block_ids,
                                           failed_block_ids=missing + list(job.missing_block_ids),
                                           seconds=seconds))

    # --- stores -------------------------------------------------------------
    def submit_store(self, job: StoreJob) -> None:
        if not self.is_source:  # replicated KV: rank 0 stores it once for every rank
            self._stores.setdefault(job.job_id, _Store(job, JobReport(job.job_id, is_load=False, success=True),
                                                       device_reads_done=True, reportable=True))
            return
        prepared = self._stores.get(job.job_id)
        if prepared is not None and prepared.layer_transfers is not None:  # layer-wise: the layers not sent yet
            for layer in range(self.num_layers):
                self.submit_store_layer(job, layer)
            return
        self._stores[job.job_id] = _Store(job, JobReport(job.job_id, is_load=False, success=True))
        self._submit_transfer(job.block_ids, job.slot_ids, True, (False, job.job_id))

    def submit_store_layer(self, job: StoreJob, layer: int) -> None:
        """Layer-wise store: copy one layer of the job's blocks, once that layer's KV is
        written (the caller calls this right after the layer's attention). ``submit_store``
        of the same job then sends the layers not sent yet."""
        if not self.is_source:
            if job.job_id not in self._stores:
                self.submit_store(job)  # replicated KV: nothing to copy here
            return
        store = self._stores.get(job.job_id) or self.prepare_store_layers(job)
        transfer, store.layer_transfers[layer] = store.layer_transfers[layer], None
        if transfer is not None:  # each layer is sent once, however often it is asked for
            self.transfers.submit(transfer)

    def prepare_store_layers(self, job: StoreJob) -> _Store | None:
        """Make every layer's transfer of a layer-wise store before the forward, so that
        ``submit_store_layer``, on the compute thread after each layer, only enqueues."""
        store = self._stores.get(job.job_id)
        if store is None and self.is_source:  # other ranks of replicated KV copy nothing
            block_ids, slot_ids = np.asarray(job.block_ids, np.int64), np.asarray(job.slot_ids, np.int64)
            store = _Store(job, JobReport(job.job_id, is_load=False, success=True), transfers_left=self.num_layers,
                           layer_transfers=[self._registered_transfer(block_ids, slot_ids, True, (False, job.job_id),
                                                                      (layer,)) for layer in range(self.num_layers)])
            self._stores[job.job_id] = store
        return store

    def _after_store_copy(self, store: _Store, result: TransferResult) -> None:
        store.device_reads_done = True  # from here on the device blocks may be reused
        report, job = store.report, store.job
        report.num_bytes, report.seconds = result.num_bytes, result.seconds
        if not result.success:
            logger.warning("kvtier: store job %d failed (%s)", job.job_id, result.error)
            report.success = False
            report.failed_disk_keys, report.failed_remote_keys = list(job.disk_keys), list(job.remote_keys)
            store.reportable = True
            return
        if self.config.verify_loads:
            for slot in job.slot_ids:
                self._slot_checksums[slot] = checksum(self._host_slots[slot])
        store.writes_left = len(job.disk_keys) + (1 if job.remote_keys else 0)
        if store.writes_left == 0:
            store.reportable = True
        for key, slot_id in zip(job.disk_keys, job.disk_slot_ids):
            self._io.submit(self._write_to_disk, store, key, slot_id)
        if job.remote_keys:
            self._remote_io.submit(self._write_to_remote, store)

    def _write_to_disk(self, store: _Store, key: bytes, slot_id: int) -> None:
        try:
            if self.disk is None:
                raise OSError("no disk tier")
            self.disk.write(key, memoryview(self._host_slots[slot_id]))
        except Exception as error:
            logger.warning("kvtier: disk write of %s failed: %s", key.hex(), error)
            store.report.failed_disk_keys.append(key)  # list.append is atomic; read after all writes are done
        self._writes_done.put(store.job.job_id)

    def _write_to_remote(self, store: _Store) -> None:
        job = store.job
        try:
            for key, slot in zip(job.remote_keys, job.remote_slot_ids):
                self._headers[slot] = np.frombuffer(
                    encode_header(self.rank_fingerprint, key, self._host_slots[slot]), np.uint8)
            stored = self.remote.call("put", [remote_key(self.rank_fingerprint, k) for k in job.remote_keys],
                                      [memoryview(self._headers[s]) for s in job.remote_slot_ids],
                                      [memoryview(self._host_slots[s]) for s in job.remote_slot_ids])
        except Exception as error:
            logger.warning("kvtier: pool write of store job %d failed: %r", job.job_id, error)
            stored = None
        if stored is None:
            store.report.failed_remote_keys = list(job.remote_keys)
        else:
            store.report.failed_remote_keys = [k for k, ok in zip(job.remote_keys, stored) if not ok]
        self._writes_done.put(job.job_id)

    # --- completion ---------------------------------------------------------
    def _advance(self) -> list[JobReport]:
        """Move jobs on from finished copies and writes; returns finished loads."""
        finished = []
        for result in self.transfers.poll():
            with self._lock:
                is_load, job_id = self._job_of_transfer.pop(result.job_id)
            job = self._loads[job_id] if is_load else self._stores[job_id]
            job.copy_result = _merged(job.copy_result, result)
            job.transfers_left -= 1
            if job.transfers_left:
                continue  # layer-wise: more layers to come
            if is_load:
                finished.append(self._finish_load(self._loads.pop(job_id), job.copy_result))
            else:
                self._after_store_copy(job, job.copy_result)
        while True:
            try:
                store = self._stores[self._writes_done.get_nowait()]
            except queue.Empty:
                break
            store.writes_left -= 1
            store.reportable = store.writes_left == 0
        return finished

    def poll(self) -> list[JobReport]:
        """Jobs finished since the last call, each exactly once."""
        finished, self._finished_early = self._finished_early, []
        finished += self._advance() + self._abandon_overdue_loads(time.monotonic())
        if self._broadcaster is not None:
            while not self._broadcast_done.empty():
                finished.append(self._broadcast_done.get_nowait())
        for job_id in [job_id for job_id, store in self._stores.items() if store.reportable]:
            finished.append(self._stores.pop(job_id).report)
        return finished

    def released_slots(self) -> list[int]:
        """Held slots whose late reads have returned since the last call."""
        released = []
        while True:
            try:
                released.append(self._released.get_nowait())
            except queue.Empty:
                return released

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

    def _verify(self, load: _Load) -> None:
        """Test mode: read the loaded device blocks back and compare them with the
        bytes their host slot received (from the device, a disk entry or the pool)."""
        scratch = np.empty((1, self.layout.slot_bytes), np.uint8)
        for block_id, slot_id, key in zip(load.usable_block_ids, load.usable_slot_ids, load.usable_keys):
            expected = self._slot_checksums.get(slot_id)
            if expected is None:
                continue
            self._read_back(block_id, scratch)
            if checksum(scratch[0]) != expected:
                self.num_verify_failures += 1
                logger.error("kvtier: loaded block %d (key %s) differs from what was stored", block_id, key.hex())
                load.report.failed_block_ids.append(block_id)

    def _read_back(self, block_id: int, scratch: np.ndarray) -> None:
        """Copy one device block into ``scratch`` in slot layout (test mode, synchronous)."""
        if self.device_is_cuda:
            from kvtier.transfer.cuda import segment_views
            views = segment_views(self.layout, self.tensors)  # the load's event was seen: its copies are done
            scratch[0] = torch.cat([view[block_id] for view in views]).cpu().numpy()
            return
        from kvtier._native import copy_runs
        addresses = [t.data_ptr() for t in self.tensors]
        dst, src, lengths = self.layout.copy_runs(addresses, scratch.ctypes.data, np.array([block_id]),
                                                  np.array([0]), to_host=True)
        copy_runs.copy(dst, src, lengths)

    # --- ordering helpers ---------------------------------------------------
    def device_reads_done(self, store_job_id: int) -> bool:
        store = self._stores.get(store_job_id)
        return store is None or store.device_reads_done

    def wait_for_device_reads(self, store_job_ids: Sequence[int], timeout: float = 60.0) -> bool:
        """Block until the stores' device -> host copies are done (before their blocks are reused)."""
        wanted_jobs = set(store_job_ids)
        with self._lock:
            wanted = {t for t, (is_load, j) in self._job_of_transfer.items() if not is_load and j in wanted_jobs}
        if self.transfers.order_compute_after(wanted):
            # CUDA: what the engine queues next (the writes that reuse these blocks, and loads,
            # whose streams wait for the compute stream) runs after the copies; no host wait.
            return True
        return self.transfers.wait(wanted, timeout)

    def wait_for_stores(self, store_job_ids: Sequence[int], timeout: float) -> bool:
        """Block until the stores are complete everywhere (the pool included), or ``timeout``.

        Loads that finish meanwhile are kept for the next ``poll``.
        """
        deadline = time.monotonic() + timeout
        wanted = set(store_job_ids)
        while True:
            self._finished_early += self._advance()
            if all(j not in self._stores or self._stores[j].reportable for j in wanted):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._loads) + len(self._stores)

    def close(self) -> None:
        if self._broadcaster is not None:
            self._broadcast_thread.shutdown(wait=False, cancel_futures=True)
        self.transfers.close()
        self._io.shutdown(wait=True)
        self._remote_io.shutdown(wait=True)
        if self.remote is not None:
            self.remote.close()
