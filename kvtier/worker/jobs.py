"""The worker's book of jobs in flight, shared by its load and store paths.

Jobs are submitted on the engine's thread and advanced on kvtier's own threads
(the I/O receiver, the progress thread), so every table here is read and written
under one lock. A finished job's report waits in ``finished`` until the engine
takes it (``take_finished``); nothing waits for the engine to advance a job.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from kvtier.common.plans import JobReport, LoadJob, StoreJob
from kvtier.transfer.engine import TransferEngine, TransferJob, TransferResult

logger = logging.getLogger("kvtier.worker")

def blocks_per_job(specs, slot_bytes: int) -> dict[str, int]:
    """Each tier's blocks per I/O job, loads and writes alike: about its ``job_bytes`` (``TierSpec``),
    at least one block. A load's jobs are copied to the device as each lands; a tier's jobs run side
    by side on the I/O process's threads, while each job reads or writes its blocks in order."""
    return {spec.name: max(1, spec.job_bytes // slot_bytes) for spec in specs}


def merged(first: TransferResult | None, second: TransferResult) -> TransferResult:
    """One result for a job made of several transfers (its layers): no layer's copy covers a whole
    slot, so none took checksums."""
    if first is None:
        return second
    return TransferResult(second.job_id, first.success and second.success, first.num_bytes + second.num_bytes,
                          max(first.seconds, second.seconds), first.error or second.error)


@dataclass
class Load:
    job: LoadJob
    report: JobReport
    deadline: float
    fills_left: int  # I/O jobs (a tier's blocks, in chunks) not answered yet
    usable: list[tuple[int, int, bytes]] = field(default_factory=list)  # (block, slot, key) now in host slots
    abandoned: bool = False
    fills_settled: threading.Event = field(default_factory=threading.Event)  # every fill answered or abandoned
    transfers_left: int = 1  # one per answered chunk (and one for blocks already in host slots); layer-wise: per layer
    copies_in_flight: int = 0  # host -> device copies started and not finished: never abandoned meanwhile
    layer_transfer_ids: dict[int, int] = field(default_factory=dict)
    copy_result: TransferResult | None = None
    # A checked copy's transfer id -> (blocks, keys, checksums their entries hold; None: checked already)
    checks: dict[int, tuple[list, list, list]] = field(default_factory=dict)

    def check_copy(self, result: TransferResult) -> None:  # under the book's lock
        """One of the load's copies to the device is over: a block whose slot did not hash to its entry's
        checksum as the copy read it came from a damaged entry, and is a miss (the engine recomputes it)."""
        blocks, keys, expected = self.checks.pop(result.job_id, ((), (), ()))
        if not result.success:
            return  # every usable block fails (``LoadPath.copied``)
        bad = set()
        for i, (block, key, want) in enumerate(zip(blocks, keys, expected)):
            if want is not None and (result.checksums is None or int(result.checksums[i]) != want):
                logger.warning("kvtier: entry %s is a miss (checksum mismatch); its block will be recomputed",
                               key.hex())
                self.report.failed_block_ids.append(block)
                self.report.bad_keys.append(key)
                bad.add(block)
        if bad:
            self.usable = [entry for entry in self.usable if entry[0] not in bad]


@dataclass
class Store:
    job: StoreJob
    report: JobReport
    device_reads_done: bool = False  # the device -> host copy finished: the blocks may be reused
    transfers_left: int = 1  # layer-wise: one transfer per layer
    copy_result: TransferResult | None = None
    layer_transfers: list[TransferJob | None] | None = None  # layer-wise: each layer's, until it is sent
    raced: bool = False  # the engine reused its blocks before its copy ended: never persisted
    abandon_at: float = float("inf")  # when writes still unanswered are given up (report sent, slots held)
    chunks_left: dict = field(default_factory=dict)  # tier -> its write jobs the I/O process has not answered
    abandoned: bool = False

    @property
    def writes_left(self) -> int:
        return sum(self.chunks_left.values())


class JobBook:
    def __init__(self, transfers: TransferEngine):
        self.transfers = transfers
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified when a store finishes
        self.loads: dict[int, Load] = {}
        self.stores: dict[int, Store] = {}
        self._owner_of_transfer: dict[int, tuple[bool, int]] = {}  # transfer id -> (is_load, job id)
        self._transfer_ids = itertools.count()
        self._finished: list[JobReport] = []
        self._released: list[int] = []

    def registered_transfer(self, block_ids, slot_ids, to_host: bool, owner: tuple[bool, int],
                            tensor_indices: tuple[int, ...] | None = None, checked: bool = False) -> TransferJob:
        with self.lock:  # registered before it is submitted, so a fast completion always finds its job
            transfer = TransferJob(np.asarray(block_ids, np.int64), np.asarray(slot_ids, np.int64), to_host,
                                   next(self._transfer_ids), tensor_indices, checked)
            self._owner_of_transfer[transfer.job_id] = owner
        return transfer

    def submit_transfer(self, block_ids, slot_ids, to_host: bool, owner: tuple[bool, int],
                        tensor_indices: tuple[int, ...] | None = None, inline: bool = False) -> int:
        transfer = self.registered_transfer(block_ids, slot_ids, to_host, owner, tensor_indices)
        self.transfers.submit(transfer, inline)
        return transfer.job_id

    def store_transfers(self, store_job_ids) -> set[int]:
        wanted = set(store_job_ids)
        with self.lock:
            return {t for t, (is_load, j) in self._owner_of_transfer.items() if not is_load and j in wanted}

    def copied(self) -> list[tuple[Load | Store, TransferResult]]:
        """Jobs whose every transfer has finished since the last call, with their merged result."""
        done = []
        for result in self.transfers.poll():
            with self.lock:
                is_load, job_id = self._owner_of_transfer.pop(result.job_id)
                job = self.loads[job_id] if is_load else self.stores[job_id]
                if is_load:
                    job.check_copy(result)  # before the merge, which keeps no load's checksums
                job.copy_result = merged(job.copy_result, result)
                job.transfers_left -= 1
                if is_load:
                    job.copies_in_flight -= 1
                if job.transfers_left:
                    continue  # layer-wise: more layers to come
                # A load stays in ``loads`` until its report is finished (``LoadPath.copied``): an idle
                # step that found neither would return at once, and its busy loop would hold the GIL that
                # the reporting thread needs.
            done.append((job, job.copy_result))
        return done

    def finish(self, report: JobReport) -> None:  # under the lock
        self._finished.append(report)
        self.changed.notify_all()

    def release(self, slot_ids) -> None:  # under the lock
        self._released += slot_ids

    @property
    def has_finished(self) -> bool:  # under the lock
        return bool(self._finished)

    def take_finished(self) -> list[JobReport]:
        with self.lock:
            finished, self._finished = self._finished, []
        return finished

    def take_released(self) -> list[int]:
        with self.lock:
            released, self._released = self._released, []
        return released

    @property
    def num_jobs(self) -> int:
        with self.lock:
            return len(self.loads) + len(self.stores)
