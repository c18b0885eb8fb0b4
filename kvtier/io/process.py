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
store, so that no thread of the scheduler's process waits for the GIL to ask.

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
import itertools
import logging
import mmap
import os
import queue
import signal
import socket
import sys
import threading
import time

from kvtier.host_slots import HostSlots
from kvtier.io.messages import Exists, Flush, Flushed, Found, Job, Outcome, Ready, Setup, receive, send
from kvtier.io.pages import ask_for_huge_pages
from kvtier.tiers.base import TierSpec, unavailable
from kvtier.tiers.registry import make_store

logger = logging.getLogger("kvtier.io")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14


def _map_for_writing(fd: int, num_bytes: int) -> mmap.mmap:
    """The host pool, every page mapped writable now, so that a store read writes into the pool at the
    speed of memory. A page of a shared mapping is otherwise mapped on its first touch, and mapped
    read-only where that touch is a read (as MAP_POPULATE's are): its first write faults again. Either
    fault costs a fresh process one per 4 KiB of each slot it first loads into: plain reads of 15 MiB
    of page-cached entries into slots mapped by MAP_POPULATE took 3.0 ms here, 2.2 ms once mapped so."""
    mapping = mmap.mmap(fd, num_bytes, mmap.MAP_SHARED)
    ask_for_huge_pages(mapping)  # the worker's pages are huge where it got them: map them so here too
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)  # writes nothing: maps the pages the worker already made
        return mapping
    except OSError:  # an older kernel: at least every page mapped, read-only
        mapping.close()
        mapping = mmap.mmap(fd, num_bytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        ask_for_huge_pages(mapping)  # mapped small by MAP_POPULATE already: khugepaged may remap them huge
        return mapping


class _Lanes:
    """One tier's threads, which take reads before writes: a read has a request waiting for it (its
    time to first token), a write-through nobody, so a load never queues behind the writes already
    there (traced in vLLM: a Mooncake load sent just after a prompt's 15 MiB of write-throughs started
    30 ms later, when all of them were done). Jobs of one kind run in the order they came."""

    READ, WRITE = 0, 1

    def __init__(self, name: str, num_threads: int):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        for i in range(num_threads):
            threading.Thread(target=self._serve, name=f"io-{name}-{i}", daemon=True).start()

    def submit(self, priority: int, function, argument) -> None:
        self._queue.put((priority, next(self._order), function, argument))

    def _serve(self) -> None:
        while True:
            _, _, function, argument = self._queue.get()
            try:
                function(argument)  # answers its job whatever the store does
            except Exception:  # a bug here must not stop the thread: the tier would stop with it
                logger.exception("kvtier: I/O job failed")


class _Server:
    def __init__(self, sock: socket.socket, memory_fd: int, setup: Setup, answers_fd: int):
        self.sock = sock
        self._send_lock = threading.Lock()
        self._answers_map = mmap.mmap(answers_fd, mmap.PAGESIZE)
        self._answers_sent = memoryview(self._answers_map).cast("Q")  # read by the worker's engine step
        host = heads = None  # a lookup process (no memory file) only answers existence checks
        if memory_fd >= 0:
            slots = HostSlots(setup.num_slots, setup.slot_bytes, setup.head_bytes)
            self._mapping = _map_for_writing(memory_fd, slots.num_bytes)
            host, heads = slots.views(self._mapping)
        self.stores, self.threads, errors = {}, {}, {}
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
            # Threads per tier: a slow storage pool never queues a disk read behind it.
            self.threads[spec.name] = _Lanes(spec.name, max(2, spec.threads))
        self._in_flight = 0
        self._idle = threading.Condition()
        send(self.sock, Ready(errors))
        for store in self.stores.values():  # after Ready: a pool that is slow to answer delays no start-up
            threading.Thread(target=store.connect, daemon=True, name="kvtier-io-connect").start()

    def _answer(self, message) -> None:
        try:
            with self._send_lock:
                send(self.sock, message)
                self._answers_sent[0] += 1  # after the send: a worker that sees the count finds the bytes
        except OSError:  # the worker is gone: the job's work is done all the same
            pass

    def _run(self, job: Job) -> None:
        store = self.stores[job.tier]
        sums = [None] * len(job.keys) if job.check_in_copy and not job.write else None
        try:
            if job.write:
                reasons = store.write_from(job.keys, job.slot_ids, job.locations, job.deadline, job.checksums)
            else:
                reasons = store.read_into(job.keys, job.slot_ids, job.locations, job.deadline, sums)
        except Exception as error:  # every job gets an answer, whatever the store raises
            reasons, sums = [f"{type(error).__name__}: {error}"] * len(job.keys), None
        self._answer(Outcome(job.job_id, list(reasons), sums))
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def _check(self, check: Exists) -> None:
        store = self.stores[check.tier]
        try:
            found = store.exists(check.names)
        except Exception:  # no answer is a miss for the index, never a crash here
            found = None
        self._answer(Found(check.job_id, found, store.num_down))

    def serve(self, drain_s: float) -> None:
        while True:
            try:
                message = receive(self.sock)
            except OSError:
                message = None
            if message is None:  # the worker is gone: finish what is held, take nothing new
                self.drain(drain_s)
                return
            if isinstance(message, Job):
                if message.tier not in self.stores:
                    self._answer(Outcome(message.job_id, [unavailable(f"tier {message.tier} is off")] * len(message.keys)))
                    continue
                with self._idle:
                    self._in_flight += 1
                lane = _Lanes.WRITE if message.write else _Lanes.READ
                self.threads[message.tier].submit(lane, self._run, message)
            elif isinstance(message, Exists):
                if message.tier not in self.stores:
                    self._answer(Found(message.job_id, None, 0))
                    continue
                self.threads[message.tier].submit(_Lanes.READ, self._check, message)
            elif isinstance(message, Flush):
                queued, dropped = self.drain(message.timeout_s)
                self._answer(Flushed(queued - dropped, dropped))
                return

    def drain(self, timeout_s: float) -> tuple[int, int]:
        """Wait up to ``timeout_s`` for the jobs in hand; (jobs then, jobs left)."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            queued = self._in_flight
            while self._in_flight and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            return queued, self._in_flight


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
    server.serve(setup.drain_s)
    sys.stdout.flush()
    os._exit(0)  # store threads still blocked in a call past the deadline are dropped, not joined


if __name__ == "__main__":
    main(sys.argv[1:])
