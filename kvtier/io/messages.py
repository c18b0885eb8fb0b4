"""What crosses between a worker and its I/O process (or an index and its lookup
process): small msgpack frames, no pickle.

A frame is a 4-byte little-endian length, then one message. Slots travel as row
numbers of the shared host pool; the bytes never cross the socket.
"""

from __future__ import annotations

import socket
import struct

import msgspec

from kvtier.common.outcomes import Miss

_LENGTH = struct.Struct("<I")


class Setup(msgspec.Struct, tag=True):
    tiers: list[dict]  # TierSpec fields
    rank_fingerprint: bytes
    slot_bytes: int
    num_slots: int
    head_bytes: int  # before each slot: its entry header (``kvtier.common.host_slots``)
    parent_pid: int
    log_level: int
    drain_s: float  # orphaned (the worker died), finish the jobs already held for at most this long


class Ready(msgspec.Struct, tag=True):
    errors: dict[str, str]  # tier name -> why it could not be built


class Job(msgspec.Struct, tag=True):
    job_id: int
    tier: str
    write: bool  # True: host slots -> tier; False: tier -> host slots
    keys: list[bytes]
    slot_ids: list[int]
    locations: list[int]  # where the tier's index put each key (-1: the store finds it)
    deadline: float  # time.monotonic() of the engine's host (the same clock in every process)
    checksums: list[int] | None = None  # a write's: each slot's xxh3-64, taken as the copy filled it
    # A read's: the worker's copy to the device checks each plain entry's checksum as it reads the slot;
    # the store checks the rest of the entry and answers its checksum (``Outcome.checksums``).
    check_in_copy: bool = False


class Outcome(msgspec.Struct, tag=True):
    job_id: int
    reasons: list[Miss | None]  # per block: None done, else why not
    # A check_in_copy read's, per block: the checksum its entry's header holds, for the worker to
    # compare; None where the store checked the entry itself (a keyed one) or read none.
    checksums: list[int | None] | None = None
    # A write's: entries the store deleted meanwhile to keep within its size bound (its own
    # eviction), for the scheduler's index to hear; None: none.
    deleted: list[bytes] | None = None


class Exists(msgspec.Struct, tag=True):
    """An index's existence check, asked of its tier's store (a storage pool) by name."""
    job_id: int
    tier: str
    names: list[str]


class Found(msgspec.Struct, tag=True):
    job_id: int
    found: list[bool] | None  # per name; None: the store could not ask (down, failing, too slow)
    down: int  # times the store's client has been marked down, in all


class Gone(msgspec.Struct, tag=True):
    """A lookup process's news, asked by nobody: entries its tier's server dropped on its own
    (evicted, expired), by name, for the index to hear."""
    tier: str
    names: list[str]


class Held(msgspec.Struct, tag=True):
    """A lookup process's news: entries its tier's server holds (``kvtier.tiers.node``); ``names``
    None: what it told before stands no more."""
    tier: str
    names: list[str] | None
    complete: bool = False


class Flush(msgspec.Struct, tag=True):
    timeout_s: float


class Flushed(msgspec.Struct, tag=True):
    finished: int  # jobs that finished while flushing
    dropped: int  # jobs still queued or running at the deadline


Message = Setup | Ready | Job | Outcome | Exists | Found | Gone | Held | Flush | Flushed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def send(sock: socket.socket, message, encoder: msgspec.msgpack.Encoder = _encoder) -> None:
    body = encoder.encode(message)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class FrameReader:
    """Frames out of a byte stream read in pieces of any size (a socket read without blocking)."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        """The messages that ``data`` completes, in order; ValueError on a frame that does not decode."""
        self._buffer += data
        messages, start = [], 0
        while len(self._buffer) - start >= _LENGTH.size:
            end = start + _LENGTH.size + _LENGTH.unpack_from(self._buffer, start)[0]
            if end > len(self._buffer):
                break
            try:
                messages.append(_decoder.decode(bytes(self._buffer[start + _LENGTH.size:end])))
            except msgspec.DecodeError as error:
                raise ValueError(f"undecodable frame: {error}") from None
            start = end
        del self._buffer[:start]
        return messages


def receive(sock: socket.socket, decoder: msgspec.msgpack.Decoder = _decoder):
    """The next message, or None when the other side has gone (EOF). Another channel's frames are
    read with its own ``decoder`` (msgspec's ``DecodeError`` where one does not decode)."""
    head = recv_exactly(sock, _LENGTH.size)
    if head is None:
        return None
    body = recv_exactly(sock, _LENGTH.unpack(head)[0])
    return None if body is None else decoder.decode(body)
