"""The I/O process: runs a worker's tier stores with an interpreter of its own.

Started by ``IOProcess`` (``kvtier.io.client``) as ``python -m kvtier.io.process
<memory fd> <socket fd> <answers fd>``. It maps the worker's host pool from the inherited
memory file, builds one ``TierStore`` per tier from the ``Setup`` message, and then
serves jobs: each ``Job`` runs on its tier's threads, reads before writes, and is
answered by one ``Outcome``, one reason per block (and, for a read whose entries the
worker's copy checks, the checksum each one's header holds). A store with a client (a storage
pool) connects as soon as the process is up. It imports no torch and no engine.

The same program, started with no memory file (``-1``), is a storage-pool index's
lookup process: it answers ``Exists`` checks with ``Found``, through the same
store, so that no thread of the scheduler's process waits for the GIL to ask. Where
the pool's server says which entries it evicts or expires, it passes those on
(``Gone``) as they come.

A ``Flush`` (clean shutdown) lets queued jobs finish up to its timeout, answers
``Flushed`` with what was dropped, and exits. If the worker dies instead (killed,
or its engine force-stopped, as ``vllm serve`` does to its engine at SIGTERM), the
socket's end of file or a new parent process id says so: the process takes no new
job, finishes the writes it already holds (their bytes are in the host pool,
which it maps) for at most ``drain_s`` (``shutdown_flush_s``), and exits. Every
store writes an entry atomically (a file renamed into place, one storage-pool value), so
a write cut short leaves no entry, never half of one. SIGTERM and SIGINT sent to
the engine's process group are not for it: its worker decides when it stops.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import logging
import mmap
import os
import signal
import socket
import sys
import threading
import time

from kvtier.common.host_slots import HostSlots
from kvtier.io.messages import Exists, Flush, Flushed, Found, Gone, Held, Job, Outcome, Ready, Setup, receive, send
from kvtier.io.pages import map_for_writing
from kvtier.tiers.base import SharedStore, TierSpec, bad, unavailable
from kvtier.tiers.registry import make_store

logger = logging.getLogger("kvtier.io")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters


class _Lanes:
    """One tier's threads and the jobs that wait for one of them. Reads go before writes: a read has a
    request waiting for it (its time to first token), a write-through nobody, so a load never queues
    behind the writes already there (a load sent just after a prompt's write-throughs would otherwise
    start only when all of them are done). Jobs of one kind run in the
    order they came. Threads per tier: a slow storage pool never queues a disk read behind it."""

    READ, WRITE = 0, 1

    def __init__(self, server: "_Server", name: str, num_threads: int):
        self.waiting: list = []  # heap of (priority, arrival, function, argument), under the server's turn
        for i in range(num_threads):
            threading.Thread(target=server.serve_as, args=(self,), name=f"io-{name}-{i}", daemon=True).start()


class _Server:
    """Every thread both receives and runs jobs, one receiving at a time (leader and followers): a thread
    with nothing waiting in its tier's lane takes the socket while no other thread has it, and runs a job
    it receives for its own tier itself, the next idle thread taking the socket meanwhile. A job reaches
    the thread that runs it with no hand-over (a queue between a receiving thread and a tier's adds a
    thread wake-up to every job's round trip). A job
    for another tier waits in that tier's lane. While every tier's thread is busy the main thread
    receives, and only queues: a read that arrives then still goes before the writes waiting in its lane."""

    def __init__(self, sock: socket.socket, memory_fd: int, setup: Setup, answers_fd: int):
        self.sock = sock
        self._send_lock = threading.Lock()
        self._answers_map = mmap.mmap(answers_fd, mmap.PAGESIZE)
        self._answers_sent = memoryview(self._answers_map).cast("Q")  # read by the worker's engine step
        turn = threading.Lock()  # guards every lane's waiting jobs and who receives
        self._turn = threading.Condition(turn)  # tier threads wait on it
        self._main_turn = threading.Condition(turn)  # the main thread waits on it, woken only when it is to receive
        self._receiving = False  # a thread reads the socket (only one may: frames arrive whole to it alone)
        self._open = False  # messages are taken (from serve_as(None) until the end of the stream or a Flush)
        self._idle = 0  # tier threads waiting for a job or for the socket
        self._arrivals = itertools.count()
        self._in_flight = 0
        self._settled = threading.Condition()  # _in_flight changed
        host = heads = None  # a lookup process (no memory file) only answers existence checks
        if memory_fd >= 0:
            slots = HostSlots(setup.num_slots, setup.slot_bytes, setup.head_bytes)
            self._mapping = map_for_writing(memory_fd, slots.num_bytes)
            host, heads = slots.views(self._mapping)
        self.stores, self.lanes, errors = {}, {}, {}
        for fields in setup.tiers:
            spec = TierSpec(**fields)
            try:
                store = make_store(spec, setup.rank_fingerprint, setup.slot_bytes)
                if host is not None:
                    store.attach(host, heads)
            except Exception as error:  # this tier is off; the worker fails its jobs, the others carry on
                errors[spec.name] = f"{type(error).__name__}: {error}"
                continue
            self.stores[spec.name] = store
            self.lanes[spec.name] = _Lanes(self, spec.name, max(2, spec.threads))
        self._drain_s = setup.drain_s
        send(self.sock, Ready(errors))
        shared = {name: store for name, store in self.stores.items() if isinstance(store, SharedStore)}
        for store in shared.values():  # after Ready: a pool that is slow to answer delays no start-up
            threading.Thread(target=store.connect, daemon=True, name="kvtier-io-connect").start()
        if memory_fd < 0:  # a lookup process: what a pool's server drops on its own, its index hears at once
            for name, store in shared.items():
                store.watch_gone(lambda names, tier=name: self._answer(Gone(tier, names)),
                                 lambda names, complete, tier=name: self._answer(Held(tier, names, complete)))

    def _answer(self, message) -> None:
        try:
            with self._send_lock:
                send(self.sock, message)
                self._answers_sent[0] += 1  # after the send: a worker that sees the count finds the bytes
        except OSError:  # the worker is gone: the job's work is done all the same
            pass

    def _run(self, job: Job) -> None:
        store = self.stores[job.tier]
        sums = deleted = None
        try:
            if job.write:
                reasons = store.write_from(job.keys, job.slot_ids, job.locations, job.deadline, job.checksums)
                if isinstance(store, SharedStore):
                    deleted = store.take_deleted()  # this write's, or another thread's since the last answer
            else:
                outcomes = store.read_into(job.keys, job.slot_ids, job.locations, job.deadline, not job.check_in_copy)
                # An int is a plain entry's checksum, left to the worker's copy to compare (``check_in_copy``).
                reasons = [None if isinstance(o, int) else o for o in outcomes]
                if job.check_in_copy:
                    sums = [o if isinstance(o, int) else None for o in outcomes]
        except Exception as error:  # every job gets an answer, whatever the store raises
            reasons, sums = [bad(f"{type(error).__name__}: {error}")] * len(job.keys), None
        self._answer(Outcome(job.job_id, list(reasons), sums, deleted or None))
        with self._settled:
            self._in_flight -= 1
            self._settled.notify_all()

    def _check(self, check: Exists) -> None:
        store = self.stores[check.tier]
        if not isinstance(store, SharedStore):  # only a tier that others write is asked: no answer, a miss
            self._answer(Found(check.job_id, None, 0))
            return
        try:
            found = store.exists(check.names)
        except Exception:  # no answer is a miss for the index, never a crash here
            found = None
        self._answer(Found(check.job_id, found, store.num_down))

    def serve_as(self, lanes: _Lanes | None) -> None:
        """The loop of a tier's thread (``lanes``: its tier's) or of the main thread (None)."""
        while True:
            work = self._next(lanes)
            if work is None:
                continue
            function, argument = work
            try:
                function(argument)  # answers its job whatever the store does
            except Exception:  # a bug here must not stop the thread: the tier would stop with it
                logger.exception("kvtier: I/O job failed")

    def _next(self, lanes: _Lanes | None):
        """(function, argument) to run on this thread next, or None to ask again."""
        with self._turn:
            if lanes is None:  # the main thread receives only while no tier's thread waits to, so
                # that a job for a tier reaches one of its threads directly where it can
                while not self._socket_free() or self._idle:
                    self._main_turn.wait()
            else:
                self._idle += 1
                # A job waiting in this thread's lane comes before the socket: it arrived first.
                while not lanes.waiting and not self._socket_free():
                    self._turn.wait()
                self._idle -= 1
                if lanes.waiting:
                    _, _, function, argument = heapq.heappop(lanes.waiting)
                    self._wake_main()  # the last idle tier thread is busy now: the socket is the main thread's
                    return function, argument
            self._receiving = True
        try:
            message = receive(self.sock)  # without the GIL until a frame arrives
        except OSError:
            message = None
        except Exception as error:  # a frame that does not decode: the stream is broken, as if it ended
            logger.error("kvtier: a message from the worker could not be read (%s); finishing", error)
            message = None
        with self._turn:
            self._receiving = False
            work = self._route(message, lanes)
            self._turn.notify_all()  # an idle tier thread takes the socket; a job queued finds its thread
            self._wake_main()
        return work

    def _socket_free(self) -> bool:
        return self._open and not self._receiving

    def _wake_main(self) -> None:
        """Under the turn: wake the main thread if the socket is free and no tier thread waits for it."""
        if self._socket_free() and not self._idle:
            self._main_turn.notify()

    def _route(self, message, lanes: _Lanes | None):
        """Under the turn: what this thread runs for ``message`` (the job itself where its tier is this
        thread's and nothing waits in that lane: no job is then ahead of it), queuing it otherwise."""
        if message is None:  # the worker is gone: finish what is held, take nothing new
            self._open = False
            return self._end, self._drain_s
        if isinstance(message, Flush):
            self._open = False
            return self._flush, message.timeout_s
        if isinstance(message, Job):
            if message.tier not in self.stores:
                return self._answer, Outcome(message.job_id, [unavailable(f"tier {message.tier} is off")] * len(message.keys))
            with self._settled:
                self._in_flight += 1
            function, priority = self._run, (_Lanes.WRITE if message.write else _Lanes.READ)
        elif isinstance(message, Exists):
            if message.tier not in self.stores:
                return self._answer, Found(message.job_id, None, 0)
            function, priority = self._check, _Lanes.READ
        else:
            return None
        target = self.lanes[message.tier]
        if target is lanes and not target.waiting:
            return function, message
        heapq.heappush(target.waiting, (priority, next(self._arrivals), function, message))
        return None

    def serve(self) -> None:
        """Take messages until the stream ends or a Flush comes; the process then exits (``_end``, ``_flush``)."""
        with self._turn:
            self._open = True
            self._turn.notify_all()
        self.serve_as(None)

    def _end(self, drain_s: float) -> None:
        self.drain(drain_s)
        _exit()

    def _flush(self, timeout_s: float) -> None:
        queued, dropped = self.drain(timeout_s)
        self._answer(Flushed(queued - dropped, dropped))
        _exit()

    def drain(self, timeout_s: float) -> tuple[int, int]:
        """Wait up to ``timeout_s`` for the jobs in hand; (jobs then, jobs left)."""
        deadline = time.monotonic() + timeout_s
        with self._settled:
            queued = self._in_flight
            while self._in_flight and time.monotonic() < deadline:
                self._settled.wait(deadline - time.monotonic())
            return queued, self._in_flight


def _exit() -> None:
    sys.stdout.flush()
    os._exit(0)  # store threads still blocked in a call past the deadline are dropped, not joined


def _keep_large_buffers_in_the_heap() -> None:
    """Pool clients allocate a block-sized buffer per value and free it at once; by default
    glibc maps each one fresh (page faults, zeroing) and unmaps it again, which costs about
    as much as moving the bytes. These bounds keep such buffers in the heap for reuse."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest allowed value
        libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):  # not glibc: its allocator's defaults stand
        pass


def _watch_parent(parent_pid: int, server: "_Server", drain_s: float) -> None:
    """Notice the worker's death even if a process it forked still holds the socket."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    server.drain(drain_s)
    os._exit(0)


def main(argv: list[str]) -> None:
    memory_fd, socket_fd, answers_fd = int(argv[0]), int(argv[1]), int(argv[2])
    sock = socket.socket(fileno=socket_fd)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past a file-size limit a write fails (EFBIG), it does not kill
    _keep_large_buffers_in_the_heap()
    setup = receive(sock)
    if not isinstance(setup, Setup) or os.getppid() != setup.parent_pid:
        os._exit(2)  # not started by a live worker
    logging.basicConfig(level=setup.log_level, format="%(levelname)s %(asctime)s kvtier-io[%(process)d] %(message)s")
    server = _Server(sock, memory_fd, setup, answers_fd)
    os.close(answers_fd)
    if memory_fd >= 0:
        os.close(memory_fd)  # the mapping keeps the memory; the descriptor is not needed any more
    threading.Thread(target=_watch_parent, args=(setup.parent_pid, server, setup.drain_s), daemon=True).start()
    server.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
