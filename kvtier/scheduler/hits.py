"""Prompt tokens loaded, by the tier they came from. Torch-free, engine-free.

A load job's tokens count when every worker has reported it, less its blocks that
failed to load: the engine recomputes those, so they were no hit. A load larger than
the host pool's free slots comes in waves (``kvtier.scheduler.load_waves``); each wave counts the
blocks it loaded, with the token counts its request's plan gave.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from kvtier.common.plans import JobReport, LoadJob
from kvtier.scheduler.lookups import HOST


class LoadHits:
    def __init__(self):
        self.tokens: Counter = Counter()  # "host" and each tier's name -> prompt tokens loaded from it
        self._waves: dict[str, dict[int, int]] = {}  # request -> its waves' tokens per device block
        self._loading: dict[int, tuple[LoadJob, dict[int, int], set[int]]] = {}  # job -> tokens per block, failed

    def planned(self, job: LoadJob, tokens_of: dict[int, int] | None = None) -> None:
        """``job`` goes to the workers. ``tokens_of``: the prompt tokens each of its device blocks
        holds; None for a later wave, which takes its request's first plan's."""
        if tokens_of is None:  # a request's last wave always comes, even one that reads nothing
            tokens_of = self._waves.pop(job.req_id) if job.final else self._waves[job.req_id]
        elif not job.final:
            self._waves[job.req_id] = tokens_of
        self._loading[job.job_id] = (job, tokens_of, set())

    def reported(self, reports: Sequence[JobReport]) -> None:
        """Workers' reports, before the manager takes them: which blocks failed (a job's ranks may
        report in different steps)."""
        for report in reports:
            loading = self._loading.get(report.job_id)
            if loading is not None:
                loading[2].update(report.failed_block_ids)

    def completed(self, job_ids: Iterable[int]) -> None:
        """Jobs every worker has reported: their loaded blocks count."""
        for job_id in job_ids:
            loading = self._loading.pop(job_id, None)
            if loading is None:  # a store job
                continue
            job, tokens_of, failed = loading
            self.tokens[HOST] += sum(tokens_of[b] for b in job.ready_block_ids if b not in failed)
            for block_id, source in zip(job.fill_block_ids, job.fill_from):
                if block_id not in failed:
                    self.tokens[source] += tokens_of[block_id]

    @property
    def num_loading(self) -> int:
        return len(self._loading)
