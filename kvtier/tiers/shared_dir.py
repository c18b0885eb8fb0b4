"""Shared-filesystem tier (``file:///path``): a directory that several instances mount.

NFS, a Kubernetes volume, a FUSE mount of a distributed filesystem: any directory
that every instance sees. Entries are files, one per block and rank
(``<dir>/<rank fingerprint hex>/<key hex[:2]>/<key hex>``, header then payload;
``kvtier.tiers.entry_files``), written atomically (a temporary file named by host, process and thread, renamed
into place), so a reader sees a whole entry or none, and checks it before use.

No instance owns the directory, so the index keeps no list: existence is asked of
the filesystem off the scheduler's thread, by ``stat()`` calls on a native thread
that never takes the GIL (``ExistenceIndex``, ``_WholeEntries``). ``?max_bytes=100GiB``
bounds what this instance's I/O process keeps there: before a write would pass it, the
oldest entries (by modification time; a read refreshes it) are deleted down to 90 %. Each instance
enforces the bound on what it sees, so the directory stays near it, not under it.
A filesystem that fills first (ENOSPC, EDQUOT) sets the bound where it filled, as
the entries there take, and the write is tried again once room is made: a full
directory keeps taking the latest blocks, not none of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Sequence

from kvtier._native import stat_batch
from kvtier.common.entry import HEADER_BYTES
from kvtier.tiers.base import (FULL_ERRNOS, ExistenceIndex, Miss, SharedStore, TierKind, TierSpec, directory_url,
                               index_timings)
from kvtier.tiers.entry_files import EntryFiles, entry_name, entry_path

logger = logging.getLogger("kvtier.shared_dir")


def _directory_and_bound(url: str) -> tuple[str, int | None]:
    return directory_url(url, "a local mount", "/mnt/kv")


def validate(url: str) -> None:
    _directory_and_bound(url)


MAX_CHECKS = 64  # existence checks running at once in a process (a hung mount holds each one)
_FULL_RETRIES = 3  # a write that meets a full filesystem is tried again this often, room made before each


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]) -> ExistenceIndex:
    root = _directory_and_bound(spec.location)[0]
    fingerprints = [fp.hex() for fp in rank_fingerprints]
    return ExistenceIndex(spec.name, lambda keys: _WholeEntries(root, HEADER_BYTES + slot_bytes, fingerprints, keys),
                          spec.timeout_s, max_pending=MAX_CHECKS, **index_timings(spec))


class _WholeEntries:
    """One existence check: every rank's entry of each key, stat()ed on a native thread.

    A thread of the scheduler's process would need the GIL after each stat(), and in
    vLLM's one-process layout the engine's busy loop holds it, for a switch interval
    after each stat(). This one takes no GIL until the scheduler asks."""

    def __init__(self, root: str, size: int, fingerprints: Sequence[str], keys: Sequence[bytes]):
        self._size, self._ranks = size, len(fingerprints)
        paths = [os.fsencode(entry_name(root, fp, key_hex)) for key_hex in (key.hex() for key in keys)
                 for fp in fingerprints]
        self._sizes = stat_batch.Sizes(paths, MAX_CHECKS)

    def done(self) -> bool:
        return self._sizes.done()

    def result(self) -> list[bool]:
        """A block counts only if every rank's entry is there, whole."""
        sizes = self._sizes.sizes()
        return [all(s == self._size for s in sizes[i:i + self._ranks]) for i in range(0, len(sizes), self._ranks)]


def _whole(root: Path, size: int, rank_fingerprints: Sequence[bytes], key: bytes) -> bool:
    """A block counts only if every rank's entry is there, whole."""
    return all(_size(entry_path(root, fp, key)) == size for fp in rank_fingerprints)


def held_from_outside(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes],
                      keys: Sequence[bytes]) -> set[bytes]:
    root, size = Path(_directory_and_bound(spec.location)[0]), HEADER_BYTES + slot_bytes
    return {key for key in keys if _whole(root, size, rank_fingerprints, key)}


def write_record(spec: TierSpec, record: dict) -> bool:
    """A namespace record, in ``namespaces/`` beside the entries."""
    from kvtier.tiers.namespaces import write_record_in
    return bool(write_record_in(_directory_and_bound(spec.location)[0], record))


def read_records(spec: TierSpec) -> list[dict]:
    from kvtier.tiers.namespaces import read_records_in
    return read_records_in([_directory_and_bound(spec.location)[0]])


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> "SharedDirStore":
    root, bound = _directory_and_bound(spec.location)
    return SharedDirStore(root, rank_fingerprint, slot_bytes, bound)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


