"""Workers' reports in, pins out: the end of every load and store job. Torch-free, engine-free.

A job is complete once every worker has reported it. Only then are its pins released,
on success and on failure alike, so that no host slot or tier entry is reused while a
transfer still uses it; a slot that an abandoned transfer may still touch stays held
until every rank says it has let it go (``on_released``). A complete job's outcome
goes to the host pool's index, to each tier's index, to the miss ledger and to the
counters (``ManagerStats``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from kvtier.common.plans import JobReport, LoadJob, StoreJob
from kvtier.scheduler.ledger import Ledger
from kvtier.scheduler.load_waves import LoadWaves
from kvtier.scheduler.lookups import Lookups
from kvtier.tiers.base import TierIndex
from kvtier.tiers.host import HostPoolIndex

logger = logging.getLogger("kvtier.scheduler.manager")


@dataclass
class ManagerStats:
    """Cumulative counters; the metrics layer reads differences. Per-tier ones are keyed by the tier's name."""

    planned_blocks: Counter = field(default_factory=Counter)  # "host" and each tier: blocks planned to load from it
    written_blocks: Counter = field(default_factory=Counter)  # each tier: blocks written through to it
    failed_writes: Counter = field(default_factory=Counter)
    loaded_blocks: int = 0
    failed_load_blocks: int = 0
    stored_blocks: int = 0
    failed_store_blocks: int = 0
    skipped_store_blocks: int = 0  # no free or evictable host slot
    abandoned_loads: int = 0  # reads not answered within load_timeout_s (recomputed)
    abandoned_stores: int = 0  # tier writes not answered in time (given up, slots held until they end)
    bad_entries: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0


@dataclass
class _Pending:
    job: LoadJob | StoreJob
    reports: list[JobReport] = field(default_factory=list)


class Completions:
    def __init__(self, host: HostPoolIndex, tiers: Sequence[TierIndex], ledger: Ledger, lookups: Lookups,
                 waves: LoadWaves, stats: ManagerStats, num_workers: int):
        self.host, self.ledger, self.lookups, self.waves, self.stats = host, ledger, lookups, waves, stats
        self.tiers = list(tiers)
        self._tiers = {tier.name: tier for tier in self.tiers}
        self.num_workers = num_workers
        self._pending: dict[int, _Pending] = {}
        self._held: dict[int, int] = {}  # slot -> ranks whose abandoned read may still write it

    def expect(self, job: LoadJob | StoreJob) -> None:
        """``job`` was sent: its pins are released when every worker has reported it."""
        self._pending[job.job_id] = _Pending(job)

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
        self.waves.on_completed(completed)
        self.ledger.absorb()  # every step with reports: the indexes' log never grows past a step's worth
        return completed

    def on_released(self, slot_ids: Sequence[int]) -> None:
        """Slots that an abandoned read has stopped writing, one entry per rank."""
        for slot in slot_ids:
            remaining = self._held.get(slot, 0) - 1
            if remaining > 0:
                self._held[slot] = remaining
            elif slot in self._held:
                del self._held[slot]
                self.host.complete_store((slot,), success=False)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def is_pending(self, job_id: int) -> bool:
        return job_id in self._pending

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def loads_pending(self) -> bool:
        return any(isinstance(pending.job, LoadJob) for pending in self._pending.values())

    def _complete(self, pending: _Pending) -> None:
        job, reports = pending.job, pending.reports
        bad_keys = {key for r in reports for key in r.bad_keys}
        self.stats.bad_entries += len(bad_keys)
        num_bytes = sum(r.num_bytes for r in reports)
        seconds = max(r.seconds for r in reports)
        if isinstance(job, LoadJob):
            self._complete_load(job, reports, bad_keys)
            self.stats.load_bytes += num_bytes
            self.stats.load_seconds += seconds
            return
        success = all(r.success for r in reports)
        held: Counter = Counter(slot for r in reports for slot in r.held_slot_ids)
        self.stats.abandoned_stores += bool(held)
        for slot in held:  # a late tier write may still read it: pinned until released, then dropped
            self._held[slot] = held[slot]
        self.host.complete_store([slot for slot in job.slot_ids if slot not in held], success)
        self.stats.store_bytes += num_bytes
        self.stats.store_seconds += seconds
        if success:
            self.stats.stored_blocks += len(job.slot_ids)
        else:
            self.stats.failed_store_blocks += len(job.slot_ids)
        deleted: dict[str, dict[bytes, None]] = {}  # tier -> entries its store deleted, each rank's its own shards
        for r in reports:
            for name, keys in r.deleted.items():
                deleted.setdefault(name, {}).update(dict.fromkeys(keys))
        for name in {**job.writes, **deleted}:
            keys = job.writes.get(name, [])
            failed = {key for r in reports for key in r.failed_writes.get(name, ())}
            written = [k for k in keys if k not in failed and success]  # every rank wrote its shard
            # The index takes the deletions after this job's own writes: a later deletion is the latest news.
            self._tiers[name].complete_store(written, [k for k in keys if k not in written],
                                             list(deleted.get(name, ())), any(name in r.full_tiers for r in reports))
            self.stats.written_blocks[name] += len(written)
            self.stats.failed_writes[name] += len(keys) - len(written)

    def _complete_load(self, job: LoadJob, reports: list[JobReport], bad_keys: set[bytes]) -> None:
        failed_blocks = {b for r in reports for b in r.failed_block_ids}
        gone_keys = {key for r in reports for key in r.gone_keys} - bad_keys
        self.stats.failed_load_blocks += len(failed_blocks)
        failed_reads = len(failed_blocks - set(job.missing_block_ids))  # planned, then not loaded: recomputed
        if failed_reads:
            abandoned = any(r.held_slot_ids for r in reports)
            gone_from = [source for key, source in zip(job.fill_keys, job.fill_from) if key in gone_keys]
            reason = ("load_abandoned" if abandoned else "damaged" if bad_keys
                      else f"evicted_{gone_from[0]}" if gone_from else "load_failed")
            self.ledger.count_failed_load(job.req_id, reason, failed_reads)
            # vLLM reschedules the request: it is not read again from the tiers it failed from.
            self.lookups.load_failed(job.req_id, {source for block_id, source in zip(job.fill_block_ids, job.fill_from)
                                                  if block_id in failed_blocks})
            self.waves.failed(job.req_id, reason)  # the engine recomputes from here: later waves are not read
        self.stats.loaded_blocks += job.num_blocks - len(failed_blocks)
        self.host.complete_load(job.ready_slot_ids)
        held: Counter = Counter(slot for r in reports for slot in r.held_slot_ids)
        self.stats.abandoned_loads += any(r.held_slot_ids for r in reports)
        for block_id, slot_id in zip(job.fill_block_ids, job.fill_slot_ids):
            if slot_id in held:  # a read abandoned after its timeout may still write it
                self._held[slot_id] = held[slot_id]
            else:  # a filled slot becomes a host hit only if every rank filled it
                self.host.complete_store((slot_id,), success=block_id not in failed_blocks)
        for tier in self.tiers:
            keys = [k for k, source in zip(job.fill_keys, job.fill_from) if source == tier.name]
            if keys:
                # An entry that failed to load is dropped (a tier's own entries) or not offered for a
                # while (a shared tier's); else the engine would ask for the same broken block forever.
                tier.complete_load(keys, [k for k in keys if k in bad_keys], [k for k in keys if k in gone_keys])
        for block_id, key in zip(job.ready_block_ids, job.ready_keys):
            if block_id in failed_blocks:
                self.host.discard(key)
