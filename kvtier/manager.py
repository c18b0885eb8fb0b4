"""Scheduler side of kvtier: which blocks the tiers hold, and the jobs that move them.

This class runs in the scheduler and holds no tensor; it imports neither torch
nor any engine. It answers lookups (the host pool, then each tier's index in
order: ``kvtier.lookups``), plans load and store jobs that pin what they use, and, when every worker
has reported a job, releases the pins and records the outcome. Pins are released
only then, on success and on failure alike, so a slot or file is never reused
while a transfer uses it. It names no tier: the tiers below the host pool are
``TierIndex`` objects built from the configuration by ``kvtier.tiers.registry``.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvtier.config import KVTierConfig
from kvtier.ledger import Ledger
from kvtier.load_waves import LoadWaves
from kvtier.lookups import HOST, Lookups
from kvtier.plans import JobReport, LoadJob, StoreJob
from kvtier.tiers.base import TierIndex
from kvtier.tiers.host import HostPoolIndex
from kvtier.tiers.registry import make_index, tier_specs

logger = logging.getLogger("kvtier.manager")


def num_host_slots(host_bytes: int, slot_bytes: int) -> int:
    """Both sides size the host pool with this, so they agree on slot ids."""
    return host_bytes // slot_bytes


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


class TierManager:
    def __init__(self, config: KVTierConfig, slot_bytes: int, rank_fingerprints: Sequence[bytes], num_workers: int = 1,
                 track_holdings: bool = False):
        self.config = config
        self.slot_bytes = slot_bytes
        self.num_workers = num_workers
        slots = num_host_slots(config.host_bytes, slot_bytes)
        if slots <= 0:
            raise ValueError(f"kvtier config: key 'host_bytes' ({config.host_bytes}) is smaller than one block "
                             f"({slot_bytes} bytes); allowed: at least {slot_bytes}")
        self.host = HostPoolIndex(slots)
        self.rank_fingerprints = list(rank_fingerprints)
        self.specs = tier_specs(config)
        self.tiers: list[TierIndex] = [make_index(spec, slot_bytes, self.rank_fingerprints) for spec in self.specs]
        self._writes_to = [tier for tier, spec in zip(self.tiers, self.specs) if spec.options.get("write", True)]
        self.stats = ManagerStats()
        self._job_ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._held: dict[int, int] = {}  # slot -> ranks whose abandoned read may still write it
        # Misses by reason, and what each index gained and lost (for KV events and miss reasons).
        self.ledger = Ledger([self.host, *self.tiers], config.block_size or 0, track_holdings)
        self.lookups = Lookups(self.host, self.tiers, self.ledger, config.load_timeout_s)
        self.waves = LoadWaves(self, config.load_timeout_s)  # loads larger than the free host slots

    def tier(self, name: str) -> TierIndex:
        return next(tier for tier in self.tiers if tier.name == name)

    # --- lookup (kvtier.lookups) ---------------------------------------------
    def lookup(self, keys: Sequence[bytes], token: str | None = None,
               first_read: Callable[[int], int] | None = None) -> int | None:
        """Number of leading ``keys`` some tier holds and a plan can load now (those before
        ``first_read(n)`` of a hit of ``n`` need not be held); None: ask again."""
        return self.lookups.lookup(keys, token, first_read)

    def miss_reason(self, key: bytes, token: str | None = None) -> str:
        return self.lookups.miss_reason(key, token)

    def can_arrive(self, token: str) -> bool:
        return self.lookups.can_arrive(token)

    def free_slots(self) -> int:
        return self.lookups.free_slots()

    def host_hits(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` ready in the host pool (loadable layer by layer)."""
        return self.host.lookup(keys)

    def drop_lookup(self, token: str) -> None:
        """``token``'s lookup is not followed by a load (the engine holds those blocks already, or
        computes them): the host slots it counted on go back to other lookups at once."""
        self.lookups.take(token)

    def forget(self, token: str) -> None:
        """Drop what a lookup remembered for ``token`` (a request that went away)."""
        self.lookups.forget(token)
        self.ledger.forget(token)
        self.ask_again(token)

    def ask_again(self, token: str) -> None:
        """The tiers' last answers for ``token`` are not reused: its next lookup asks them anew."""
        for tier in self.tiers:
            tier.forget(token)

    # --- loads --------------------------------------------------------------
    def plan_load(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                  layerwise: bool = False, found: list[dict[bytes, bool]] | None = None) -> LoadJob:
        """Plan loading ``keys[i]`` into device block ``block_ids[i]``.

        Each block is resolved again here (it may have been evicted since the
        lookup): host hits are pinned; tier hits get a reserved host slot (and the
        tier a pin); from the first block found nowhere on, blocks are reported
        missing, since the engine recomputes from the first failed block. A
        ``layerwise`` load reads host slots only: anything else is missing.
        Where the host pool has no slot left to stage through, the job is a wave
        (``final`` False) of its first blocks, and ``waves`` (``kvtier.load_waves``)
        plans the rest once this wave has freed its slots.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"plan_load for {req_id}: {len(keys)} keys but {len(block_ids)} blocks")
        found = self.lookups.found_for_plan(req_id, keys, found)  # its lookup's promised slots are taken now
        # This wave: as many blocks as the free slots allow (a pin takes one, a stage one), less the slots
        # other lookups were promised (their requests plan after this one, in the same step).
        sources, end, _ = self.lookups.walk(keys, found, host_only=layerwise)
        # Host hits are pinned before anything is staged: staging evicts, and must not evict them.
        host_at = [i for i in range(end) if sources[i] == HOST]
        slot_at = dict(zip(host_at, self.host.prepare_load([keys[i] for i in host_at])))
        for i in range(end):
            if sources[i] == HOST:
                continue
            plan = self.host.prepare_store((keys[i],))
            if plan is None:  # the room was counted above; should it run out all the same, the wave ends here
                end = i
                break
            slot_at[i] = plan.slot_ids[0]
            self.tier(sources[i]).prepare_load((keys[i],))
        self.host.complete_load([slot_at[i] for i in host_at if i >= end])  # past the wave: not loaded
        ready = [i for i in range(end) if sources[i] == HOST]
        fills = [i for i in range(end) if sources[i] != HOST]
        # A wave stops for room, or at a block another request is writing to the host pool (its
        # next wave reads it once written); at a block found nowhere, the rest is missing.
        writing = len(sources) < len(keys) and self.host.is_being_written(keys[len(sources)])
        wave = 0 < end and (end < len(sources) or writing) and not layerwise
        job = LoadJob(next(self._job_ids), req_id,
                      [block_ids[i] for i in ready], [slot_at[i] for i in ready], [keys[i] for i in ready],
                      [block_ids[i] for i in fills], [slot_at[i] for i in fills], [keys[i] for i in fills],
                      [sources[i] for i in fills], [] if wave else list(block_ids[end:]), layerwise,
                      [self.tier(sources[i]).location(keys[i]) for i in fills], final=not wave)
        self.stats.planned_blocks.update(sources[:end])
        self._pending[job.job_id] = _Pending(job)
        if wave:
            self.waves.keep(job, list(keys[end:]), list(block_ids[end:]), found)
        return job

    def plan_missing(self, req_id: str, block_ids: Sequence[int], reason: str) -> LoadJob:
        """A load job that only reports ``block_ids`` missing (counted under ``reason``)."""
        if block_ids:
            self.ledger.count_failed_load(req_id, reason, len(block_ids))
        job = LoadJob(next(self._job_ids), req_id, [], [], [], [], [], [], [], list(block_ids))
        self._pending[job.job_id] = _Pending(job)
        return job

    # --- stores -------------------------------------------------------------
    def plan_store(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                   count_skipped: bool = True) -> StoreJob | None:
        """Plan storing device blocks under ``keys``, written through to every tier in ``store_to``.

        Keys already held are skipped; if the host pool cannot take them all, the
        first ones that fit are stored (``num_held_prefix`` says how far that got;
        a caller that tries the rest again later counts what it skips itself).
        Returns None if nothing is to be stored.
        """
        wanted = {key: block_id for key, block_id in zip(keys, block_ids) if not self.host.contains(key)}
        fitting = list(wanted)[:self.host.num_available]  # a prefix is what later lookups can use
        self.stats.skipped_store_blocks += (len(wanted) - len(fitting)) * count_skipped
        plan = self.host.prepare_store(fitting) if fitting else None
        if plan is None:
            return None
        writes = {tier: tier.prepare_store(plan.keys) for tier in self._writes_to}
        writes = {tier: keys for tier, keys in writes.items() if keys}
        job = StoreJob(next(self._job_ids), req_id, [wanted[k] for k in plan.keys], plan.slot_ids, plan.keys,
                       {tier.name: keys for tier, keys in writes.items()},
                       {tier.name: [tier.location(k) for k in keys] for tier, keys in writes.items()})
        self._pending[job.job_id] = _Pending(job)
        return job

    def num_held_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` the host pool holds or is being written (stored, or planned)."""
        return sum(1 for _ in itertools.takewhile(self.host.contains, keys))

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

    def close(self) -> None:
        self.ledger.close()
        for tier in self.tiers:
            tier.close()

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
        for name, keys in job.writes.items():
            failed = {key for r in reports for key in r.failed_writes.get(name, ())}
            written = [k for k in keys if k not in failed and success]  # every rank wrote its shard
            self.tier(name).complete_store(written, [k for k in keys if k not in written])
            if any(name in r.full_tiers for r in reports):  # after its failed keys gave their room back
                self.tier(name).device_full()
            self.stats.written_blocks[name] += len(written)
            self.stats.failed_writes[name] += len(keys) - len(written)
        deleted: dict[str, dict[bytes, None]] = {}  # tier -> entries its store deleted, each rank's its own shards
        for r in reports:
            for name, keys in r.deleted.items():
                deleted.setdefault(name, {}).update(dict.fromkeys(keys))
        for name, keys in deleted.items():  # after this job's own writes: a later deletion is the latest news
            self.tier(name).deleted_by_store(list(keys))

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