class SharedDirStore(EntryFiles, SharedStore):
    def __init__(self, root: str, rank_fingerprint: bytes, slot_bytes: int, max_bytes: int | None):
        super().__init__(root, rank_fingerprint, slot_bytes)
        self.max_bytes = max_bytes
        self._entry_bytes = HEADER_BYTES + slot_bytes
        self._used = 0
        self._used_lock = threading.Lock()
        self._room_lock = threading.Lock()
        self._num_rooms = 0  # times room was made for a full filesystem
        self._writing = 0  # writes in flight, each with a temporary file that takes room
        self._deleted: list[bytes] = []  # keys of entries deleted by the bound, not yet told (``take_deleted``)
        if max_bytes is not None:
            self._used = self._entry_bytes * sum(1 for _ in self._entries())

    def _entries(self):
        base = self.root / self.rank_fingerprint.hex()
        for sub in os.scandir(base):
            if sub.is_dir(follow_symlinks=False):
                yield from (e for e in os.scandir(sub.path) if not e.name.endswith(".tmp"))

    def read(self, key: bytes, out: memoryview, check: bool = True) -> Miss | int | None:
        why = super().read(key, out, check)
        if not isinstance(why, Miss) and self.max_bytes is not None:
            try:
                os.utime(self.path(key))  # recently used: the last to be deleted by a size bound
            except OSError:
                pass
        return why

    def write(self, key: bytes, payload: memoryview, check: int | None = None) -> None:
        if _size(self.path(key)) == self._entry_bytes:
            return  # another instance stored this block already: entries of one key are identical
        if self.max_bytes is not None:
            with self._used_lock:
                self._used += self._entry_bytes
                over = self._used > self.max_bytes
            if over:  # before the write: a bound learned from a full filesystem is not met again
                self._shrink()
        try:
            self._write_in_room(key, payload, check)
        except OSError:
            if self.max_bytes is not None:
                with self._used_lock:
                    self._used -= self._entry_bytes  # not written: it takes no room
            raise

    def _write_in_room(self, key: bytes, payload: memoryview, check: int | None) -> None:
        for attempt in range(_FULL_RETRIES + 1):
            rooms = self._num_rooms  # read before the write: room made after it began is room for it
            try:
                with self._in_flight():
                    return super().write(key, payload, check)
            except OSError as error:
                # Other threads' writes may take the room made before this one's turn: a few more
                # tries, each after room is made again; a filesystem still full goes to the back-off.
                if attempt == _FULL_RETRIES or error.errno not in FULL_ERRNOS or not self._make_room(rooms):
                    raise

    @contextlib.contextmanager
    def _in_flight(self):
        """Counts a write in flight while its temporary file takes room."""
        with self._used_lock:
            self._writing += 1
        try:
            yield
        finally:
            with self._used_lock:
                self._writing -= 1

    def _make_room(self, rooms_seen: int) -> bool:
        """The filesystem is full: bound this instance at what its entries take now, less room for
        the writes in flight (each one's temporary file takes an entry's room), and delete the
        oldest to 90 % of that; True if room was made, by this call or another thread's since
        ``rooms_seen``. False where this rank has no entry to delete (the space is others')."""
        with self._room_lock:  # one thread makes room; those that met the same full filesystem write again
            if self._num_rooms != rooms_seen:
                return True
            held = sum(1 for _ in self._entries())
            if held == 0:
                return False
            with self._used_lock:
                bound = max(1, held - self._writing) * self._entry_bytes
            if self.max_bytes is None or bound < self.max_bytes:
                logger.warning("kvtier: shared directory %s: its filesystem is full at %d entries of this rank "
                               "(%.1f MiB)%s: at most %d kept from now on, the oldest deleted to make room",
                               self.root, held, held * self._entry_bytes / 2**20,
                               "" if self.max_bytes is None else f", short of max_bytes={self.max_bytes}",
                               bound // self._entry_bytes)
                self.max_bytes = bound
            self._shrink()
            self._num_rooms += 1
            return True

    def take_deleted(self) -> list[bytes]:
        with self._used_lock:
            deleted, self._deleted = self._deleted, []
        return deleted

    def _shrink(self) -> None:
        """Delete the oldest entries until 90 % of ``max_bytes`` is used, the entry about to be
        written counted."""
        with self._used_lock:
            entries = []
            for entry in self._entries():
                try:
                    entries.append((entry.stat(follow_symlinks=False).st_mtime, entry.path))
                except OSError:
                    continue
            entries.sort()
            used = (len(entries) + 1) * self._entry_bytes
            target = int(0.9 * self.max_bytes)
            removed = 0
            for _, path in entries:
                if used <= target:
                    break
                try:
                    os.unlink(path)
                    self._deleted.append(bytes.fromhex(os.path.basename(path)))
                except (OSError, ValueError):  # gone meanwhile; or a file of another name
                    pass
                used -= self._entry_bytes
                removed += 1
            self._used = used
        logger.info("kvtier: shared directory %s over %d bytes: %d oldest entries deleted", self.root,
                    self.max_bytes, removed)


KIND = TierKind("file", make_index, make_store, shared=True, validate=validate,
                address=lambda spec: _directory_and_bound(spec.location)[0],
                directory=lambda spec: _directory_and_bound(spec.location)[0],
                write_record=write_record, read_records=read_records, held_from_outside=held_from_outside)
