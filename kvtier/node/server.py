"""``kvtier serve node``: one host pool and one local disk for every engine on a machine.

The server owns the arena (a memory file of ``host_bytes``, cut into pages, ``kvtier.node.arena``)
and the node's disk (``kvtier.node.disk``), and listens on a Unix socket created readable and
writable by its owner only. A client is accepted only if the kernel says it runs as the server's
uid (``SO_PEERCRED``); only then does it receive the arena's descriptor (SCM_RIGHTS), which it
maps. Bytes never cross the socket: clients copy into and out of the pages they reserved or
pinned (``kvtier.node.protocol``).

Each connection is served by a thread of its own, which answers it in order and sends to it alone:
a client that stops reading stalls nobody but itself. The index is behind one lock held for
dictionary work only; no copy, file read or send is done under it. A ``Watch`` connection's
notices go through a bounded queue and a sender thread of its own: the server never waits on an
engine, and one whose queue fills is dropped. A committed entry is written through to the disk
by the server's own writers (pinned meanwhile); a read of an entry that left memory but is on
disk reads it back into pages first.

When a connection closes (the engine exited, crashed, or was killed), everything it held is let
go: its pins, and the entries it reserved and never committed, which nobody ever saw.

With ``events_endpoint``, the server publishes the KV events of what it holds, once for the node
(``kvtier.node.events``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import stat
import threading
from typing import Callable

from kvtier.io.pages import HUGE_PAGE, make_huge, map_shared
from kvtier.node import protocol as p
from kvtier.node.arena import Arena, Holder
from kvtier.node.disk import NodeDisk
from kvtier.node.events import NodeEvents
from kvtier.node.metrics import prometheus, serve_metrics

logger = logging.getLogger("kvtier.node")

HELLO_TIMEOUT_S = 5.0  # a client that connects and says nothing holds a thread no longer
SEND_TIMEOUT_S = 10.0  # an answer its client does not take within this closes that connection alone
WATCH_QUEUE = 1024  # notices waiting for a watcher that does not read; past them it is dropped
DISK_QUEUE = 4096  # write-throughs waiting for the disk; past them a new entry stays in memory only
MAX_NAME = 512


def listen(path: str) -> socket.socket:
    """The server's socket at ``path``, created owner-only; one left by a server that died is replaced."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(path) == 0:
                raise RuntimeError(f"a node server already listens on {path}")
        os.unlink(path)  # left by a server that died
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # created 0600: no moment at which another user could connect
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(128)
    return listener


class _Watcher:
    def __init__(self, sock: socket.socket, prefixes: list[str]):
        self.sock, self.prefixes = sock, tuple(prefixes)
        self.queue: queue.Queue = queue.Queue(WATCH_QUEUE)

    def start(self, held: Callable[[], list[str]]) -> None:
        threading.Thread(target=self._send_all, args=(held,), daemon=True, name="kvtier-node-watch").start()

    def tell(self, notice: type, names: list[str]) -> bool:
        mine = [name for name in names if name.startswith(self.prefixes)]
        if not mine:
            return True
        try:
            self.queue.put_nowait(notice(mine))
            return True
        except queue.Full:
            return False

    def _send_all(self, held: Callable[[], list[str]]) -> None:
        # What the node holds is taken once the watcher is registered (``start``): a change after it is
        # told after it; one between the registration and it is in both, told twice, to the same effect.
        try:
            mine = [name for name in held() if name.startswith(self.prefixes)]
            for start in range(0, len(mine), p.MAX_BATCH):
                p.send(self.sock, p.Held(mine[start:start + p.MAX_BATCH]))
            p.send(self.sock, p.Held([], complete=True))
        except OSError:
            return
        while True:
            message = self.queue.get()
            if message is None:
                return
            try:
                p.send(self.sock, message)
            except OSError:
                return


class _Watchers:
    """The connections that listen for what the node holds and drops (``Watch``), each through its own
    queue and sender. ``held``: the names the node holds now."""

    def __init__(self, held: Callable[[], list[str]]):
        self._lock = threading.Lock()
        self._all: set[_Watcher] = set()
        self._held = held

    def __len__(self) -> int:
        return len(self._all)

    def serve(self, sock: socket.socket, prefixes: list[str]) -> None:
        """Until the watcher goes: it only listens, and anything it says is ignored."""
        watcher = _Watcher(sock, [str(x) for x in prefixes])
        with self._lock:
            self._all.add(watcher)
        watcher.start(self._held)
        try:
            sock.settimeout(None)
            while p.receive(sock) is not None:
                pass
        except (OSError, p.BadFrame):
            pass
        finally:
            with self._lock:
                self._all.discard(watcher)
            watcher.queue.put(None)

    def tell(self, notice: type, names: list[str]) -> None:
        """``notice``: ``p.Held`` or ``p.Gone``, told to each watcher of a prefix of some of ``names``."""
        if not names:
            return
        with self._lock:
            watchers = list(self._all)
        for watcher in watchers:
            if not watcher.tell(notice, names):  # it does not read its notices: dropped, never waited for
                watcher.sock.close()


