"""What crosses the node server's Unix socket: small msgpack frames (``kvtier.io.messages``'
framing), never pickle. Entries' bytes never cross it: they lie in the server's arena, a memory
file whose descriptor an accepted client receives once (SCM_RIGHTS) and maps.

An entry is a list of pages of the arena (``Welcome.page_bytes`` each), in order. A client
writes one by ``Reserve`` (pages for it, held by this connection and invisible to others), a copy
into them, then ``Commit``; it reads one by ``Pin`` (the pages stay its until ``Unpin``), a copy
out of them, then ``Unpin``. Whatever a connection holds is let go when it closes: its pins, and
the entries it reserved but did not commit, which no reader ever saw.

Every request but ``Commit``, ``Unpin`` and ``Announce`` gets exactly one answer, in order; a ``Watch``
connection gets ``Held`` and ``Gone`` notices instead, unasked. A frame that does not decode, a message out of
protocol or one that breaks a bound gets ``Refused`` and a closed connection.
"""

from __future__ import annotations

import array
import os
import socket
import struct

import msgspec

from kvtier.io.messages import recv_exactly

VERSION = 2
MAX_FRAME = 8 << 20  # names and page lists of one batch; a longer length is no frame of ours
MAX_BATCH = 4096  # names per request
_LENGTH = struct.Struct("<I")


class Hello(msgspec.Struct, tag=True):
    version: int
    engine: str  # who is asking, for metrics: the engine process's id on this node
    watch: list[str] | None = None  # a ``Watch`` connection: name prefixes whose entries it hears of


class Welcome(msgspec.Struct, tag=True):
    version: int
    arena_bytes: int
    page_bytes: int  # the arena's memory file comes with this message
    # The arena lies on huge pages: a client maps all of it at once, a page-table entry per 2 MiB,
    # rather than page by page on its first reads (an engine's first hit after a start).
    huge: bool = False


class Exists(msgspec.Struct, tag=True):
    names: list[str]


class Found(msgspec.Struct, tag=True):
    found: list[bool]


class Reserve(msgspec.Struct, tag=True):
    names: list[str]
    sizes: list[int]  # each entry's bytes (header and payload)


class Reserved(msgspec.Struct, tag=True):
    # Per name: its pages, to fill and then ``Commit``; [] where it is stored already (nothing to
    # write); None where it cannot be taken now (no room, or another client is writing it).
    pages: list[list[int] | None]


class Commit(msgspec.Struct, tag=True):
    names: list[str]
    ok: list[bool]  # False: the copy failed, the pages are let go unseen


class Pin(msgspec.Struct, tag=True):
    names: list[str]


class Pinned(msgspec.Struct, tag=True):
    entries: list[tuple[int, list[int]] | None]  # per name: (its bytes, its pages), or None: not held


class Unpin(msgspec.Struct, tag=True):
    names: list[str]


class Stats(msgspec.Struct, tag=True):
    pass


class StatsReply(msgspec.Struct, tag=True):
    stats: dict


class Announce(msgspec.Struct, tag=True):
    """KV events of entries this engine stored, for the server to publish once for the node: per name,
    the engine's encoded event that it is stored and the one that it is removed (``kvtier.node.events``)."""
    names: list[str]
    stored: list[bytes]
    removed: list[bytes]


class Gone(msgspec.Struct, tag=True):
    names: list[str]  # entries the node no longer holds (evicted), under a watched prefix


class Held(msgspec.Struct, tag=True):
    """Entries the node holds, under a watched prefix: first every one it held as the watcher came, in
    batches, the last one ``complete``; then each as it is stored."""
    names: list[str]
    complete: bool = False


class Refused(msgspec.Struct, tag=True):
    why: str


Message = Hello | Welcome | Exists | Found | Reserve | Reserved | Commit | Pin | Pinned | Unpin | Stats | StatsReply | \
    Announce | Gone | Held | Refused
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def send(sock: socket.socket, message) -> None:
    sock.sendall(encode(message))


class BadFrame(ValueError):
    """A frame that is no message of this protocol."""


def receive(sock: socket.socket):
    """The next message; None when the other side has gone; ``BadFrame`` for one that does not decode."""
    head = recv_exactly(sock, _LENGTH.size)
    if head is None:
        return None
    length = _LENGTH.unpack(head)[0]
    if length > MAX_FRAME:
        raise BadFrame(f"a frame of {length} bytes (at most {MAX_FRAME})")
    body = recv_exactly(sock, length)
    if body is None:
        return None
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as error:
        raise BadFrame(str(error)) from None


def entry_runs(arena_bytes: int, page_bytes: int, size: int, pages) -> list[tuple[int, int]]:
    """Where an entry's ``size`` bytes lie in an arena of ``arena_bytes``, page by page: (offset, bytes)
    each; ``BadFrame`` for pages that do not hold it (outside the arena, too few)."""
    runs, left = [], size
    for page in pages:
        start, n = page * page_bytes, min(page_bytes, left)
        if n <= 0 or page < 0 or start + n > arena_bytes:
            raise BadFrame(f"page {page} does not hold {size} bytes of an entry in this arena")
        runs.append((start, n))
        left -= n
    if left:
        raise BadFrame("an entry's pages are shorter than its bytes")
    return runs


def entry_views(memory: memoryview, page_bytes: int, size: int, pages) -> list[memoryview]:
    """An entry's bytes as they lie in the arena ``memory``, page by page (``entry_runs``)."""
    return [memory[start:start + n] for start, n in entry_runs(len(memory), page_bytes, size, pages)]


def send_welcome(sock: socket.socket, welcome: Welcome, fd: int) -> None:
    """The welcome and, with its first byte, the arena's descriptor."""
    data = encode(welcome)
    sock.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    sock.sendall(data[1:])


def receive_welcome(sock: socket.socket) -> tuple[object, int | None]:
    """The server's first answer and the descriptor it came with (None: none, it refused)."""
    first, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not first:
        return None, None
    fd = fds[0] if fds else None
    try:
        rest = recv_exactly(sock, _LENGTH.size - 1)
        if rest is None:
            return None, fd
        length = _LENGTH.unpack(first + rest)[0]
        if length > MAX_FRAME:
            raise BadFrame(f"a frame of {length} bytes")
        body = recv_exactly(sock, length)
        return (None if body is None else _decoder.decode(body)), fd
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel saw it connect."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
