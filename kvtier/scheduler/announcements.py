"""What the tiers hold, told to routers: the engine-neutral half of KV events.

The manager's holdings log says that a block became loadable from a tier or stopped
being (``kvtier.scheduler.ledger``). ``Announcements`` turns it into announcements, each
a block's stored or removed with where it is (``Place``):

- ``medium``: ``CPU`` for the host pool, and the medium each tier declares (``STORAGE``
  for the disk, a shared directory and the storage pools);
- ``locality``: ``LOCAL`` for this instance's own tiers, ``REMOTE`` for those its kind
  declares shared;
- ``ownership``: ``kvtier:<tier>``, and for a shared tier ``kvtier:<tier>:<pool>``
  (its address, no password), the same string on every instance that reads it.

A shared tier's blocks are announced but not tracked (other instances and the pool's own
eviction change them unseen): only an entry that a load found damaged or gone is told as
removed; this instance's own tiers are told both ways. Only blocks whose engine metadata
was remembered are announced (the engine adapter's: its block hashes, tokens, adapter).
The metadata is kept while a tier of this instance holds the block (for its removal),
plus the last ``max_unheld`` others. A tier that lists its entries across restarts
(``kvtier.tiers.base.ListedIndex``) keeps a journal of their metadata beside them, so that
a restart announces them.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, NamedTuple

from kvtier.tiers.base import ListedIndex


class Place(NamedTuple):
    medium: str
    locality: str  # LOCAL or REMOTE
    ownership: str


class Announcements:
    """Lives in the scheduler; one thread. ``meta_of(fields)``: a block's metadata from the fields
    a journal kept of it (None: not one of this engine's)."""

    def __init__(self, specs, max_unheld: int = 100_000, journals: "dict[str, DiskJournal] | None" = None):
        self._where = {"host": Place("CPU", "LOCAL", "kvtier:host")}
        self._shared = {spec.name for spec in specs if spec.kind.shared}  # ``specs``: the tiers' ``TierSpec``s
        for spec in specs:
            shared = spec.name in self._shared
            self._where[spec.name] = Place(spec.kind.medium, "REMOTE" if shared else "LOCAL",
                                           f"kvtier:{spec.name}:{spec.kind.address(spec)}" if shared else
                                           f"kvtier:{spec.name}")
        self._meta: dict[bytes, tuple] = {}
        self._held_in: dict[bytes, set[str]] = {}  # announced in a local tier: key -> those tiers
        # Keys with metadata that no local tier holds, oldest first: at most ``max_unheld`` of them.
        # A held key's metadata is kept until its last removal is told (a router must hear it).
        self._unheld: OrderedDict[bytes, None] = OrderedDict()
        self.max_unheld = max_unheld
        self.journals = journals or {}  # per tier that lists its entries across restarts

    @classmethod
    def of(cls, manager, meta_of: Callable[[list], tuple | None], max_unheld: int = 100_000) -> "Announcements":
        """For ``manager``'s (a ``TierManager``'s) tiers, with a journal beside the entries of each
        that lists them across restarts."""
        return cls(manager.specs, max_unheld, {tier.name: DiskJournal(*tier.listing(), meta_of=meta_of)
                                               for tier in manager.tiers if isinstance(tier, ListedIndex)})

    def remember(self, key: bytes, meta: tuple) -> None:
        """The engine's metadata of ``key`` (a tuple of plain fields, journaled as they are)."""
        if key in self._meta:
            return
        self._meta[key] = meta
        self._unheld[key] = None
        while len(self._unheld) > self.max_unheld:
            del self._meta[self._unheld.popitem(last=False)[0]]

    def knows(self, key: bytes) -> bool:
        return key in self._meta

    def meta(self, key: bytes) -> tuple | None:
        return self._meta.get(key)

    def place(self, tier: str) -> Place | None:
        return self._where.get(tier)

    def take(self, holdings: list[tuple[str, str, bytes]], announcing: bool = False) -> list[tuple[bool, tuple, Place]]:
        """Announcements for ``holdings``: (stored, the block's metadata, where), in order."""
        out = []
        for kind, tier, key in holdings:
            meta = self._meta.get(key)
            if meta is None or tier not in self._where:
                continue
            place, shared, journal = self._where[tier], tier in self._shared, self.journals.get(tier)
            if kind == "stored":
                out.append((True, meta, place))
                if not shared:
                    self._held_in.setdefault(key, set()).add(tier)
                    self._unheld.pop(key, None)
                if journal is not None and not announcing:
                    journal.append(key, meta)
            elif shared or tier in self._held_in.get(key, ()):
                out.append((False, meta, place))
                if journal is not None:
                    journal.drop(key)
                tiers = self._held_in.get(key)
                if tiers is not None:
                    tiers.discard(tier)
                    if not tiers:
                        del self._held_in[key]
                        self._unheld[key] = None  # newest: its metadata may serve a next store
        return out

    def take_journaled(self) -> list[tuple[bool, tuple, Place]]:
        """The blocks a previous process left in the tiers that list theirs, from their journals: a
        batch per tier per call."""
        out = []
        for tier, journal in self.journals.items():
            found = journal.take_found()
            for key, meta in found:
                self._meta.setdefault(key, meta)
            out += self.take([("stored", tier, key) for key, _ in found], announcing=True)
        return out

    def close(self) -> None:
        for journal in self.journals.values():
            journal.close()

    @property
    def num_tracked(self) -> int:
        return len(self._meta)


class DiskJournal:
    """What a restart needs to announce a disk tier's blocks: the engine's metadata of each block
    written to it, appended to ``<disk tier file>.events`` (msgpack records, never pickled) on
    a thread of its own, never the scheduler's. At start the journal is read on that thread,
    kept to the blocks the disk still holds (rewritten), and those are announced, ``batch`` at
    a time, with the engine's next steps."""

    def __init__(self, path, held_keys: set[bytes], batch: int = 1000,
                 meta_of: Callable[[list], tuple | None] = tuple):
        import queue
        import threading

        self.path = str(path)
        self.batch = batch
        self._meta_of = meta_of  # a record's fields -> the block's metadata (None: not a record of this engine's)
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._found: list[tuple[bytes, tuple]] = []  # read back at start, to announce
        self._lock = threading.Lock()
        self.loaded = threading.Event()  # set once the journal is read: ``take_found`` has all it will have
        self._thread = threading.Thread(target=self._run, args=(held_keys,), name="kvtier-events-journal",
                                        daemon=True)
        self._thread.start()

    def append(self, key: bytes, meta: tuple) -> None:
        self._writes.put((key, meta))

    def drop(self, key: bytes) -> None:
        """The disk no longer holds ``key``: the next rewrite leaves it out."""
        self._writes.put((key, None))

    def take_found(self) -> list[tuple[bytes, tuple]]:
        with self._lock:
            taken, self._found = self._found[:self.batch], self._found[self.batch:]
        return taken

    def close(self) -> None:
        self._writes.put(None)
        self._thread.join(timeout=5)

    def _run(self, held_keys: set[bytes]) -> None:
        import msgspec

        encoder = msgspec.msgpack.Encoder()
        live: dict[bytes, bytes] = {}  # key -> its record, for what the disk holds
        found: dict[bytes, tuple] = {}
        try:
            with open(self.path, "rb") as journal:
                # A block stored again since the last rewrite has a record each time: the last one stands,
                # and the block is announced once.
                for record in _records(journal):
                    key, *fields = record if isinstance(record, list) and record else [None]
                    meta = self._meta_of(fields) if isinstance(key, bytes) and key in held_keys else None
                    if meta is not None:
                        live[key] = _frame(encoder, key, meta)
                        found[key] = meta
        except (OSError, ValueError, msgspec.DecodeError):  # none yet, or cut short: what was read stands
            pass
        with self._lock:
            self._found.extend(found.items())
        self.loaded.set()
        journal = self._rewrite(live)
        written = len(live)  # records in the file; past twice the live ones (and 1,000), it is rewritten
        try:
            while (item := self._writes.get()) is not None:
                pending = [item]
                while not self._writes.empty():  # one write for whatever queued meanwhile
                    more = self._writes.get()
                    if more is None:
                        self._writes.put(None)
                        break
                    pending.append(more)
                frames = []
                for key, meta in pending:
                    if meta is None:
                        live.pop(key, None)
                    else:
                        frames.append(live.setdefault(key, _frame(encoder, key, meta)))
                journal.write(b"".join(frames))
                journal.flush()
                written += len(frames)
                if written > 2 * len(live) + 1000:
                    journal.close()
                    journal, written = self._rewrite(live), len(live)
        finally:
            journal.close()

    def _rewrite(self, live: dict[bytes, bytes]):
        """The journal made of the live records only (atomically), then opened for appends."""
        from kvtier.tiers.namespaces import write_private

        write_private(self.path, b"".join(live.values()))
        return os.fdopen(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW), "wb")


def _frame(encoder, key: bytes, meta: tuple) -> bytes:
    body = encoder.encode([key, *meta])
    return len(body).to_bytes(4, "little") + body


def _records(stream):
    import msgspec

    decoder = msgspec.msgpack.Decoder()
    data = stream.read()
    offset = 0
    while offset + 4 <= len(data):
        size = int.from_bytes(data[offset:offset + 4], "little")
        if offset + 4 + size > len(data):
            return  # a record cut short by a crash: the ones before it stand
        yield decoder.decode(data[offset + 4:offset + 4 + size])
        offset += 4 + size
