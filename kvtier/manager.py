"""Scheduler side of kvtier: which blocks the tiers hold, and the jobs that move them.

This class runs in the scheduler and holds no tensor; it imports neither torch
nor any engine. It answers lookups (host, then disk), plans load and store jobs
that pin what they use, and, when every worker has reported a job, releases the
pins and records the outcome. Pins are released only then, on success and on
failure alike, so a slot or file is never reused while a transfer uses it.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Sequence

from kvtier.config import KVTierConfig
from kvtier.plans import JobReport, LoadJob, StoreJob
from kvtier.tiers.disk import DiskIndex
from kvtier.tiers.host import HostPoolIndex

logger = logging.getLogger("kvtier.manager")


def num_host_slots(host_bytes: int, slot_bytes: int) -> int:
    """Both sides size the host pool with this, so they agree on slot ids."""
    return host_bytes // slot_bytes


@dataclass
class ManagerStats:
    """Cumulative counters; the metrics layer reads differences."""

    host_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    loaded_blocks: int = 0
    failed_load_blocks: int = 0
    stored_blocks: int = 0
    disk_written_blocks: int = 0
    failed_store_blocks: int = 0
    skipped_store_blocks: int = 0  # no free or evictable host slot
    bad_entries: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0


@dataclass
class _Pending:
    job: LoadJob | StoreJob
    reports: list[JobReport] = field(default_factory=list)


class TierManager:
    def __init__(self, config: KVTierConfig, slot_bytes: int, rank_fingerprints: Sequence[bytes], num_workers: int = 1):
        self.config = config
        self.slot_bytes = slot_bytes
        self.num_workers = num_workers
        slots = num_host_slots(config.host_bytes, slot_bytes)
        if slots <= 0:
            raise ValueError(f"kvtier config: key 'host_bytes' ({config.host_bytes}) is smaller than one block "
                             f"({slot_bytes} bytes); allowed: at least {slot_bytes}")
        self.host = HostPoolIndex(slots)
        self.disk = (DiskIndex(config.disk_dir, config.disk_bytes, slot_bytes, rank_fingerprints)
                     if config.disk_dir else None)
        self.stats = ManagerStats()
        self._job_ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}

    # --- lookup -------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that some tier holds and that can be loaded now.

        Disk hits are staged through host slots, so no more of them count than the
        host pool could take at once.
        """
        hits = disk_hits = 0
        for key in keys:
            if self.host.lookup((key,)):
                hits += 1
            elif (self.disk is not None and disk_hits < self.host.num_available and not self.host.contains(key)
                  and self.disk.lookup((key,))):  # a key being written to host cannot take a second slot
                hits += 1
                disk_hits += 1
            else:
                break
        return hits

    # --- loads --------------------------------------------------------------
    def plan_load(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> LoadJob:
        """Plan loading ``keys[i]`` into device block ``block_ids[i]``.

        Each block is resolved again here (it may have been evicted since the
        lookup): host hits are pinned; disk hits get a reserved host slot and a
        pinned file; from the first block found nowhere on, blocks are reported
        missing, since the engine recomputes from the first failed block anyway.
        """
        ready_blocks, ready_slots, ready_keys = [], [], []
        fill_blocks, fill_slots, fill_keys = [], [], []
        missing: list[int] = []
        for key, block_id in zip(keys, block_ids):
            if missing:
                missing.append(block_id)
            elif self.host.lookup((key,)):
                ready_blocks.append(block_id)
                ready_slots += self.host.prepare_load((key,))
                ready_keys.append(key)
            elif (self.disk is not None and not self.host.contains(key) and self.disk.lookup((key,))
                  and (plan := self.host.prepare_store((key,))) is not None):
                self.disk.prepare_load((key,))
                fill_blocks.append(block_id)
                fill_slots += plan.slot_ids
                fill_keys.append(key)
            else:
                missing.append(block_id)
        job = LoadJob(next(self._job_ids), req_id, ready_blocks, ready_slots, ready_keys,
                      fill_blocks, fill_slots, fill_keys, missing)
        self.stats.host_hit_blocks += len(ready_blocks)
        self.stats.disk_hit_blocks += len(fill_blocks)
        self._pending[job.job_id] = _Pending(job)
        return job

    # --- stores -------------------------------------------------------------
    def plan_store(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> StoreJob | None:
        """Plan storing device blocks under ``keys``, write-through to disk.

        Keys already held are skipped; if the host pool cannot take them all, the
        first ones that fit are stored. Returns None if nothing is to be stored.
        """
        wanted = {key: block_id for key, block_id in zip(keys, block_ids) if not self.host.contains(key)}
        fitting = list(wanted)[:self.host.num_available]  # a prefix is what later lookups can use
        self.stats.skipped_store_blocks += len(wanted) - len(fitting)
        plan = self.host.prepare_store(fitting) if fitting else None
        if plan is None:
            return None
        disk_keys = self.disk.prepare_store(plan.keys) if self.disk is not None else []
        slot_of = dict(zip(plan.keys, plan.slot_ids))
        job = StoreJob(next(self._job_ids), req_id, [wanted[k] for k in plan.keys], plan.slot_ids, plan.keys,
                       disk_keys, [slot_of[k] for k in disk_keys])
        self._pending[job.job_id] = _Pending(job)
        return job

    # --- completion ---------------------------------------------------------
    def on_reports(self, reports: Sequence[JobReport]) -> list[int]:
        """Take workers' reports; returns the ids of jobs now complete on every worker."""
        completed = []
        for report in reports:
            pending = self._pending.get(report.job_id)
            if pending is None:
                logger.error("kvtier: report for unknown job %d ignored", report.job_id)
                continue
            pending.reports.append(report)
            if len(pending.reports) == self.num_workers:
                del self._pending[report.job_id]
                self._complete(pending)
                completed.append(report.job_id)
        return completed

    def is_pending(self, job_id: int) -> bool:
        return job_id in self._pending

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _complete(self, pending: _Pending) -> None:
        job, reports = pending.job, pending.reports
        bad_keys = {key for r in reports for key in r.bad_keys}
        self.stats.bad_entries += len(bad_keys)
        num_bytes = sum(r.num_bytes for r in reports)
        seconds = max(r.seconds for r in reports)
        if isinstance(job, LoadJob):
            failed_blocks = {b for r in reports for b in r.failed_block_ids}
            self.stats.failed_load_blocks += len(failed_blocks)
            self.stats.loaded_blocks += job.num_blocks - len(failed_blocks)
            self.stats.load_bytes += num_bytes
            self.stats.load_seconds += seconds
            self.host.complete_load(job.ready_slot_ids)
            for block_id, slot_id in zip(job.fill_block_ids, job.fill_slot_ids):
                # A filled slot becomes a host hit only if every rank filled it.
                self.host.complete_store((slot_id,), success=block_id not in failed_blocks)
            if self.disk is not None:
                self.disk.complete_load(job.fill_keys)
            for key in bad_keys:  # after the pins are gone, so that discarding takes effect
                if self.disk is not None:
                    self.disk.discard(key)
            for block_id, key in zip(job.ready_block_ids, job.ready_keys):
                if block_id in failed_blocks:
                    self.host.discard(key)
        else:
            success = all(r.success for r in reports)
            self.host.complete_store(job.slot_ids, success)
            self.stats.store_bytes += num_bytes
            self.stats.store_seconds += seconds
            if success:
                self.stats.stored_blocks += len(job.slot_ids)
            else:
                self.stats.failed_store_blocks += len(job.slot_ids)
            if self.disk is not None and job.disk_keys:
                failed_disk = {key for r in reports for key in r.failed_disk_keys}
                written = [k for k in job.disk_keys if k not in failed_disk and success]
                self.disk.complete_store(written, success=True)
                self.disk.complete_store([k for k in job.disk_keys if k not in written], success=False)
                self.stats.disk_written_blocks += len(written)
