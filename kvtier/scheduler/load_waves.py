"""Loads larger than the host pool's free slots, in waves through it. Torch-free, engine-free.

A load is staged through host slots, one per block read from a tier. A hit that needs
more slots than the host pool has free loads its first blocks (a wave, ``LoadJob.final``
False); once every worker has reported that wave, its slots are free again and the next
wave is planned from them, until the last, whose report ends the request's load. A wave
waits for a block that another request's wave is writing to the host pool. A wave that
fails, or one that finds no free slot for ``timeout_s``, ends the load at once: the rest
is one job of missing blocks, counted under the failure's reason (or
``no_free_host_slot``), which the engine recomputes from the first block not loaded. A
request that goes away ends its load with a job of no block.
"""

from __future__ import annotations

import time

from kvtier.common.plans import LoadJob


class LoadWaves:
    def __init__(self, manager, timeout_s: float):
        self.manager = manager  # kvtier.scheduler.manager.TierManager: plans each wave
        self.timeout_s = timeout_s
        self._later: dict[str, tuple] = {}  # request -> its next wave's keys, block ids, found, why a wave failed
        self._sent: dict[int, str] = {}  # wave job id (not the last) -> its request
        self._due: dict[str, float] = {}  # request -> since when its next wave waits for free slots
        self._dropped: set[str] = set()  # requests gone while their load was under way

    def keep(self, job: LoadJob, keys: list[bytes], block_ids: list[int], found: list[dict]) -> None:
        """``job`` is a wave: ``keys`` into ``block_ids`` follow it (``found``: what the tiers that
        ask others found)."""
        self._later[job.req_id] = (keys, block_ids, found, None)
        self._sent[job.job_id] = job.req_id

    def failed(self, req_id: str, reason: str) -> None:
        """A wave of the request failed: the engine recomputes from there, the rest is not read."""
        if req_id in self._later:
            self._later[req_id] = (*self._later[req_id][:3], reason)

    def on_completed(self, job_ids) -> None:
        """Jobs every worker has reported: a wave's request is due its next one."""
        for job_id in job_ids:
            req_id = self._sent.pop(job_id, None)
            if req_id is not None:
                self._due[req_id] = time.monotonic()

    def drop(self, req_id: str) -> None:
        """The request went away: its load ends with its next wave, which reads nothing."""
        if req_id in self._later:
            self._dropped.add(req_id)

    def due_jobs(self) -> list[LoadJob]:
        """The next waves to send now (a request's last one included)."""
        jobs, now = [], time.monotonic()
        for req_id, since in list(self._due.items()):
            give_up = "gone" if req_id in self._dropped else \
                "no_free_host_slot" if now - since > self.timeout_s else None
            job = self.plan_next(req_id, give_up)
            if job is None:  # no free slot yet: asked again next step
                continue
            del self._due[req_id]
            self._dropped.discard(req_id)
            jobs.append(job)
        return jobs

    def plan_next(self, req_id: str, give_up: str | None = None) -> LoadJob | None:
        """The request's next wave, or None while the host pool has no free slot or its first block
        is being written there. After a wave that failed, or with ``give_up`` (why: "gone", the
        request went away, or a miss reason), the last job, of the rest as missing blocks."""
        keys, block_ids, found, failed = self._later[req_id]
        reason = failed or give_up
        if reason is None and (self.manager.free_slots() <= 0 or self.manager.host.is_being_written(keys[0])):
            return None
        del self._later[req_id]
        if reason is None:
            return self.manager.plan_load(req_id, keys, block_ids, found=found)
        return self.manager.plan_missing(req_id, [] if reason == "gone" else block_ids, reason)

    @property
    def num_under_way(self) -> int:
        return len(self._later)
