"""Local disk tier: a directory of this instance's own. Torch-free.

Each rank's entries live in one preallocated, sparse file,
``<disk_dir>/<rank fingerprint hex>/entries-<n>.kvtier``, cut into fixed-size places
of one ``kvtier.common.entry`` each (a 64-byte header, then the slot's bytes). The entries of
a job that fall in consecutive places go to the file in one positioned, vectored write
(headers and payloads from where they lie, about 4 MiB per call), as a plain file is
written. The checksum in a header covers its payload: a torn or interrupted write
(any mix of an old and a new header and payload) fails it, so it is a miss, never a
block. No file is created per block: a write costs what the bytes cost.

The tier's two halves (``kvtier.tiers.base``):
- ``DiskIndex`` runs in the scheduler: which key is in which place (found again
  at start-up from the places' headers), pins for loads in flight, LRU eviction
  within ``disk_bytes``, or within what it holds once its filesystem is found full
  (``complete_store``'s ``full``; the bound is not raised again while it runs). It holds an
  exclusive lock on its files: several
  instances on one directory (vLLM servers on the GPUs of one node, all with the
  default ``disk_dir``) each take a file of their own, ``n`` = 0, 1, ..., and at a
  restart each takes back the first file no running instance holds. Instances
  that should share entries share a directory through ``remote_url: file:///...``.
- ``DiskStore`` runs in kvtier's I/O process: reads and writes places on its own
  threads, never on the engine's interpreter.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Sequence
from urllib.parse import unquote

from kvtier.common.entry import HEADER_BYTES, check_entry, encode_header, read_header, read_header_length
from kvtier.tiers.base import (Miss, TierIndex, TierKind, TierSpec, TierStore, WriteBackOff, bad, directory_url,
                               pwritev_all)

logger = logging.getLogger("kvtier.disk")

_DIR_MODE = 0o700
_FILE_MODE = 0o600
FILE_BITS = 40  # a location is (file number << FILE_BITS) | place


def entries_file(root, rank_fingerprint: bytes, number: int = 0) -> Path:
    return Path(root) / rank_fingerprint.hex() / f"entries-{number}.kvtier"


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]) -> "DiskIndex":
    return DiskIndex(spec.location, spec.capacity_bytes, slot_bytes, rank_fingerprints, spec.name)


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> "DiskStore":
    return DiskStore(spec.location, rank_fingerprint, slot_bytes)


class DiskIndex(TierIndex):
    """Which blocks are on disk, and where, for all ranks of one namespace.

    A block takes the same place in every rank's file; it counts as present only
    when every rank's place holds it. ``capacity_bytes`` is shared by the ranks.
    """

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, slot_bytes: int,
                 rank_fingerprints: Sequence[bytes], name: str = "disk"):
        self.name = name
        self.root = Path(root)
        self.slot_bytes = slot_bytes
        self.rank_fingerprints = list(rank_fingerprints)
        self.entry_bytes = HEADER_BYTES + slot_bytes  # one place, one rank
        self.capacity_entries = capacity_bytes // (len(self.rank_fingerprints) * self.entry_bytes)
        if self.capacity_entries <= 0:
            raise ValueError(f"disk_bytes={capacity_bytes} holds no entry of "
                             f"{len(self.rank_fingerprints) * self.entry_bytes} bytes")
        self._place_of: dict[bytes, int] = {}  # ready or being written
        self._ready: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._writing: set[bytes] = set()
        self._pins: dict[bytes, int] = {}
        self._free: list[int] = []  # free places, the lowest last: files stay dense at their start
        # At most this many entries: capacity_entries, or fewer once the filesystem was found full
        # (``complete_store``'s ``full``); then a store evicts first, and takes the evicted entry's place, written before.
        self.limit_entries = 0
        self.num_evictions = 0
        self.num_discarded = 0
        self._fds: list[int] = []
        self._closer = weakref.finalize(self, _close_all, self._fds)  # closed with the index, or when it goes
        self.file_number = 0
        while not self._open_files(self.file_number):  # held by a running instance: the next one
            self.file_number += 1
        self._scan()

    def _open_files(self, number: int) -> bool:
        """Open and lock file ``number`` of every rank; False (nothing held) if another instance has one."""
        opened = []
        for fingerprint in self.rank_fingerprints:
            path = entries_file(self.root, fingerprint, number)
            self.root.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)  # owner-only, like what it holds
            path.parent.mkdir(mode=_DIR_MODE, exist_ok=True)
            if path.parent.is_symlink():  # a link planted in kvtier's directory is never followed
                raise OSError(f"{path.parent} is a symbolic link; kvtier does not follow links under disk_dir")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, _FILE_MODE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                _close_all(opened)
                return False
            if os.fstat(fd).st_size < self.capacity_entries * self.entry_bytes:
                os.ftruncate(fd, self.capacity_entries * self.entry_bytes)  # sparse: no space used until written
            opened.append(fd)
        self._fds.extend(opened)
        return True

    def _scan(self) -> None:
        """Find the entries a previous process left: a key counts where every rank's place holds it."""
        found: dict[int, bytes] | None = None
        for fingerprint, fd in zip(self.rank_fingerprints, self._fds):
            rank_found = {}
            for place in _written_places(fd, self.entry_bytes, self.capacity_entries):
                key = read_header(os.pread(fd, HEADER_BYTES, place * self.entry_bytes), fingerprint,
                                  self.slot_bytes)
                if key is not None:
                    rank_found[place] = key
            found = rank_found if found is None else {p: k for p, k in found.items() if rank_found.get(p) == k}
        taken = set()
        for place, key in sorted((found or {}).items()):
            if key not in self._place_of:  # a key twice (an interrupted rewrite): the first place wins
                self._place_of[key] = place
                self._ready[key] = None
                taken.add(place)
        self._free = [p for p in range(self.capacity_entries - 1, -1, -1) if p not in taken]
        self.limit_entries = self.capacity_entries

    @property
    def num_pins(self) -> int:
        return sum(self._pins.values())

    @property
    def num_entries(self) -> int:
        return len(self._ready) + len(self._writing)

    def lookup(self, keys: Sequence[bytes], token: str | None = None) -> list[bool]:
        found = [key in self._ready for key in keys]
        for key, hit in zip(keys, found):
            if hit:
                self._ready.move_to_end(key)
        return found

    def listing(self) -> tuple[str, set[bytes]]:
        """The journal goes beside this instance's entries file (of the first rank): each instance on
        one directory has a file, and a journal, of its own."""
        return f"{entries_file(self.root, self.rank_fingerprints[0], self.file_number)}.events", set(self._ready)

    def _location(self, key: bytes) -> int:
        return (self.file_number << FILE_BITS) | self._place_of[key]

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._ready), "evictions": self.num_evictions, "discarded": self.num_discarded}

    def contains(self, key: bytes) -> bool:
        return key in self._place_of

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin ready entries so that eviction leaves their places until ``complete_load``."""
        for key in keys:
            if key not in self._ready:
                raise KeyError(key.hex())
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1
        return [self._location(key) for key in keys]

    def complete_load(self, keys: Sequence[bytes], bad_keys: Sequence[bytes] = (),
                      gone_keys: Sequence[bytes] = ()) -> None:
        for key in keys:
            pins = self._pins[key] - 1
            if pins:
                self._pins[key] = pins
            else:
                del self._pins[key]
        for key in (*bad_keys, *gone_keys):  # after the pins are gone, so that discarding works
            self.discard(key)

    def prepare_store(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        """Reserve a place for each key not yet on disk; returns those to write, with their places.

        Evicts least recently used, unpinned entries to make room; writes only as
        many keys as fit.
        """
        accepted = []
        for key in dict.fromkeys(keys):
            if key in self._place_of:
                continue
            if (not self._free or len(self._place_of) >= self.limit_entries) and not self._evict_one():
                break
            self._place_of[key] = self._free.pop()  # last in: an evicted entry's place, if one was evicted
            self._writing.add(key)
            accepted.append(key)
        return {key: self._location(key) for key in accepted}

    def complete_store(self, written: Sequence[bytes], failed: Sequence[bytes] = (), deleted: Sequence[bytes] = (),
                       full: bool = False) -> None:
        for key in written:
            self._writing.discard(key)
            self._ready[key] = None
        if self.holdings is not None:
            self.holdings += [("stored", self.name, key) for key in written]
        for key in failed:  # the place may hold part of the write: its old header's checksum fails it
            self._writing.discard(key)
            self._free.append(self._place_of.pop(key))
        if full:  # after the failed keys gave their room back
            self._hold_at_most_now()

    def _hold_at_most_now(self) -> None:
        held = max(1, len(self._place_of))
        if held < self.limit_entries:
            logger.warning("kvtier: the %s tier's filesystem (%s) is full at %d entries (%.1f MiB per rank), short of "
                           "its bound of %d: it keeps at most %d from now on, evicting the oldest to make room",
                           self.name, self.root, held, held * self.entry_bytes / 2**20, self.capacity_entries, held)
            self.limit_entries = held

    def discard(self, key: bytes) -> None:
        """Drop an entry found corrupt or missing: a miss from now on, its place reused."""
        if key in self._ready and key not in self._pins:
            del self._ready[key]
            self._free.append(self._place_of.pop(key))
            self.num_discarded += 1
            if self.holdings is not None:
                self.holdings.append(("damaged", self.name, key))

    def _evict_one(self) -> bool:
        for key in self._ready:
            if key not in self._pins:
                del self._ready[key]
                self._free.append(self._place_of.pop(key))
                self.num_evictions += 1
                if self.holdings is not None:
                    self.holdings.append(("evicted", self.name, key))
                return True
        return False

    def close(self) -> None:
        self._closer()  # releases the locks


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def entries_in(root, rank_fingerprints: Sequence[bytes] | None = None) -> list[tuple[Path, int, bytes, int, int]]:
    """(file, offset, key, payload bytes, location) of every place under ``root`` (of the ranks
    of ``rank_fingerprints``; None: all) whose header names a kvtier entry of its file's
    namespace. Headers only: a payload may still fail its checksum."""
    found = []
    paths = (Path(root).glob("*/entries-*.kvtier") if rank_fingerprints is None else
             [p for fp in rank_fingerprints for p in (Path(root) / fp.hex()).glob("entries-*.kvtier")])
    for path in sorted(paths):
        fingerprint = bytes.fromhex(path.parent.name)
        with open(path, "rb") as file:
            first = read_header_length(file.read(HEADER_BYTES))  # place 0 is the first one written
            if first is None:
                continue
            entry_bytes = HEADER_BYTES + first
            capacity = os.fstat(file.fileno()).st_size // entry_bytes
            for place in _written_places(file.fileno(), entry_bytes, capacity):
                key = read_header(os.pread(file.fileno(), HEADER_BYTES, place * entry_bytes), fingerprint, first)
                if key is not None:
                    number = int(path.name.split("-")[1].split(".")[0])
                    found.append((path, place * entry_bytes, key, first, (number << FILE_BITS) | place))
    return found


def write_record(spec: TierSpec, record: dict) -> bool:
    """A namespace record, in ``namespaces/`` beside the entries."""
    from kvtier.tiers.namespaces import write_record_in
    return bool(write_record_in(spec.location, record))


def read_records(spec: TierSpec) -> list[dict]:
    from kvtier.tiers.namespaces import read_records_in
    return read_records_in([spec.location])


_outside: dict[tuple, tuple[float, set[bytes]]] = {}  # (root, ranks) -> (when read, keys every rank holds)


def held_from_outside(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes],
                      keys: Sequence[bytes], max_age_s: float = 30.0) -> set[bytes]:
    """Which of ``keys`` every rank's file holds, from the places' headers (no lock taken: a
    running instance keeps its files). The headers are read once per ``max_age_s``."""
    import time

    cache_key = (str(spec.location), tuple(rank_fingerprints))
    when, held = _outside.get(cache_key, (0.0, set()))
    if time.monotonic() - when > max_age_s:
        per_rank: dict[bytes, set[bytes]] = {fp: set() for fp in rank_fingerprints}
        for path, _, key, _, _ in entries_in(spec.location, rank_fingerprints):
            per_rank[bytes.fromhex(path.parent.name)].add(key)
        held = set.intersection(*per_rank.values()) if per_rank else set()
        if len(_outside) > 64:
            _outside.clear()
        _outside[cache_key] = (time.monotonic(), held)
    return held.intersection(keys)


def _place(url: str) -> tuple[str, int | None]:
    """``disk:///var/cache/kvtier?max_bytes=100GiB``: the directory, and its bound (None: ``disk_bytes``)."""
    path, bound = directory_url(url, "a local directory", "/var/cache/kvtier")
    return unquote(path), bound  # the shorthand quotes disk_dir into its URL


