"""The worker's handle on its I/O process: start it, send it jobs, take its answers.

A storage pool's index holds one too, with no host pool: its lookup process, asked
``check`` (existence, by name) instead of jobs.

``submit`` sends a small message and returns; the answer is read by whichever
thread comes first, this class's receiver thread or the engine's step (``pump``),
which calls the job's callback with one reason per block (None: done), and for a
read sent with ``check_in_copy`` that the store answered, its entries' checksums. If the
I/O process dies (a store client crashed), every job it held is answered as
failed at once, which is safe: a dead process writes nothing more
into the host pool. A new process is started; after ``MAX_RESTARTS`` deaths
within ``RESTART_WINDOW_S`` the tiers are switched off with one log line, and
every later job fails at once (the engine recomputes).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import mmap
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from kvtier.common.host_slots import HostSlots
from kvtier.io.messages import (Exists, FrameReader, Flush, Flushed, Found, Gone, Held, Job, Outcome, Ready, Setup,
                                receive, send)
from kvtier.tiers.base import TierSpec, unavailable

logger = logging.getLogger("kvtier.io")

MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0
START_TIMEOUT_S = 120.0
PUMP_GRACE_S = 0.002  # an answer is left this long to a stepping engine before the receiver takes it

Callback = Callable[[list], None]


class _Channel:
    """One I/O process's socket, read without blocking by whichever thread comes first."""

    def __init__(self, sock: socket.socket, process: subprocess.Popen):
        self.sock, self.process = sock, process
        self.reader = FrameReader()
        self.read_lock = threading.Lock()  # one reader at a time: frames arrive in pieces

    def read(self, blocking: bool) -> tuple[list, bool]:
        """(the messages that have arrived, whether the process has gone)."""
        if not self.read_lock.acquire(blocking):
            return [], False  # the other reader has them
        messages = []
        try:
            while True:
                try:
                    data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return messages, False
                if not data:
                    return messages, True
                messages += self.reader.feed(data)
        except (OSError, ValueError):  # ValueError: a frame that does not decode; the process is broken
            return messages, True
        finally:
            self.read_lock.release()

    def close(self) -> None:
        with self.read_lock:  # never under a read: the descriptor's number could be reused
            self.sock.close()


class Check:
    """One existence check in flight. ``done()`` takes the answers that have arrived, on the
    caller's thread (no system call unless one has); ``result()`` is the store's ``Found``,
    or None where there is none (the tier is off, the process died)."""

    __slots__ = ("_io", "finished", "found")

    def __init__(self, io: "IOProcess"):
        self._io, self.finished, self.found = io, False, None

    def answered(self, answer) -> None:  # a Found, or one reason per name where the check failed
        self.found = answer if isinstance(answer, Found) else None
        self.finished = True  # after the answer: a reader that sees it done finds the answer

    def done(self) -> bool:
        if not self.finished:
            self._io.pump()
        return self.finished

    def result(self) -> Found | None:
        return self.found