def _map_arena(fd: int, num_bytes: int) -> tuple[memoryview, bool]:
    """The arena, mapped, and whether all of it lies on huge pages: where the kernel gives them, taken
    now (as an engine's own host pool is), so that each client maps it at once with one entry per
    2 MiB (``Welcome.huge``)."""
    arena = map_shared(fd, num_bytes)
    return memoryview(arena).cast("B"), make_huge(arena) >= num_bytes // HUGE_PAGE * HUGE_PAGE > 0


class NodeServer:
    def __init__(self, socket_path: str, host_bytes: int, page_bytes: int = 64 << 10, disk_dir: str | None = None,
                 disk_bytes: int = 16 << 30, disk_threads: int = 2, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", events_endpoint: str | None = None, **event_options):
        if page_bytes <= 0 or page_bytes % 64:
            raise ValueError(f"page_bytes must be a positive multiple of 64, got {page_bytes}")
        num_pages = host_bytes // page_bytes
        if num_pages <= 0:
            raise ValueError(f"host_bytes ({host_bytes}) is smaller than one page ({page_bytes})")
        self.socket_path = os.path.abspath(socket_path)
        self.arena_bytes = num_pages * page_bytes
        self.fd = os.memfd_create("kvtier-node-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.arena_bytes)
        self.memory, self.huge = _map_arena(self.fd, self.arena_bytes)
        self.arena = Arena(num_pages, page_bytes)
        self.lock = threading.Lock()  # the index, the watchers, the counters
        self.disk = NodeDisk(disk_dir, disk_bytes) if disk_dir else None
        self._writer = _WriteThrough(self, disk_threads) if self.disk else None
        self.watchers = _Watchers(self._held)
        self._connections: dict[int, Holder] = {}  # socket fd -> holder, the engines connected now
        self.counters = {"connections": 0, "refused_uid": 0, "refused_protocol": 0, "disk_reads": 0,
                         "disk_skipped": 0, "released_holds": 0}
        self._uid = os.geteuid()
        journal = (os.path.join(disk_dir, "events.journal"), self.disk.names()) if self.disk else None
        self.events = NodeEvents(events_endpoint, self.lock, self._holds, journal, **event_options) \
            if events_endpoint else None
        self._listener = listen(self.socket_path)
        self._closing = False
        self.metrics = serve_metrics(metrics_port, lambda: prometheus(self.stats()), metrics_host) \
            if metrics_port is not None else None

    # --- the socket --------------------------------------------------------------
    def serve_forever(self) -> None:
        logger.info("kvtier node server on %s: %d MiB host pool in %d pages of %d KiB (%s), disk %s",
                    self.socket_path, self.arena_bytes >> 20, self.arena.num_pages, self.arena.page_bytes >> 10,
                    "on huge pages" if self.huge else "on 4 KiB pages: each client maps them as it first reads them",
                    f"{self.disk.root} ({self.disk.num_entries} entries)" if self.disk else "none")
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                break
            threading.Thread(target=self._serve_connection, args=(sock,), daemon=True,
                             name="kvtier-node-conn").start()

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        if self.metrics is not None:
            self.metrics.shutdown()
        if self.events is not None:
            self.events.close()

    # --- one connection ------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket) -> None:
        holder = None
        try:
            if p.peer_uid(sock) != self._uid:
                self._refuse(sock, "this node server serves its own user only", "refused_uid")
                return
            sock.settimeout(HELLO_TIMEOUT_S)
            hello = p.receive(sock)
            if not isinstance(hello, p.Hello) or hello.version != p.VERSION:
                self._refuse(sock, f"expected Hello of protocol version {p.VERSION}")
                return
            sock.settimeout(SEND_TIMEOUT_S)  # receives block as long as the client is quiet: see _next
            p.send_welcome(sock, p.Welcome(p.VERSION, self.arena_bytes, self.arena.page_bytes, self.huge), self.fd)
            if hello.watch is not None:
                self.watchers.serve(sock, hello.watch)
                return
            holder = Holder(str(hello.engine)[:64])
            with self.lock:
                self.counters["connections"] += 1
                self._connections[sock.fileno()] = holder
            while True:
                message = self._next(sock)
                if message is None:
                    return
                answer = self._answer(holder, message)
                if isinstance(answer, p.Refused):
                    self._refuse(sock, answer.why)
                    return
                if answer is not None:
                    p.send(sock, answer)
        except p.BadFrame as error:
            self._refuse(sock, f"a frame that is not of this protocol: {error}")
        except OSError:  # the client went away, or did not take its answer in time
            pass
        except Exception:  # a fault of the server's own: this connection ends, the server goes on
            logger.exception("kvtier node server: a connection failed")
        finally:
            if holder is not None:
                with self.lock:
                    self._connections.pop(sock.fileno(), None)
                    self.counters["released_holds"] += self.arena.release(holder)
                    evicted = self.arena.take_evicted()
                    if all(other.engine != holder.engine for other in self._connections.values()):
                        self.arena.depart(holder.engine)
                self.gone(evicted)
            sock.close()

    def _next(self, sock: socket.socket):
        """The client's next message, however long it stays quiet (an idle engine is no fault)."""
        sock.settimeout(None)
        try:
            return p.receive(sock)
        finally:
            sock.settimeout(SEND_TIMEOUT_S)

    def _refuse(self, sock: socket.socket, why: str, counter: str = "refused_protocol") -> None:
        """Say why, then the caller closes the connection."""
        with self.lock:
            self.counters[counter] += 1
        try:
            sock.settimeout(1.0)
            p.send(sock, p.Refused(why))
        except OSError:
            pass

    def _answer(self, holder: Holder, message):
        names = getattr(message, "names", None)
        if names is not None and (len(names) > p.MAX_BATCH or any(len(n) > MAX_NAME for n in names)):
            return p.Refused(f"a batch of at most {p.MAX_BATCH} names of at most {MAX_NAME} characters")
        if isinstance(message, p.Exists):
            with self.lock:
                return p.Found([self._holds(n) for n in names])
        if isinstance(message, p.Reserve):
            if len(message.sizes) != len(names) or any(s <= 0 for s in message.sizes):
                return p.Refused("Reserve: one positive size per name")
            return p.Reserved(self._reserve(holder, names, message.sizes))
        if isinstance(message, p.Commit):
            if len(message.ok) != len(names):
                return p.Refused("Commit: one flag per name")
            self._commit(holder, names, message.ok)
            return None
        if isinstance(message, p.Pin):
            return p.Pinned(self._pin(holder, names))
        if isinstance(message, p.Unpin):
            with self.lock:
                self.arena.unpin(holder, names)
            return None
        if isinstance(message, p.Stats):
            return p.StatsReply(self.stats())
        if isinstance(message, p.Announce):
            if not len(message.stored) == len(message.removed) == len(names):
                return p.Refused("Announce: one stored and one removed event per name")
            if self.events is not None:
                told = self.events.well_formed(names, message.stored, message.removed)
                with self.lock:  # held, and announced, in one hold: a removal is never told before its storage
                    self.events.announce(told)
            return None
        return p.Refused(f"{type(message).__name__} is not a request of this protocol")

    def _reserve(self, holder: Holder, names: list[str], sizes: list[int]) -> list:
        with self.lock:
            answer = [[] if self.disk is not None and self.disk.has(name) and not self.arena.holds(name)
                      else None for name in names]
            todo = [i for i, a in enumerate(answer) if a is None]
            pages = self.arena.reserve(holder, [names[i] for i in todo],
                                       [sizes[i] if sizes[i] <= self.arena_bytes else 1 << 62 for i in todo])
            for i, got in zip(todo, pages):
                answer[i] = got
            evicted = self.arena.take_evicted()
        self.gone(evicted)
        return answer

    def _commit(self, holder: Holder, names: list[str], ok: list[bool]) -> None:
        with self.lock:
            ready = self.arena.commit(holder, names, ok)
            if self._writer is not None:
                self._writer.add(ready)
            self.watchers.tell(p.Held, ready)  # under the lock: in the order of the index's changes

    def _pin(self, holder: Holder, names: list[str]) -> list:
        with self.lock:
            answer = self.arena.pin(holder, names)
            on_disk = [i for i, a in enumerate(answer) if a is None and self.disk is not None and self.disk.has(names[i])]
        for i in on_disk:  # read back from the node's disk into pages of its own, then pinned
            answer[i] = self._read_back(holder, names[i])
        return answer

    def _read_back(self, holder: Holder, name: str):
        size = self.disk.size(name)
        if size is None:
            return None
        with self.lock:
            (pages,) = self.arena.reserve(holder, [name], [size])
            evicted = self.arena.take_evicted()
            if pages == []:  # read back by another connection meanwhile
                return self.arena.pin(holder, [name])[0]
        self.gone(evicted)
        if pages is None:
            return None
        ok = self.disk.read_into(name, p.entry_views(self.memory, self.arena.page_bytes, size, pages))
        with self.lock:
            self.arena.commit(holder, [name], [ok])
            if not ok:
                return None
            self.counters["disk_reads"] += 1  # counted as a disk read, not as a hit in memory
            return self.arena.pin(holder, [name], count=False)[0]

    def _holds(self, name: str) -> bool:
        return self.arena.holds(name) or (self.disk is not None and self.disk.has(name))

    def gone(self, names: list[str]) -> None:
        """Names that left memory, or the disk: gone for the node unless it still holds them."""
        if not names:
            return
        with self.lock:  # one stored again meanwhile is not gone: its announcement and its Held stand
            names = [n for n in names if not self._holds(n)]
            if self.events is not None:
                self.events.gone(names)
            self.watchers.tell(p.Gone, names)

    def _held(self) -> list[str]:
        """Every name the node holds, in memory or on its disk."""
        with self.lock:
            return list(dict.fromkeys(self.arena.ready_names() + (self.disk.names() if self.disk is not None else [])))

    # --- what it says about itself -------------------------------------------------
    def stats(self) -> dict:
        with self.lock:
            stats = self.arena.stats()
            stats.update(self.counters, engines=_engines(self._connections.values()), watchers=len(self.watchers),
                         socket=self.socket_path, arena_bytes=self.arena_bytes)
            if self.events is not None:
                stats["events"] = self.events.stats()
            if self.disk is not None:
                stats["on_disk"] = self.disk.stats()
        return stats


class _WriteThrough:
    """The node's disk writers: each new entry, pinned meanwhile, written to the disk by threads of their own."""

    def __init__(self, server: NodeServer, num_threads: int):
        self.server, self.holder = server, Holder("node-disk")
        self.jobs: queue.Queue = queue.Queue(DISK_QUEUE)
        for i in range(num_threads):
            threading.Thread(target=self._run, daemon=True, name=f"kvtier-node-disk-{i}").start()

    def add(self, ready: list[str]) -> None:
        """Under the server's lock: queue the new entries for the disk."""
        server = self.server
        for name in ready:
            if server.disk.has(name):
                continue
            server.arena.pin(self.holder, [name], count=False)
            try:
                self.jobs.put_nowait(name)
            except queue.Full:  # the disk is behind: this entry stays in memory only
                server.arena.unpin(self.holder, [name])
                server.counters["disk_skipped"] += 1

    def _run(self) -> None:
        server = self.server
        while True:
            name = self.jobs.get()
            with server.lock:
                size, pages = server.arena.pages_of(name)  # pinned by the disk holder: still there
            views = p.entry_views(server.memory, server.arena.page_bytes, size, pages)
            _, deleted = server.disk.write(name, views)
            with server.lock:
                server.arena.unpin(self.holder, [name])
            server.gone(deleted)


def _engines(holders) -> dict:
    """Per engine (its connections together): connections, pins and entries being written."""
    engines: dict = {}
    for holder in holders:
        mine = engines.setdefault(holder.engine, {"connections": 0, "pins": 0, "writing": 0})
        mine["connections"] += 1
        mine["pins"] += sum(holder.pins.values())
        mine["writing"] += len(holder.writing)
    return engines


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt


def serve(socket_path: str, host_bytes: int, **options) -> None:
    """Run the node server in the foreground until SIGTERM or SIGINT (for systemd, a container)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s kvtier-node %(message)s")
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server = NodeServer(socket_path, host_bytes, **options)  # ``NodeServer``'s keywords
    print(f"node_socket: {server.socket_path}", flush=True)
    if server.events is not None:
        print(f"kv_events: {server.events.endpoint}", flush=True)
        if server.events.replay_endpoint is not None:
            print(f"kv_events_replay: {server.events.replay_endpoint}", flush=True)
    if server.metrics is not None:
        print(f"metrics: http://127.0.0.1:{server.metrics.server_address[1]}/metrics", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
