"""The node tier: the host pool and disk that ``kvtier serve node`` keeps for every engine on a machine.

``node:///run/kvtier/node.sock`` (or the ``node_socket`` key, which stands for it). It is a storage
pool (``kvtier.tiers.pool``) whose server is on this node: reads and writes go through the I/O process,
behind the pool's breaker (a server that is down or slow is a miss, recomputed, and is connected to
again after ``remote_retry_s``). The server tells the index's lookup process what it holds of the
engine's namespace and what it evicts, as it happens (``watch_gone``): lookups are answered from that
at once, and go through the lookup process as existence checks only while it is not in step.
Bytes move by memory copies between this worker's host slots and the server's arena, which the client
maps from the descriptor the server sends it (``kvtier.node.protocol``): a read pins the entry's pages
for the copy, a write reserves pages, copies, then commits, so no reader ever sees half an entry.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import socket
import threading
import time
from typing import Sequence
from urllib.parse import unquote, urlparse

import numpy as np

from kvtier._native import copy_runs
from kvtier.io.pages import map_for_writing, map_shared
from kvtier.node import protocol as p
from kvtier.tiers.base import TierKind, TierSpec
from kvtier.tiers.pool import PoolClient, PoolStore, PoolUnavailable, make_pool_index, outside_calls, pool_key

logger = logging.getLogger("kvtier.pool")

ANNOUNCE_QUEUE = 1024  # steps' events waiting for the server; past them they are dropped (a router misses them)
# A job's bytes move at memory speed, but each job costs a pin round trip to the server and an answer
# through the I/O process: a load is one job up to this size, its copy to the device after it.
JOB_BYTES = 32 << 20


def socket_path(location: str) -> str:
    return unquote(urlparse(location).path)


def validate(url: str) -> None:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"a node:// URL names a Unix socket on this machine (node:///path), not host {parsed.netloc!r}")
    if not parsed.path.startswith("/"):
        raise ValueError("a node:// URL needs the socket's absolute path: node:///run/kvtier/node.sock")
    if parsed.query:
        raise ValueError(f"a node:// URL takes no options of its own, got {parsed.query!r}")


def connect(path: str, timeout_s: float, watch: Sequence[str] | None = None, engine: str | None = None):
    """A connection to the node server, accepted: (socket, Welcome, the arena's descriptor). ``engine``:
    the engine's label in the server's metrics, by default the parent's process id (a client runs in
    the engine's I/O or lookup process)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        p.send(sock, p.Hello(p.VERSION, engine or str(os.getppid()), None if watch is None else list(watch)))
        welcome, fd = p.receive_welcome(sock)
        if not isinstance(welcome, p.Welcome) or fd is None:
            if fd is not None:
                os.close(fd)
            why = welcome.why if isinstance(welcome, p.Refused) else "no welcome"
            raise PoolUnavailable(f"the node server at {path} refused this client: {why}")
        return sock, welcome, fd
    except BaseException:
        sock.close()
        raise


class NodeClient(PoolClient):
    def __init__(self, path: str, timeout_s: float):
        self.path = path
        self.sock, welcome, fd = connect(path, timeout_s)
        try:
            # An arena on huge pages is mapped whole now, an entry per 2 MiB; one on 4 KiB pages is mapped
            # as its pages are first read (all of it now would cost each client page tables for all of it).
            self._arena = (map_for_writing if welcome.huge else map_shared)(fd, welcome.arena_bytes)
        finally:
            os.close(fd)
        self._address = ctypes.addressof(self._arena)
        self._memory = memoryview(self._arena).cast("B")
        self.arena_bytes, self.page_bytes, self.huge = welcome.arena_bytes, welcome.page_bytes, welcome.huge
        self._lock = threading.Lock()  # one exchange at a time on the socket; copies run outside it

    def _ask(self, request, answer_type):
        with self._lock:
            p.send(self.sock, request)
            answer = p.receive(self.sock)
        if not isinstance(answer, answer_type):
            raise PoolUnavailable(f"the node server answered {type(answer).__name__}")
        return answer

    def _tell(self, message) -> None:
        with self._lock:
            p.send(self.sock, message)

    def _runs(self, size: int, pages: Sequence[int]) -> list[tuple[int, int]]:
        """The entry's (address, bytes) in this client's mapping of the arena, page by page."""
        try:
            return [(self._address + offset, n) for offset, n in p.entry_runs(self.arena_bytes, self.page_bytes,
                                                                               size, pages)]
        except p.BadFrame as error:  # a server out of step: this call fails, the pool is marked down
            raise PoolUnavailable(str(error)) from None

    def exists(self, names: Sequence[str]) -> list[bool]:
        found: list[bool] = []
        for start in range(0, len(names), p.MAX_BATCH):
            found += self._ask(p.Exists(list(names[start:start + p.MAX_BATCH])), p.Found).found
        return found

    def put(self, names, headers, payloads) -> list[bool]:
        stored: list[bool] = []
        for start in range(0, len(names), p.MAX_BATCH):
            end = start + p.MAX_BATCH
            stored += self._put(names[start:end], headers[start:end], payloads[start:end])
        return stored

    def _put(self, names, headers, payloads) -> list[bool]:
        spans = _spans(headers, payloads)
        sizes = [header[1] + payload[1] for header, payload in spans]
        reserved = self._ask(p.Reserve(list(names), sizes), p.Reserved).pages
        mine = [i for i, pages in enumerate(reserved) if pages]
        ok = []
        try:
            moves = _Moves(self._arena)
            for i in mine:
                moves.add(spans[i], self._runs(sizes[i], reserved[i]))
            moves.run()
            ok = [True] * len(mine)
        finally:  # a batch whose copy failed is let go unseen (so is all of it, should this connection break)
            ok += [False] * (len(mine) - len(ok))
            self._tell(p.Commit([names[i] for i in mine], ok))
        # Held already ([]) counts as stored; None: not taken now (no room, or another engine writes it).
        return [pages is not None and (not pages or ok[mine.index(i)]) for i, pages in enumerate(reserved)]

    def get_into(self, names, headers, payloads) -> list[bool | None]:
        found: list[bool | None] = []
        for start in range(0, len(names), p.MAX_BATCH):
            end = start + p.MAX_BATCH
            found += self._get(names[start:end], headers[start:end], payloads[start:end])
        return found

    def _get(self, names, headers, payloads) -> list[bool | None]:
        spans = _spans(headers, payloads, into=True)
        entries = self._ask(p.Pin(list(names)), p.Pinned).entries
        pinned = [name for name, entry in zip(names, entries) if entry is not None]
        found: list[bool | None] = []
        try:
            moves = _Moves(self._arena)
            for (header, payload), entry in zip(spans, entries):
                if entry is None:
                    found.append(None)
                elif entry[0] != header[1] + payload[1]:
                    found.append(False)  # another size: not this layout's entry
                else:
                    moves.add(self._runs(*entry), (header, payload))
                    found.append(True)
            moves.run()
        finally:
            if pinned:
                self._tell(p.Unpin(pinned))  # after the copies: the pages are the server's to reuse again
        return found

    def stats(self) -> dict:
        return self._ask(p.Stats(), p.StatsReply).stats

    def abort(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # a call blocked in a receive fails at once
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        self._memory.release()
        self._arena = None  # unmapped with its last view


def _spans(headers, payloads, into: bool = False) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each entry's header and payload as (address, bytes): from ``Spans`` (host slots), or from each
    buffer (contiguous; ``into``: read into, so writable)."""
    header_at = getattr(headers, "addresses", None) or [_where(h, into) for h in headers]
    payload_at = getattr(payloads, "addresses", None) or [_where(b, into) for b in payloads]
    return [((h_at, memoryview(h).nbytes), (b_at, memoryview(b).nbytes))
            for h, b, h_at, b_at in zip(headers, payloads, header_at, payload_at)]


def _where(buffer, into: bool) -> int:
    """Where a contiguous buffer's bytes lie (they stay there while the caller holds it: for the call)."""
    view = memoryview(buffer)
    if into and view.readonly:
        raise ValueError("a node read needs writable buffers to read into")
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0


class _Moves:
    """A batch's copies, gathered as runs and done in one call without the GIL (``copy_runs``): the
    batch's two I/O threads then copy side by side, where a copy per buffer under the GIL would not."""

    def __init__(self, arena):
        if arena is None:
            raise PoolUnavailable("the node client is closed")
        self._arena = arena  # the copies go by address: the mapping stays until they are done, closed or not
        self.dst: list[int] = []
        self.src: list[int] = []
        self.lengths: list[int] = []

    def add(self, sources, targets) -> None:
        """Copy the concatenation of ``sources`` into that of ``targets`` (as long), each (address, bytes):
        an entry's header and payload into its pages, or its pages into a header and a payload."""
        s, offset = 0, 0
        for address, size in targets:
            done = 0
            while done < size:
                source, length = sources[s]
                n = min(size - done, length - offset)
                self.dst.append(address + done)
                self.src.append(source + offset)
                self.lengths.append(n)
                done, offset = done + n, offset + n
                if offset == length:
                    s, offset = s + 1, 0

    def run(self) -> None:
        if self.lengths:
            copy_runs.copy(*(np.array(runs, np.int64) for runs in (self.dst, self.src, self.lengths)))


def watch_gone(spec: TierSpec, prefixes, tell, held=None) -> None:
    """Hear what the node server holds and what it evicts, as it stores and evicts it (a ``Watch``
    connection), on a thread of its own: ``tell(names)`` the evicted, ``held(names, complete)`` the held
    (``Held``), and ``held(None, False)`` when what was told stands no more (a new connection, which
    tells all again, or a lost one). A lost connection is made again every ``retry_s``."""
    held = held or (lambda names, complete: None)

    def run():
        failing = False
        while True:
            sock = None
            try:
                sock, _, fd = connect(socket_path(spec.location), spec.timeout_s, list(prefixes))
                os.close(fd)  # a watcher copies nothing
                sock.settimeout(None)
                failing = False
                held(None, False)
                while (message := p.receive(sock)) is not None:
                    if isinstance(message, p.Gone):
                        tell(message.names)
                    elif isinstance(message, p.Held):
                        held(message.names, message.complete)
            except Exception as error:  # the server went away: heard again once it is back
                if not failing:
                    logger.warning("kvtier: lost the node server's notices of what it holds (%s); trying again "
                                   "every %.0f s", error, spec.retry_s)
                failing = True
            finally:
                held(None, False)
                if sock is not None:
                    sock.close()
            time.sleep(spec.retry_s)

    threading.Thread(target=run, daemon=True, name="kvtier-node-gone").start()


class Announcer:
    """The KV events of what an engine stored in the node, sent to the server, which publishes each entry's
    once for the node (``kvtier.node.events``). Sent by a thread of its own through a bounded queue: the
    scheduler hands them over and goes on. While the server is away they are dropped (it holds nothing
    of what is stored meanwhile), and it is connected to again after ``retry_s``."""

    def __init__(self, spec: TierSpec, rank_fingerprint: bytes):
        self.spec, self.fingerprint = spec, rank_fingerprint
        self._queue: queue.Queue = queue.Queue(ANNOUNCE_QUEUE)
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvtier-node-announce")
        self._thread.start()

    def __call__(self, told: list[tuple[bytes, bytes, bytes]]) -> None:
        try:
            self._queue.put_nowait(told)
        except queue.Full:
            self.num_dropped += len(told)

    def close(self, timeout_s: float = 2.0) -> None:
        """What was handed over is sent first, for at most ``timeout_s`` (an engine that stops)."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:  # behind: a daemon thread, gone with the process
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        sock, down_until = None, 0.0
        while (told := self._queue.get()) is not None:
            if time.monotonic() < down_until:
                self.num_dropped += len(told)
                continue
            try:
                if sock is None:
                    sock, _, fd = connect(socket_path(self.spec.location), self.spec.timeout_s,
                                          engine=str(os.getpid()))  # the scheduler's own process
                    os.close(fd)  # an announcer copies nothing
                for part in _batches(told):
                    p.send(sock, p.Announce([pool_key(self.fingerprint, key) for key, _, _ in part],
                                            [stored for _, stored, _ in part], [removed for _, _, removed in part]))
            except Exception:  # the server went away: these are lost with what it held
                self.num_dropped += len(told)
                if sock is not None:
                    sock.close()
                sock, down_until = None, time.monotonic() + self.spec.retry_s
        if sock is not None:
            sock.close()


def _batches(told: list, max_bytes: int = 1 << 20):
    """``told`` in Announce messages of at most ``MAX_BATCH`` names and about ``max_bytes`` of events."""
    part, size = [], 0
    for item in told:
        if part and (len(part) == p.MAX_BATCH or size + len(item[1]) + len(item[2]) > max_bytes):
            yield part
            part, size = [], 0
        part.append(item)
        size += len(item[1]) + len(item[2])
    if part:
        yield part


def _connector(spec: TierSpec):
    return lambda: NodeClient(socket_path(spec.location), spec.timeout_s)


held_from_outside, write_record, read_records, release_outside = outside_calls(_connector)


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]):
    return make_pool_index(spec, rank_fingerprints)


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> PoolStore:
    return PoolStore(spec, rank_fingerprint, slot_bytes, _connector(spec), watch=watch_gone)


def _address(spec: TierSpec) -> str:
    return f"{socket.gethostname()}:{socket_path(spec.location)}"  # one node's server, the same for its engines


KIND = TierKind("node", make_index, make_store, shared=True, job_bytes=JOB_BYTES, medium="CPU", address=_address,
                validate=validate,
                notices=lambda spec: "; its evictions are told as they happen",
                write_record=write_record, read_records=read_records, held_from_outside=held_from_outside,
                release_outside=release_outside, announcer=Announcer)
