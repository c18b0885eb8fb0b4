"""Where a hit's time to first token goes. Torch-free, engine-free.

Each request that loads from kvtier gets a timeline, one mark per stage, and when its
first token is seen the time between marks is added to a counter per phase:

    queue      the engine received it -> kvtier was first asked for it (a free slot in the batch)
    lookup     first asked -> answered (tiers asked off the engine's thread; "ask again" rounds)
    plan       answered -> its load sent to the workers (the step's metadata; later waves)
    to_worker  sent -> a worker began it (the step that carries it reaching the worker)
    read       began -> its last tier read answered (the I/O process; 0 for host hits)
    copy       last read answered -> its last copy into the device cache ended
    report     copied -> the scheduler had every worker's report (reports ride a step's output)
    resume     reported -> the engine scheduled the rest of its prompt
    forward    scheduled -> its first token (the forward over what was not loaded)

An ideal cache, one that held the prefix in the device, pays ``queue`` and ``forward``: the
other phases are what a hit from kvtier adds. Worker marks are ``time.monotonic()`` (one clock
for every process of a host); ``queue`` is measured on the wall clock that stamps a request's
arrival. A mark a path does not set (a load that reads nothing) is the previous one: its phase
is 0. A hit copied within the step of its forward (``LoadJob.in_step``) waits for no report and
no resumption: both are 0. Requests whose first token never comes (aborted, preempted before
it) count nothing, and every timeline ends with its request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("queue", "lookup", "plan", "to_worker", "read", "copy", "report", "resume", "forward")


@dataclass
class _Timeline:
    arrival: float  # wall clock
    asked_wall: float
    marks: dict[str, float] = field(default_factory=dict)  # phase -> when it ended (monotonic)
    rounds: int = 0  # lookups asked again (after "ask again", or vLLM could not allocate its blocks)
    jobs: set[int] = field(default_factory=set)  # load jobs not yet reported by every worker
    began: float = float("inf")  # the first any worker began one of its jobs
    filled: float = 0.0  # the last any worker's reads were answered
    copied: float = 0.0  # the last any worker's copies ended
    in_step: bool = False  # loaded within the step of its forward: no report or resume waited for
    ended: bool = False  # it ended with its first token before its in-step copy's report was told


class HitTimes:
    def __init__(self, clock=time.monotonic, wall=time.time):
        self._clock, self._wall = clock, wall
        self._timelines: dict[str, _Timeline] = {}
        self._job_owner: dict[int, str] = {}
        self.seconds = {phase: 0.0 for phase in PHASES}  # summed over the requests counted
        self.num_requests = 0
        self.num_rounds = 0  # "ask again" answers of the requests counted
        # Of those, the hits copied within the step of their forward (``LoadJob.in_step``), apart: the
        # rest loaded beside the steps, through a tier read or past in_step_load_bytes.
        self.in_step_seconds = {phase: 0.0 for phase in PHASES}
        self.num_in_step = 0

    def asked(self, req_id: str, arrival_wall: float) -> None:
        """kvtier is asked for a request's hits: again after an "ask again" answer (a round), or anew."""
        timeline = self._timelines.get(req_id)
        if timeline is None or "plan" in timeline.marks:  # new, or asked again after a preemption
            self._drop(req_id)
            self._timelines[req_id] = _Timeline(arrival_wall, self._wall(), {"queue": self._clock()})
        else:
            timeline.rounds += 1

    def answered(self, req_id: str, loads: bool) -> None:
        """The lookup answered; ``loads``: with a hit to load (else the request is not followed)."""
        timeline = self._timelines.get(req_id)
        if timeline is None:
            return
        if not loads:
            self._drop(req_id)
        else:
            timeline.marks["lookup"] = self._clock()

    def sent(self, req_id: str, job_id: int, in_step: bool = False) -> None:
        """One of its load jobs goes to the workers (the first marks the plan's end); ``in_step``: it is
        copied within the step that computes the rest of the prompt."""
        timeline = self._timelines.get(req_id)
        if timeline is None or "lookup" not in timeline.marks:
            return
        timeline.marks.setdefault("plan", self._clock())
        timeline.in_step = in_step
        timeline.jobs.add(job_id)
        self._job_owner[job_id] = req_id

    def reported(self, reports) -> None:
        """Workers' reports (``JobReport``): a load's marks (0: not set)."""
        for report in reports:
            timeline = self._timelines.get(self._job_owner.get(report.job_id, "")) if report.is_load else None
            if timeline is None:
                continue
            if report.began_at:
                timeline.began = min(timeline.began, report.began_at)
            timeline.filled = max(timeline.filled, report.filled_at)
            timeline.copied = max(timeline.copied, report.finished_at)

    def completed(self, job_ids) -> None:
        """Jobs every worker has reported: after a request's last, its load is over."""
        for job_id in job_ids:
            req_id = self._job_owner.pop(job_id, None)
            timeline = self._timelines.get(req_id) if req_id is not None else None
            if timeline is None:
                continue
            timeline.jobs.discard(job_id)
            if not timeline.jobs:
                marks = timeline.marks
                if timeline.began != float("inf"):
                    marks["to_worker"] = timeline.began
                marks["read"], marks["copy"] = timeline.filled, timeline.copied
                # Loaded within its step, its forward ran right after the copy: nothing waited for the report.
                marks["report"] = timeline.copied if timeline.in_step else self._clock()
                if timeline.in_step:
                    marks["resume"] = timeline.copied
                if timeline.ended:
                    self.first_token(req_id)

    def scheduled(self, req_id: str) -> None:
        """The engine schedules the request's tokens this step."""
        timeline = self._timelines.get(req_id)
        if timeline is not None and "report" in timeline.marks:
            timeline.marks.setdefault("resume", self._clock())

    def first_token(self, req_id: str) -> None:
        """Its first output token exists: its phases count."""
        timeline = self._timelines.pop(req_id, None)
        if timeline is None:
            return
        marks = timeline.marks
        if "report" not in marks:  # a load in flight still (it was preempted and resumed): no account
            return self._forget_jobs(timeline)
        marks["forward"] = self._clock()
        spent = {"queue": max(0.0, timeline.asked_wall - timeline.arrival)}
        last = marks["queue"]
        for phase in PHASES[1:]:  # each phase ends at its mark; one not set ends where the last did
            end = max(last, marks.get(phase, last))
            spent[phase] = end - last
            last = end
        for phase, seconds in spent.items():
            self.seconds[phase] += seconds
            if timeline.in_step:
                self.in_step_seconds[phase] += seconds
        self.num_requests += 1
        self.num_in_step += timeline.in_step
        self.num_rounds += timeline.rounds

    def first_tokens(self, has_token) -> None:
        """Requests whose load is over and for which ``has_token(req_id)`` now says a first output
        token exists: their phases count."""
        for req_id in [r for r, t in self._timelines.items() if "resume" in t.marks]:
            if has_token(req_id):
                self.first_token(req_id)

    def forget(self, req_id: str) -> None:
        self._drop(req_id)

    def finished(self, req_id: str, has_token: bool) -> None:
        """The request ended: with a first token (it may end in that token's step), its phases count."""
        timeline = self._timelines.get(req_id)
        if has_token and timeline is not None and timeline.in_step and timeline.jobs:
            # Its one step copied, computed and ended it; the copy's report rides that step's output,
            # which vLLM tells after it ended the request: its phases count with the report.
            timeline.ended = True
            return
        if has_token:
            self.first_token(req_id)
        self._drop(req_id)

    def _drop(self, req_id: str) -> None:
        timeline = self._timelines.pop(req_id, None)
        if timeline is not None:
            self._forget_jobs(timeline)

    def _forget_jobs(self, timeline: _Timeline) -> None:
        for job_id in timeline.jobs:
            self._job_owner.pop(job_id, None)

    @property
    def num_followed(self) -> int:
        """Requests followed now (0 when none is in flight: nothing is kept after its request)."""
        return len(self._timelines) + len(self._job_owner)
