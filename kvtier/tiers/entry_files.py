"""Entries as files, one per block and rank: how the shared-filesystem tier stores them.

Layout: ``<dir>/<rank fingerprint hex>/<key hex[:2]>/<key hex>``, a 64-byte
``kvtier.common.entry`` header then the slot's bytes. Files and folders are created
readable by their owner only. A write goes to a temporary file (named by host,
process and thread, so that writers on several hosts never share one) that is
renamed into place: a reader sees a whole entry or none, and checks it before use.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from kvtier.common.entry import HEADER_BYTES, check_entry, encode_header
from kvtier.tiers.base import Miss, TierStore, WriteBackOff, bad, gone, pwritev_all

_DIR_MODE = 0o700
_FILE_MODE = 0o600


def entry_name(root: str, rank_fingerprint_hex: str, key_hex: str) -> str:
    return os.path.join(root, rank_fingerprint_hex, key_hex[:2], key_hex)


def entry_path(root, rank_fingerprint: bytes, key: bytes) -> Path:
    return Path(entry_name(os.fspath(root), rank_fingerprint.hex(), key.hex()))


class EntryFiles(TierStore):
    """One rank's entries, one file each. Thread-safe; runs in kvtier's I/O process, which runs
    a tier's jobs side by side on its threads; one job's entries are read or written in order."""

    def __init__(self, root: str | os.PathLike, rank_fingerprint: bytes, slot_bytes: int):
        self.root = Path(root)
        self.rank_fingerprint = rank_fingerprint
        self.slot_bytes = slot_bytes
        _make_dirs(self.root, self.root / rank_fingerprint.hex())
        self._made_dirs: set[str] = set()
        self._lock = threading.Lock()
        # Unique across hosts that share a directory: two writers never share a temporary file.
        self._writer_id = f"{socket.gethostname()}.{os.getpid()}"
        self.back_off = WriteBackOff()

    def read_into(self, keys, slot_ids, locations, deadline, check=True) -> list[Miss | int | None]:
        return [self._read_guarded(key, memoryview(self.host[slot]), check) for key, slot in zip(keys, slot_ids)]

    def write_from(self, keys, slot_ids, locations, deadline, checksums=None) -> list[Miss | None]:
        checks = checksums or [None] * len(keys)
        return [self._write_guarded(key, memoryview(self.host[slot]), check)
                for key, slot, check in zip(keys, slot_ids, checks)]

    def _read_guarded(self, key: bytes, out: memoryview, check: bool) -> Miss | int | None:
        try:
            return self.read(key, out, check)
        except Exception as error:  # every block gets an outcome, whatever the filesystem raises
            return bad(f"read failed: {error!r}")

    def _write_guarded(self, key: bytes, payload: memoryview, check: int | None) -> Miss | None:
        if skipped := self.back_off.skipped():
            return skipped
        try:
            self.write(key, payload, check)
            return None
        except Exception as error:
            return self.back_off.failed(error)

    def path(self, key: bytes) -> Path:
        return entry_path(self.root, self.rank_fingerprint, key)

    def write(self, key: bytes, payload: memoryview, check: int | None = None) -> None:
        """Write one entry atomically (temporary file, then rename). Raises OSError. ``check``: the
        payload's checksum, where it was taken already."""
        path = self.path(key)
        parent = str(path.parent)
        if parent not in self._made_dirs:
            _make_dirs(self.root, path.parent)
            with self._lock:
                self._made_dirs.add(parent)
        header = encode_header(self.rank_fingerprint, key, payload, self.mac_key, check)
        temporary = f"{path}.{self._writer_id}.{threading.get_ident()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(temporary, flags, _FILE_MODE)
        except FileNotFoundError:  # the directory was deleted under us: made again, owner-only
            _make_dirs(self.root, path.parent)
            fd = os.open(temporary, flags, _FILE_MODE)
        try:
            try:
                # A short write is continued: a filesystem that fills meanwhile raises ENOSPC then.
                pwritev_all(fd, [memoryview(header), memoryview(payload).cast("B")], 0)
            finally:
                os.close(fd)
            os.replace(temporary, path)  # the entry appears whole, or not at all
        except BaseException:
            _unlink_quietly(temporary)
            raise

    def read(self, key: bytes, out: memoryview, check: bool = True) -> Miss | int | None:
        """Read one entry into ``out``; None on success, else why it is a miss. ``check`` False: the
        caller checks the payload's checksum (``kvtier.common.entry.check_entry``).

        On failure ``out`` holds garbage and must not be used.
        """
        header = bytearray(HEADER_BYTES)
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return gone("missing")
        except OSError as error:
            return bad(f"unreadable: {error}")
        try:
            size = os.fstat(fd).st_size
            if size != HEADER_BYTES + len(out):
                return bad(f"truncated or wrong size ({size} bytes)")
            got = os.readv(fd, [header, out])
        except OSError as error:
            return bad(f"unreadable: {error}")
        finally:
            os.close(fd)
        if got != HEADER_BYTES + len(out):
            return bad(f"truncated ({got} bytes read)")
        return check_entry(bytes(header), out, self.rank_fingerprint, key, len(out), self.mac_key, check)


def _make_dirs(root: Path, path: Path) -> None:
    """Make ``path`` and every missing folder up to it owner-only (``os.makedirs`` would give the
    folders above the last one the umask's mode). A folder that is a symbolic link is refused."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=_DIR_MODE)
        except FileExistsError:  # another writer made it meanwhile
            pass
    if path != root and path.is_symlink():
        raise OSError(f"{path} is a symbolic link; kvtier does not follow links under its directory")


def _unlink_quietly(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already, or not a file kvtier wrote: either way not an entry any more
        pass
