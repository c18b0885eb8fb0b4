"""Scheduler side of kvtier: which blocks the tiers hold, and the jobs that move them.

This class runs in the scheduler and holds no tensor; it imports neither torch
nor any engine. It answers lookups (the host pool, then each tier's index in
order: ``kvtier.scheduler.lookups``), and plans load and store jobs that pin what they use.
Once every worker has reported a job, ``kvtier.scheduler.completions`` releases its pins and
records the outcome. It names no tier: the tiers below the host pool are
``TierIndex`` objects built from the configuration by ``kvtier.tiers.registry``.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from kvtier.common.config import KVTierConfig
from kvtier.common.host_slots import num_host_slots
from kvtier.common.plans import JobReport, LoadJob, StoreJob
from kvtier.scheduler.completions import Completions, ManagerStats
from kvtier.scheduler.ledger import Ledger
from kvtier.scheduler.load_waves import LoadWaves
from kvtier.scheduler.lookups import HOST, Lookups
from kvtier.tiers.base import TierIndex
from kvtier.tiers.host import HostPoolIndex
from kvtier.tiers.registry import make_index, tier_specs


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
        # Misses by reason, and what each index gained and lost (for KV events and miss reasons).
        self.ledger = Ledger([self.host, *self.tiers], config.block_size or 0, track_holdings)
        self.lookups = Lookups(self.host, self.tiers, self.ledger, config.load_timeout_s)
        self.waves = LoadWaves(self, config.load_timeout_s)  # loads larger than the free host slots
        self.completions = Completions(self.host, self.tiers, self.ledger, self.lookups, self.waves, self.stats,
                                       num_workers)

    def tier(self, name: str) -> TierIndex:
        return next(tier for tier in self.tiers if tier.name == name)

    # --- lookup (kvtier.scheduler.lookups) ---------------------------------------------
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

    def can_load_in_step(self, keys: Sequence[bytes], token: str) -> bool:
        """Whether a hit of ``keys`` (``token``'s last lookup) can be copied within the engine's step that
        computes the rest of its prompt, as the engine's own prefix cache serves a hit: held whole in the
        host pool (a copy, no read that the step would wait for), its pins all in one wave, and no larger
        than ``in_step_load_bytes``. A hit read from a tier, a larger one, or one whose other ranks
        receive it by broadcast (``save_only_first_rank``) loads beside the steps instead."""
        return not self.config.save_only_first_rank and len(keys) * self.slot_bytes <= \
            self.config.in_step_load_bytes and self.host.lookup(keys) == len(keys) and \
            self.lookups.in_one_wave(token)

    def may_hold(self, key: bytes) -> bool:
        """A guess that costs a few dict lookups: the host pool or a tier that answers from its own
        list holds ``key``. A tier that asks its server is not asked (no guess from it)."""
        return self.host.contains(key) or any(tier.lookup([key], None)[0] for tier in self.tiers
                                              if tier not in self.lookups.asking)

    def wait_for_lookups(self, timeout_s: float) -> None:
        """An engine step that computes nothing: wait, at most ``timeout_s``, for the tiers' answers
        that lookups wait for ("ask again"). Else the engine steps again at once, a busy loop on a core
        that the tier's answer needs (in vLLM's one-process layout the loop holds the GIL that the
        answer's thread needs). Not while a load is pending: the workers wait for that one
        (``TierWorker.wait_for_a_load``), and a new request waits for one of the two at most."""
        if not self.completions.loads_pending:
            self.lookups.wait_for_answers(timeout_s)

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
        for tier in self.lookups.asking:
            tier.forget(token)

    # --- loads --------------------------------------------------------------
    def plan_load(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                  in_step: bool = False, found: list[dict[bytes, bool]] | None = None) -> LoadJob:
        """Plan loading ``keys[i]`` into device block ``block_ids[i]``.

        Each block is resolved again here (it may have been evicted since the
        lookup): host hits are pinned; tier hits get a reserved host slot (and the
        tier a pin); from the first block found nowhere on, blocks are reported
        missing, since the engine recomputes from the first failed block. An
        ``in_step`` load (copied within the engine's step) reads host slots only: anything else is missing.
        Where the host pool has no slot left to stage through, the job is a wave
        (``final`` False) of its first blocks, and ``waves`` (``kvtier.scheduler.load_waves``)
        plans the rest once this wave has freed its slots.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"plan_load for {req_id}: {len(keys)} keys but {len(block_ids)} blocks")
        found = self.lookups.found_for_plan(req_id, keys, found)  # its lookup's promised slots are taken now
        # This wave: as many blocks as the free slots allow (a pin takes one, a stage one), less the slots
        # other lookups were promised (their requests plan after this one, in the same step).
        sources, end, _ = self.lookups.walk(keys, found, host_only=in_step)
        # Host hits are pinned before anything is staged: staging evicts, and must not evict them.
        host_at = [i for i in range(end) if sources[i] == HOST]
        slot_at = dict(zip(host_at, self.host.prepare_load([keys[i] for i in host_at])))
        location_at = {}  # where each tier hit's tier keeps it, for its store
        for i in range(end):
            if sources[i] == HOST:
                continue
            plan = self.host.prepare_store((keys[i],))
            if plan is None:  # the room was counted above; should it run out all the same, the wave ends here
                end = i
                break
            slot_at[i] = plan.slot_ids[0]
            (location_at[i],) = self.tier(sources[i]).prepare_load((keys[i],))
        self.host.complete_load([slot_at[i] for i in host_at if i >= end])  # past the wave: not loaded
        ready = [i for i in range(end) if sources[i] == HOST]
        fills = [i for i in range(end) if sources[i] != HOST]
        # A wave stops for room, or at a block another request is writing to the host pool (its
        # next wave reads it once written); at a block found nowhere, the rest is missing.
        writing = len(sources) < len(keys) and self.host.is_being_written(keys[len(sources)])
        wave = 0 < end and (end < len(sources) or writing) and not in_step
        job = LoadJob(next(self._job_ids), req_id,
                      [block_ids[i] for i in ready], [slot_at[i] for i in ready], [keys[i] for i in ready],
                      [block_ids[i] for i in fills], [slot_at[i] for i in fills], [keys[i] for i in fills],
                      [sources[i] for i in fills], [] if wave else list(block_ids[end:]), in_step,
                      [location_at[i] for i in fills], final=not wave)
        self.stats.planned_blocks.update(sources[:end])
        self.completions.expect(job)
        if wave:
            self.waves.keep(job, list(keys[end:]), list(block_ids[end:]), found)
        return job

    def plan_missing(self, req_id: str, block_ids: Sequence[int], reason: str) -> LoadJob:
        """A load job that only reports ``block_ids`` missing (counted under ``reason``)."""
        if block_ids:
            self.ledger.count_failed_load(req_id, reason, len(block_ids))
        job = LoadJob(next(self._job_ids), req_id, [], [], [], [], [], [], [], list(block_ids))
        self.completions.expect(job)
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
        writes = {tier: tier.prepare_store(plan.keys) for tier in self._writes_to}  # key -> location, per tier
        writes = {tier: places for tier, places in writes.items() if places}
        job = StoreJob(next(self._job_ids), req_id, [wanted[k] for k in plan.keys], plan.slot_ids, plan.keys,
                       {tier.name: list(places) for tier, places in writes.items()},
                       {tier.name: list(places.values()) for tier, places in writes.items()})
        self.completions.expect(job)
        return job

    def num_held_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` the host pool holds or is being written (stored, or planned)."""
        return sum(1 for _ in itertools.takewhile(self.host.contains, keys))

    # --- completion (kvtier.scheduler.completions) ------------------------------------
    def on_reports(self, reports: Sequence[JobReport]) -> list[int]:
        """Take workers' reports; returns the ids of jobs now complete on every worker."""
        return self.completions.on_reports(reports)

    def on_released(self, slot_ids: Sequence[int]) -> None:
        """Slots that an abandoned read has stopped writing, one entry per rank."""
        self.completions.on_released(slot_ids)

    @property
    def num_held(self) -> int:
        return self.completions.num_held

    def is_pending(self, job_id: int) -> bool:
        return self.completions.is_pending(job_id)

    @property
    def num_pending(self) -> int:
        return self.completions.num_pending

    def close(self) -> None:
        self.ledger.close()
        for tier in self.tiers:
            tier.close()
