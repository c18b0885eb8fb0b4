"""Disk tier: blocks persisted as files under a directory. Torch-free.

Layout on disk: ``<disk_dir>/<rank fingerprint hex>/<key hex[:2]>/<key hex>``, one
file per block and rank, a 64-byte ``kvtier.entry`` header then the slot's bytes.
Files and folders are created readable by their owner only. A write goes to a
temporary file that is renamed into place, so a crash never leaves a
half-written file under an entry's name; a torn write after a power loss fails
its checksum and is a miss.

The tier's two halves (``kvtier.tiers.base``):
- ``DiskIndex`` runs in the scheduler: which keys are on disk (found again by a
  scan at start-up), pins for loads in flight, LRU eviction within ``disk_bytes``.
- ``DiskStore`` runs in kvtier's I/O process: reads and writes entries on its own
  threads, never on the engine's interpreter.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from kvtier.entry import HEADER_BYTES, check_entry, encode_header
from kvtier.tiers.base import TierIndex, TierSpec, TierStore

_DIR_MODE = 0o700
_FILE_MODE = 0o600


def entry_path(root: Path, rank_fingerprint: bytes, key: bytes) -> Path:
    key_hex = key.hex()
    return Path(root) / rank_fingerprint.hex() / key_hex[:2] / key_hex


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]) -> "DiskIndex":
    return DiskIndex(spec.location, spec.capacity_bytes, slot_bytes, rank_fingerprints, spec.name)


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> "DiskStore":
    return DiskStore(spec.location, rank_fingerprint, slot_bytes, spec.threads)


class DiskIndex(TierIndex):
    """Which blocks are on disk, for all ranks of one namespace.

    An entry counts as present only when every rank's file is there. Each entry
    costs ``len(rank_fingerprints) * (header + slot_bytes)`` of ``capacity_bytes``.
    """

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, slot_bytes: int,
                 rank_fingerprints: Sequence[bytes], name: str = "disk"):
        self.name = name
        self.root = Path(root)
        self.slot_bytes = slot_bytes
        self.rank_fingerprints = list(rank_fingerprints)
        self.entry_bytes = len(self.rank_fingerprints) * (HEADER_BYTES + slot_bytes)
        self.capacity_entries = capacity_bytes // self.entry_bytes
        if self.capacity_entries <= 0:
            raise ValueError(f"disk_bytes={capacity_bytes} holds no entry of {self.entry_bytes} bytes")
        self._ready: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._writing: set[bytes] = set()
        self._pins: dict[bytes, int] = {}
        self.num_evictions = 0
        self.num_discarded = 0
        for fingerprint in self.rank_fingerprints:
            (self.root / fingerprint.hex()).mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        """Find the entries a previous process left, oldest first."""
        found: dict[bytes, float] | None = None
        expected_size = HEADER_BYTES + self.slot_bytes
        for fingerprint in self.rank_fingerprints:
            rank_entries: dict[bytes, float] = {}
            for sub in (self.root / fingerprint.hex()).iterdir():
                if not sub.is_dir():
                    continue
                for item in os.scandir(sub):
                    if item.name.endswith(".tmp"):
                        _unlink_quietly(item.path)  # a write that a crash interrupted
                        continue
                    try:
                        key = bytes.fromhex(item.name)
                        stat = item.stat()
                    except (ValueError, OSError):
                        continue
                    if len(key) == 16 and stat.st_size == expected_size:
                        rank_entries[key] = stat.st_mtime
            found = rank_entries if found is None else {
                k: max(t, rank_entries[k]) for k, t in found.items() if k in rank_entries}
        for key, _ in sorted((found or {}).items(), key=lambda item: item[1]):
            self._ready[key] = None
        while len(self._ready) > self.capacity_entries:
            self._evict_one()

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

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._ready), "evictions": self.num_evictions, "discarded": self.num_discarded}

    def contains(self, key: bytes) -> bool:
        return key in self._ready or key in self._writing

    def prepare_load(self, keys: Sequence[bytes]) -> None:
        """Pin ready entries so that eviction leaves their files until ``complete_load``."""
        for key in keys:
            if key not in self._ready:
                raise KeyError(key.hex())
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def complete_load(self, keys: Sequence[bytes], bad_keys: Sequence[bytes] = ()) -> None:
        for key in keys:
            pins = self._pins[key] - 1
            if pins:
                self._pins[key] = pins
            else:
                del self._pins[key]
        for key in bad_keys:  # after the pins are gone, so that discarding works
            self.discard(key)

    def prepare_store(self, keys: Sequence[bytes]) -> list[bytes]:
        """Reserve room for the keys not yet on disk; returns those to write.

        Evicts least recently used, unpinned entries to make room; writes only as
        many keys as fit.
        """
        new_keys = [k for k in dict.fromkeys(keys) if k not in self._ready and k not in self._writing]
        accepted = []
        for key in new_keys:
            if self.num_entries >= self.capacity_entries and not self._evict_one():
                break
            self._writing.add(key)
            accepted.append(key)
        return accepted

    def complete_store(self, written: Sequence[bytes], failed: Sequence[bytes] = ()) -> None:
        for key in written:
            self._writing.discard(key)
            self._ready[key] = None
        for key in failed:
            self._writing.discard(key)
            self._delete_files(key)

    def discard(self, key: bytes) -> None:
        """Drop an entry found corrupt or missing: a miss from now on."""
        if key in self._ready and key not in self._pins:
            del self._ready[key]
            self._delete_files(key)
            self.num_discarded += 1

    def _evict_one(self) -> bool:
        for key in self._ready:
            if key not in self._pins:
                del self._ready[key]
                self._delete_files(key)
                self.num_evictions += 1
                return True
        return False

    def _delete_files(self, key: bytes) -> None:
        # Synchronous on purpose: a deferred unlink could delete a newer file that a
        # later store of the same key renamed into place.
        for fingerprint in self.rank_fingerprints:
            _unlink_quietly(entry_path(self.root, fingerprint, key))


class DiskStore(TierStore):
    """Reads and writes one rank's entries. Thread-safe; runs in kvtier's I/O process.

    A batch is spread over ``threads`` threads: file I/O releases the GIL, so several
    entries are in the kernel at once."""

    def __init__(self, root: str | os.PathLike, rank_fingerprint: bytes, slot_bytes: int, threads: int = 2):
        self.root = Path(root)
        self.rank_fingerprint = rank_fingerprint
        self.slot_bytes = slot_bytes
        (self.root / rank_fingerprint.hex()).mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        self._made_dirs: set[str] = set()
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-disk") if threads > 1 else None
        # Unique across hosts that share a directory: two writers never share a temporary file.
        self._writer_id = f"{socket.gethostname()}.{os.getpid()}"

    def _each(self, function, *columns) -> list:
        if self._threads is None or len(columns[0]) < 2:
            return list(map(function, *columns))
        return list(self._threads.map(function, *columns))

    def read_into(self, keys, slot_ids, deadline) -> list[str | None]:
        return self._each(self._read_guarded, keys, [memoryview(self.host[s]) for s in slot_ids])

    def write_from(self, keys, slot_ids, deadline) -> list[str | None]:
        return self._each(self._write_guarded, keys, [memoryview(self.host[s]) for s in slot_ids])

    def _read_guarded(self, key: bytes, out: memoryview) -> str | None:
        try:
            return self.read(key, out)
        except Exception as error:  # every block gets an outcome, whatever the filesystem raises
            return f"read failed: {error!r}"

    def _write_guarded(self, key: bytes, payload: memoryview) -> str | None:
        try:
            self.write(key, payload)
            return None
        except Exception as error:
            return f"write failed: {error!r}"

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)

    def path(self, key: bytes) -> Path:
        return entry_path(self.root, self.rank_fingerprint, key)

    def write(self, key: bytes, payload: memoryview) -> None:
        """Write one entry atomically (temporary file, then rename). Raises OSError."""
        path = self.path(key)
        parent = str(path.parent)
        if parent not in self._made_dirs:
            os.makedirs(parent, mode=_DIR_MODE, exist_ok=True)
            with self._lock:
                self._made_dirs.add(parent)
        header = encode_header(self.rank_fingerprint, key, payload)
        temporary = f"{path}.{self._writer_id}.{threading.get_ident()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        try:
            try:
                written = os.writev(fd, [header, payload])
            finally:
                os.close(fd)
            if written != HEADER_BYTES + len(payload):
                raise OSError(f"short write to {temporary}: {written} bytes")
            os.replace(temporary, path)  # the entry appears whole, or not at all
        except BaseException:
            _unlink_quietly(temporary)
            raise

    def read(self, key: bytes, out: memoryview) -> str | None:
        """Read one entry into ``out``; None on success, else why it is a miss.

        On failure ``out`` holds garbage and must not be used.
        """
        header = bytearray(HEADER_BYTES)
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return "missing"
        except OSError as error:
            return f"unreadable: {error}"
        try:
            size = os.fstat(fd).st_size
            if size != HEADER_BYTES + len(out):
                return f"truncated or wrong size ({size} bytes)"
            got = os.readv(fd, [header, out])
        except OSError as error:
            return f"unreadable: {error}"
        finally:
            os.close(fd)
        if got != HEADER_BYTES + len(out):
            return f"truncated ({got} bytes read)"
        return check_entry(bytes(header), out, self.rank_fingerprint, key, len(out))


def _unlink_quietly(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already, or not a file kvtier wrote: either way not an entry any more
        pass