class IOProcess:
    def __init__(self, memory_fd: int | None, specs: Sequence[TierSpec], rank_fingerprint: bytes,
                 slots: HostSlots | None, drain_s: float = 10.0, on_news: Callable[[Gone | Held], None] | None = None):
        self._memory_fd = memory_fd  # None (and no slots): a lookup process, with no host pool (``check`` only)
        self.role = "I/O process" if memory_fd is not None else "lookup process"
        # A page the I/O process shares with this worker, where it counts the answers it has sent:
        # the engine's step reads it (no system call, so it never gives up the GIL; doing so every
        # step starves kvtier's other threads of it) and reads the socket only when it has moved.
        self._answers_fd = os.memfd_create("kvtier-io-answers", os.MFD_CLOEXEC)
        os.ftruncate(self._answers_fd, mmap.PAGESIZE)
        self._answers_map = mmap.mmap(self._answers_fd, mmap.PAGESIZE)
        self._answers_sent = memoryview(self._answers_map).cast("Q")
        self._answers_seen = 0
        slots = slots or HostSlots(0, 0)
        self._setup = Setup([dataclasses.asdict(s) for s in specs], rank_fingerprint, slots.slot_bytes, slots.num_slots,
                            slots.head_bytes, os.getpid(), logging.getLogger("kvtier").getEffectiveLevel(), drain_s)
        self._job_ids = itertools.count()
        self._lock = threading.Lock()  # guards _callbacks, _sock and _process; sends are under it too
        self._callbacks: dict[int, tuple[int, Callback]] = {}  # job id -> (number of blocks, callback)
        self._deaths: list[float] = []
        self.num_exits = 0  # processes that died under their worker (each one's jobs failed, recomputed)
        self._closing = False
        self.disabled = False
        self.unavailable: dict[str, str] = {}  # tier name -> why its store could not be built
        self._flushed: Flushed | None = None
        self._sock: socket.socket | None = None
        self._channel: _Channel | None = None
        self._last_pump = 0.0  # when the engine's step last took answers (pump)
        self._engine_waiting = threading.Event()  # the engine's thread waits for answers: take them at once
        self._news = threading.Event()  # set each time answers are taken (``wait_until``)
        self._process: subprocess.Popen | None = None
        self._flush_done = threading.Event()
        # A lookup process's news (``Gone``, ``Held``): called with it, on whichever thread takes answers.
        self.on_news = on_news  # set before the process starts, which tells at once; news with no handler is lost
        self._start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def ready(self) -> bool:
        """A process is up and takes jobs."""
        with self._lock:
            return self._sock is not None and not self.disabled and not self._closing

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        memory_fd = -1 if self._memory_fd is None else self._memory_fd
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "kvtier.io.process", str(memory_fd), str(child.fileno()),
                 str(self._answers_fd)],
                pass_fds=tuple(fd for fd in (memory_fd, child.fileno(), self._answers_fd) if fd >= 0),
                close_fds=True, stdin=subprocess.DEVNULL)
        finally:
            child.close()
        send(parent, self._setup)
        parent.settimeout(START_TIMEOUT_S)
        try:
            ready = receive(parent)
        except OSError:
            ready = None
        parent.settimeout(None)
        if not isinstance(ready, Ready):
            self._process.kill()
            self._process.wait()
            parent.close()
            raise RuntimeError(f"kvtier: the {self.role} did not start")
        for name, why in ready.errors.items():
            logger.error("kvtier: tier %s is off in this %s: %s", name, self.role, why)
        channel = _Channel(parent, self._process)
        self._receiver = threading.Thread(target=self._receive, args=(channel,), daemon=True,
                                          name="kvtier-io-receiver")
        with self._lock:  # from here on jobs go to this process
            self.unavailable = dict(ready.errors)
            self._sock, self._channel = parent, channel
        self._receiver.start()

    def submit(self, tier: str, write: bool, keys: Sequence[bytes], slot_ids: Sequence[int],
               locations: Sequence[int], deadline: float, callback: Callback,
               checksums: Sequence[int] | None = None, check_in_copy: bool = False) -> None:
        """Run one job in the I/O process; ``callback(reasons)`` is called once, on another thread
        or, if the job cannot be sent, on this one. A write may carry its slots' checksums
        (``TierStore.write_from``). A read with ``check_in_copy`` leaves its plain entries' checksums
        to the caller: the store answers them, ``callback(reasons, checksums)`` (``Outcome``); a read
        that failed as a whole gets ``callback(reasons)``. A write whose store deleted entries to stay
        within its bound meanwhile gets ``callback(reasons, deleted=keys)``."""
        sums = None if checksums is None else list(checksums)
        self._send(tier, len(keys), callback,
                   lambda job_id: Job(job_id, tier, write, list(keys), list(slot_ids), list(locations), deadline, sums,
                                      check_in_copy))

    def check(self, tier: str, names: Sequence[str]) -> "Check":
        """Ask ``tier``'s store whether each name is stored; the answer comes later (``Check``)."""
        check = Check(self)
        self._send(tier, len(names), check.answered, lambda job_id: Exists(job_id, tier, list(names)))
        return check

    def _send(self, tier: str, count: int, callback: Callback, message: Callable[[int], object]) -> None:
        with self._lock:
            job_id = next(self._job_ids)
            if self.disabled or self._closing:
                why = unavailable("kvtier I/O is switched off")
            elif self._sock is None:
                why = unavailable(f"kvtier {self.role} restarting")
            else:
                why = self.unavailable.get(tier)
                why = None if why is None else unavailable(f"tier {tier} is off: {why}")
            if why is None:
                self._callbacks[job_id] = (count, callback)
                try:
                    send(self._sock, message(job_id))
                    return
                except OSError as error:  # the process died; the receiver answers its other jobs
                    self._callbacks.pop(job_id)
                    why = unavailable(f"kvtier {self.role} unreachable: {error}")
        callback([why] * count)

    def _receive(self, channel: _Channel) -> None:
        waiting = select.poll()
        waiting.register(channel.sock, select.POLLIN)
        while True:
            waiting.poll()  # without the GIL until an answer (or the end) arrives
            if time.monotonic() - self._last_pump < PUMP_GRACE_S:
                # The engine is stepping: its next step takes the answer (and copies it on the core
                # its busy loop holds anyway), leaving the other cores to the I/O process.
                self._engine_waiting.wait(PUMP_GRACE_S)  # at once if the engine's thread waits meanwhile
            messages, gone = channel.read(blocking=True)
            self._dispatch(messages)
            if gone:
                self._on_exit(channel)
                return

    def engine_waits(self, waiting: bool) -> None:
        """The engine's thread is waiting for answers (``True``) or stepping again (``False``): while it
        waits, the receiver thread takes them as they arrive."""
        if waiting:
            self._engine_waiting.set()
        else:
            self._engine_waiting.clear()

    def wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Block the caller (without the GIL) until ``done()``, asked again each time answers are taken,
        at most ``timeout_s``; the receiver thread takes them at once meanwhile. ``done()``'s value."""
        deadline = time.monotonic() + timeout_s
        self.engine_waits(True)
        try:
            self._news.clear()  # before each ask: answers taken after it wake the wait
            while not done() and self._news.wait(deadline - time.monotonic()):
                self._news.clear()
            return done()
        finally:
            self.engine_waits(False)

    def pump(self) -> None:
        """Take the answers that have arrived, on the caller's thread (the engine's step): while the
        engine's thread is busy, the receiver thread may wait up to a GIL switch interval for them."""
        self._last_pump = time.monotonic()
        sent = self._answers_sent[0]
        if sent == self._answers_seen:
            return  # nothing new: no system call
        self._answers_seen = sent
        channel = self._channel
        if channel is not None:
            self._dispatch(channel.read(blocking=False)[0])  # an end of file is the receiver thread's

    def _dispatch(self, messages: list) -> None:
        for message in messages:
            if isinstance(message, (Outcome, Found)):
                with self._lock:
                    entry = self._callbacks.pop(message.job_id, None)
                if entry is None:  # already failed, its process having died meanwhile
                    continue
                if isinstance(message, Found):
                    entry[1](message)
                elif message.deleted:  # a write's, with entries its store deleted to stay within its bound
                    entry[1](message.reasons, deleted=message.deleted)
                elif message.checksums is None:
                    entry[1](message.reasons)
                else:
                    entry[1](message.reasons, message.checksums)
            elif isinstance(message, (Gone, Held)) and self.on_news is not None:
                try:
                    self.on_news(message)
                except Exception:  # the index's fault: the answers after it are still taken
                    logger.exception("kvtier: a lookup process's news could not be taken in")
            elif isinstance(message, Flushed):
                self._flushed = message
                self._flush_done.set()
        if messages:
            self._news.set()  # after the callbacks: a waiter woken by it finds what they did (``wait_until``)

    def _on_exit(self, channel: _Channel) -> None:
        channel.process.kill()  # it may only have closed the socket: make sure it writes nothing more
        code = channel.process.wait()
        with self._lock:
            orphans, self._callbacks = self._callbacks, {}
            self._sock = self._channel = None  # jobs fail at once until a new process is up
        channel.close()
        self._flush_done.set()
        why = f"kvtier {self.role} exited (code {code})"
        for blocks, callback in orphans.values():
            callback([unavailable(why)] * blocks)
        self._news.set()  # a check waited for is answered too (failed)
        if self._closing:
            return
        self.num_exits += 1
        logger.error("%s; %d jobs failed (recomputed, or a miss); starting a new one", why, len(orphans))
        while self._count_death():
            try:
                self._start()
                return
            except Exception as error:  # counts as one more death
                logger.error("kvtier: the %s could not be restarted (%s)", self.role, error)

    def _count_death(self) -> bool:
        """Record a death; False (and the tiers switched off, said once) past the limit."""
        with self._lock:
            now = time.monotonic()
            self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
            self.disabled = len(self._deaths) > MAX_RESTARTS
        if self.disabled:
            logger.error("kvtier: the %s died %d times in %.0f s; tiers below the host pool are off in this "
                         "process, blocks are recomputed", self.role, len(self._deaths), RESTART_WINDOW_S)
        return not self.disabled

    def close(self, flush_s: float) -> tuple[int, int]:
        """Let queued jobs finish for up to ``flush_s``, then stop the process. Returns
        (jobs finished meanwhile, jobs dropped); dropped jobs are answered as failed."""
        with self._lock:
            self._closing = True
            process, sock = self._process, self._sock
            queued = len(self._callbacks)
            try:
                if sock is not None:
                    send(sock, Flush(flush_s))
            except OSError:
                pass
        self._flush_done.wait(flush_s + 1.0)  # the process answers at its deadline, unless it is stuck
        with self._lock:
            dropped = len(self._callbacks)
        if process is not None:
            try:
                process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                process.kill()  # stuck in a store call: its writes land whole or not at all
        self._receiver.join(timeout=10.0)  # answers the jobs the process dropped
        os.close(self._answers_fd)
        return queued - dropped, dropped