def _validate(url: str) -> None:
    from kvtier.common.config import usable_directory

    usable_directory(_place(url)[0])


def _probe_spec(spec: TierSpec, fingerprint: bytes, slot_bytes: int) -> TierSpec:
    """The store writes into a file its index made: the probe's own, sized for one place."""
    DiskIndex(spec.location, HEADER_BYTES + slot_bytes, slot_bytes, [fingerprint]).close()
    return dataclasses.replace(spec, timeout_s=10.0)


RUN_BYTES = 4 << 20  # at most one vectored write: a job's size (``kvtier.worker.jobs``)
RUN_ENTRIES = 512  # two buffers each: within IOV_MAX (1,024 on Linux)


def _runs(locations: Sequence[int], entry_bytes: int) -> list[tuple[int, int]]:
    """[first, end) index ranges of ``locations`` that are consecutive places of one file, each at
    most ``RUN_BYTES`` (one entry at least) and ``RUN_ENTRIES`` long."""
    per_run = max(1, min(RUN_ENTRIES, RUN_BYTES // entry_bytes))
    runs, first = [], 0
    for i in range(1, len(locations) + 1):
        if i == len(locations) or locations[i] != locations[i - 1] + 1 or i - first == per_run:
            runs.append((first, i))
            first = i
    return runs


def _written_places(fd: int, entry_bytes: int, capacity: int):
    """Places whose header lies in data: the holes of the sparse file are places never written."""
    end = capacity * entry_bytes
    offset = 0
    while offset < end:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after offset
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        yield from range(-(-data // entry_bytes), min(-(-hole // entry_bytes), capacity))
        offset = hole


class DiskStore(TierStore):
    """Reads and writes one rank's places. Thread-safe; runs in kvtier's I/O process, which runs
    a tier's jobs side by side on its threads; one job's blocks are read or written in order."""

    def __init__(self, root: str | os.PathLike, rank_fingerprint: bytes, slot_bytes: int):
        self.root = root
        self.rank_fingerprint = rank_fingerprint
        self.slot_bytes = slot_bytes
        self.entry_bytes = HEADER_BYTES + slot_bytes
        entries_file(root, rank_fingerprint).parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        self._fds: dict[int, int] = {}  # file number -> descriptor, opened at first use
        self._fds_lock = threading.Lock()
        # A full filesystem pauses no write: told so, the index makes room by eviction, and the
        # next writes go to places that were written before (the sparse file's space, taken).
        self.back_off = WriteBackOff(full_pause_s=0.0)

    def read_into(self, keys, slot_ids, locations, deadline, check=True) -> list[Miss | int | None]:
        return [self._read_guarded(key, memoryview(self.host[slot]), location, check)
                for key, slot, location in zip(keys, slot_ids, locations)]

    def write_from(self, keys, slot_ids, locations, deadline, checksums=None) -> list[Miss | None]:
        reasons: list[Miss | None] = []
        for first, end in _runs(locations, self.entry_bytes):
            reasons += self._write_guarded(keys[first:end], [memoryview(self.host[s]) for s in slot_ids[first:end]],
                                           locations[first], None if checksums is None else checksums[first:end])
        return reasons

    def _read_guarded(self, key: bytes, out: memoryview, location: int, check: bool) -> Miss | int | None:
        try:
            return self.read(key, out, location, check)
        except Exception as error:  # every block gets an outcome, whatever the filesystem raises
            return bad(f"read failed: {error!r}")

    def _write_guarded(self, keys: Sequence[bytes], payloads: Sequence[memoryview], location: int,
                       checks: Sequence[int] | None) -> list[Miss | None]:
        if skipped := self.back_off.skipped():
            return [skipped] * len(keys)
        try:
            self.write_run(keys, payloads, location, checks)
            return [None] * len(keys)
        except Exception as error:
            # The entries wholly written before the error (a full device) are stored; the place
            # where it stopped may hold part of an entry, which fails its checksum.
            whole = getattr(error, "written", 0) // self.entry_bytes
            return [None] * whole + [self.back_off.failed(error)] * (len(keys) - whole)

    def _file(self, location: int) -> tuple[int, int]:
        """(descriptor, byte offset) of a location. The index made and sized the file, and locks
        it; here it is opened without truncating, never locked."""
        number, place = location >> FILE_BITS, location & ((1 << FILE_BITS) - 1)
        with self._fds_lock:
            fd = self._fds.get(number)
            if fd is None:
                path = entries_file(self.root, self.rank_fingerprint, number)
                fd = self._fds[number] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                                                 _FILE_MODE)
        return fd, place * self.entry_bytes

    def write(self, key: bytes, payload: memoryview, location: int) -> None:
        """Write one entry into its place."""
        self.write_run([key], [payload], location)

    def write_run(self, keys: Sequence[bytes], payloads: Sequence[memoryview], location: int,
                  checks: Sequence[int] | None = None) -> None:
        """Write entries into consecutive places from ``location`` on, in one vectored write
        (``checks``: the payloads' checksums, where they were taken already)."""
        fd, offset = self._file(location)
        buffers = []
        for key, payload, check in zip(keys, payloads, checks or [None] * len(keys)):
            payload = memoryview(payload).cast("B")  # lengths and short-write slices in bytes
            # Header, then payload, as the place holds them. Either may land first or alone: the
            # header's checksum covers the payload, so any mix of old and new bytes is a miss.
            buffers += [memoryview(encode_header(self.rank_fingerprint, key, payload, self.mac_key, check)), payload]
        pwritev_all(fd, buffers, offset)

    def read(self, key: bytes, out: memoryview, location: int, check: bool = True) -> Miss | int | None:
        """Read one entry into ``out``; None on success, else why it is a miss. ``check`` False: the
        caller checks the payload's checksum (``kvtier.common.entry.check_entry``).

        On failure ``out`` holds garbage and must not be used.
        """
        header = bytearray(HEADER_BYTES)
        fd, offset = self._file(location)
        got = os.preadv(fd, [header, out], offset)
        if got != HEADER_BYTES + len(out):
            return bad(f"truncated ({got} bytes read)")
        return check_entry(bytes(header), out, self.rank_fingerprint, key, len(out), self.mac_key, check)

    def close(self) -> None:
        _close_all(list(self._fds.values()))


KIND = TierKind("disk", make_index, make_store, place=_place, validate=_validate, directory=lambda spec: spec.location,
                probe_spec=_probe_spec, write_record=write_record, read_records=read_records,
                held_from_outside=held_from_outside)
