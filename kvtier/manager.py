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
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from kvtier.config import KVTierConfig
from kvtier.plans import JobReport, LoadJob, StoreJob
from kvtier.tiers.disk import DiskIndex
from kvtier.tiers.host import HostPoolIndex
from kvtier.tiers.remote import ExistenceQueries, RemoteTier, remote_key

logger = logging.getLogger("kvtier.manager")


def num_host_slots(host_bytes: int, slot_bytes: int) -> int:
    """Both sides size the host pool with this, so they agree on slot ids."""
    return host_bytes // slot_bytes


@dataclass
class ManagerStats:
    """Cumulative counters; the metrics layer reads differences."""

    host_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    remote_hit_blocks: int = 0
    remote_written_blocks: int = 0
    failed_remote_writes: int = 0
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
        self.rank_fingerprints = list(rank_fingerprints)
        self.remote = RemoteTier(config.remote_url, config.remote_timeout_s, config.remote_retry_s) \
            if config.remote_url else None
        self._remote_queries = ExistenceQueries(self.remote) if self.remote else None
        self._remote_found: dict[str, set[bytes]] = {}  # token -> keys the pool holds for every rank
        # token -> host slots its lookup counted on (hits to pin, disk/pool hits to stage), until it
        # plans or goes away: another request's lookup does not count on the same slots.
        self._promised: dict[str, int] = {}
        self._waiting_since: dict[str, float] = {}  # token -> when its lookup began waiting for a write
        self.stats = ManagerStats()
        self._job_ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._held: dict[int, int] = {}  # slot -> ranks whose abandoned read may still write it
        # Pool entries that just failed to load (damaged, or gone): misses for a while, or the
        # engine would re-request the same broken hit forever. Shared entries are never deleted.
        self._failed_remote: OrderedDict[bytes, float] = OrderedDict()

    # --- lookup -------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], token: str | None = None) -> int | None:
        """Number of leading ``keys`` that some tier holds and that can be loaded now.

        Host first, then disk, then the pool. The pool is asked off this thread:
        while its answer is pending this returns None (ask again with the same
        ``token``); a pool that is down or silent counts as a miss. Disk and pool
        hits are staged through host slots and host hits are pinned, so no more of
        them count than the host pool could give at once: what a lookup counts,
        its plan delivers, unless a store runs in between. Where the hits stop at
        a block that is being written to the host pool (another request's store or
        load of the same prefix), this also returns None, for at most
        ``load_timeout_s``: waiting a step for a copy beats recomputing it.
        """
        self._promised.pop(token, None)  # this lookup replaces the token's previous one
        local = self._leading_hits(keys, set())[0]
        remote_found: set[bytes] = set()
        if self._remote_queries is not None and token is not None and local < len(keys):
            rest = keys[local:]
            names = [remote_key(fp, key) for key in rest for fp in self.rank_fingerprints]
            answer = self._remote_queries.query(token, names)
            if answer is None:
                return None
            ranks = len(self.rank_fingerprints)
            # A block counts as stored only if every rank stored its shard.
            remote_found = {key for i, key in enumerate(rest)
                            if all(answer[i * ranks:(i + 1) * ranks]) and not self._recently_failed(key)}
            self._remote_found[token] = remote_found
        hits, taken = self._leading_hits(keys, remote_found)
        if token is not None and hits < len(keys) and self.host.is_being_written(keys[hits]):
            now = time.monotonic()
            if now - self._waiting_since.setdefault(token, now) < self.config.load_timeout_s:
                return None
        if token is not None:
            self._waiting_since.pop(token, None)
        if token is not None and taken:
            self._promised[token] = taken
        return hits

    def host_hits(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` ready in the host pool (loadable layer by layer)."""
        return self.host.lookup(keys)

    def _leading_hits(self, keys: Sequence[bytes], remote_found: set[bytes]) -> tuple[int, int]:
        """(leading hits, host slots their plan takes out of the pool's available ones).

        A plan pins its evictable host hits and stages each disk or pool hit
        through a slot of its own; both come out of what the host pool could free
        now, less what other lookups were promised. Hits stop where that runs out.
        """
        hits = taken = 0
        budget = self.host.num_available - sum(self._promised.values())
        for key in keys:
            if self.host.lookup((key,)):
                need = self.host.is_evictable(key)
            # A key being written to host cannot take a second slot, and is not readable yet.
            elif not self.host.contains(key) and (
                    (self.disk is not None and self.disk.lookup((key,))) or key in remote_found):
                need = 1
            else:
                break
            if taken + need > budget:
                break
            hits, taken = hits + 1, taken + need
        return hits, taken

    def _recently_failed(self, key: bytes) -> bool:
        expiry = self._failed_remote.get(key)
        if expiry is None:
            return False
        if time.monotonic() < expiry:
            return True
        del self._failed_remote[key]
        return False

    def _remember_failed(self, keys) -> None:
        expiry = time.monotonic() + max(self.config.remote_retry_s, 30.0)
        for key in keys:
            self._failed_remote[key] = expiry
            self._failed_remote.move_to_end(key)
        while len(self._failed_remote) > 100_000:
            self._failed_remote.popitem(last=False)

    def forget(self, token: str) -> None:
        """Drop what a lookup remembered for ``token`` (a request that went away)."""
        self._remote_found.pop(token, None)
        self._promised.pop(token, None)
        self._waiting_since.pop(token, None)
        if self._remote_queries is not None:
            self._remote_queries.forget(token)

    # --- loads --------------------------------------------------------------
    def plan_load(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                  layerwise: bool = False) -> LoadJob:
        """Plan loading ``keys[i]`` into device block ``block_ids[i]``.

        Each block is resolved again here (it may have been evicted since the
        lookup): host hits are pinned; disk and pool hits get a reserved host slot
        (and disk files a pin); from the first block found nowhere on, blocks are
        reported missing, since the engine recomputes from the first failed block.
        A ``layerwise`` load reads host slots only: anything else is missing.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"plan_load for {req_id}: {len(keys)} keys but {len(block_ids)} blocks")
        remote_found = self._remote_found.pop(req_id, set())
        self._promised.pop(req_id, None)  # the slots are taken now, or not at all
        self._waiting_since.pop(req_id, None)
        sources: list[str] = []  # the loadable prefix: where each block is read from
        for key in keys:
            if self.host.lookup((key,)):
                sources.append("host")
            elif layerwise or self.host.contains(key):  # not readable, and cannot take a second slot
                break
            elif self.disk is not None and self.disk.lookup((key,)):
                sources.append("disk")
            elif key in remote_found:
                sources.append("remote")
            else:
                break
        # Host hits are pinned before anything is staged: staging evicts, and must not evict them.
        host_at = [i for i, source in enumerate(sources) if source == "host"]
        slot_at = dict(zip(host_at, self.host.prepare_load([keys[i] for i in host_at])))
        end = len(sources)
        for i, source in enumerate(sources):
            if source == "host":
                continue
            plan = self.host.prepare_store((keys[i],))
            if plan is None:  # no room left to stage through: the prefix ends here
                end = i
                break
            slot_at[i] = plan.slot_ids[0]
            if source == "disk":
                self.disk.prepare_load((keys[i],))
        self.host.complete_load([slot_at[i] for i in host_at if i >= end])  # past the prefix: not loaded
        ready_blocks, ready_slots, ready_keys = [], [], []
        fill_blocks, fill_slots, fill_keys, fill_from = [], [], [], []
        for i in range(end):
            if sources[i] == "host":
                ready_blocks.append(block_ids[i])
                ready_slots.append(slot_at[i])
                ready_keys.append(keys[i])
            else:
                fill_blocks.append(block_ids[i])
                fill_slots.append(slot_at[i])
                fill_keys.append(keys[i])
                fill_from.append(sources[i])
        missing = list(block_ids[end:])
        job = LoadJob(next(self._job_ids), req_id, ready_blocks, ready_slots, ready_keys,
                      fill_blocks, fill_slots, fill_keys, fill_from, missing, layerwise)
        self.stats.host_hit_blocks += len(ready_blocks)
        self.stats.disk_hit_blocks += fill_from.count("disk")
        self.stats.remote_hit_blocks += fill_from.count("remote")
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
        to_disk = self.disk is not None and "disk" in self.config.store_to
        to_remote = self.remote is not None and "remote" in self.config.store_to
        disk_keys = self.disk.prepare_store(plan.keys) if to_disk else []
        remote_keys = list(plan.keys) if to_remote else []
        slot_of = dict(zip(plan.keys, plan.slot_ids))
        job = StoreJob(next(self._job_ids), req_id, [wanted[k] for k in plan.keys], plan.slot_ids, plan.keys,
                       disk_keys, [slot_of[k] for k in disk_keys], remote_keys, [slot_of[k] for k in remote_keys])
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
        if self._remote_queries is not None:
            self._remote_queries.close()
        if self.remote is not None:
            self.remote.close()

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
            held: dict[int, int] = {}
            for r in reports:
                for slot in r.held_slot_ids:
                    held[slot] = held.get(slot, 0) + 1
            for block_id, slot_id in zip(job.fill_block_ids, job.fill_slot_ids):
                if slot_id in held:  # a read abandoned after its timeout may still write it
                    self._held[slot_id] = held[slot_id]
                else:  # a filled slot becomes a host hit only if every rank filled it
                    self.host.complete_store((slot_id,), success=block_id not in failed_blocks)
            self._remember_failed(key for block_id, key, source in zip(job.fill_block_ids, job.fill_keys, job.fill_from)
                                  if source == "remote" and block_id in failed_blocks)
            disk_fills = [k for k, source in zip(job.fill_keys, job.fill_from) if source == "disk"]
            if self.disk is not None:
                self.disk.complete_load(disk_fills)
                for key in bad_keys.intersection(disk_fills):  # after the pins are gone, so discarding works
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
            failed_remote = {key for r in reports for key in r.failed_remote_keys}
            self.stats.failed_remote_writes += len(failed_remote)
            self.stats.remote_written_blocks += len(job.remote_keys) - len(failed_remote) if success else 0
            if self.disk is not None and job.disk_keys:
                failed_disk = {key for r in reports for key in r.failed_disk_keys}
                written = [k for k in job.disk_keys if k not in failed_disk and success]
                self.disk.complete_store(written, success=True)
                self.disk.complete_store([k for k in job.disk_keys if k not in written], success=False)
                self.stats.disk_written_blocks += len(written)
