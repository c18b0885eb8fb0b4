"""The node's local disk: one file per entry, written once for every engine of the node.

Layout: ``<dir>/<namespace>/<key hex[:2]>/<key hex>`` for a block's entry
(``kvtier/<namespace>/<key hex>``), ``<dir>/_/<name as hex>`` for any other name. A file is
written to a temporary name and renamed into place, so a reader sees a whole entry or none (its
header's checksum is checked by the client that loads it). Files and folders are created readable
by their owner only. Least recently used entries are deleted beyond ``max_bytes``; the list is
read back from the directory when the server starts, so the disk outlives the server too.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

from kvtier.tiers.base import WriteBackOff, pwritev_all

logger = logging.getLogger("kvtier.node")

_PLAIN = re.compile(r"^[0-9a-f]{2,64}$")


def relative_path(name: str) -> str:
    parts = name.split("/")
    if len(parts) == 3 and parts[0] == "kvtier" and _PLAIN.match(parts[1]) and _PLAIN.match(parts[2]):
        return os.path.join(parts[1], parts[2][:2], parts[2])
    return os.path.join("_", name.encode().hex())


def name_of(relative: str) -> str | None:
    parts = relative.split(os.sep)
    if len(parts) == 3 and all(_PLAIN.match(p) for p in (parts[0], parts[2])) and parts[2][:2] == parts[1]:
        return f"kvtier/{parts[0]}/{parts[2]}"
    if len(parts) == 2 and parts[0] == "_":
        try:
            return bytes.fromhex(parts[1]).decode()
        except ValueError:
            return None
    return None


class NodeDisk:
    """Thread-safe: the server's disk writers and its connections' reads use it side by side."""

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recently used first
        self.num_bytes = 0
        self.backoff = WriteBackOff()
        self.num_write_failures = self.num_evictions = 0
        self._scan()

    def _scan(self) -> None:
        found = []
        for folder, _, files in os.walk(self.root):
            for file in files:
                path = os.path.join(folder, file)
                if ".tmp" in file:  # a write cut short by a crash: never an entry
                    os.unlink(path)
                    continue
                name = name_of(os.path.relpath(path, self.root))
                if name is not None:
                    stat = os.stat(path)
                    found.append((stat.st_mtime, name, stat.st_size))
        for _, name, size in sorted(found):  # oldest first: least recently used
            self._sizes[name] = size
            self.num_bytes += size
        self._evict()

    def stats(self) -> dict:
        return {"dir": str(self.root), "entries": self.num_entries, "bytes": self.num_bytes,
                "max_bytes": self.max_bytes, "evictions": self.num_evictions, "write_failures": self.num_write_failures}

    def names(self) -> list[str]:
        with self._lock:
            return list(self._sizes)

    def has(self, name: str) -> bool:
        return name in self._sizes

    def size(self, name: str) -> int | None:
        return self._sizes.get(name)

    def write(self, name: str, pieces: list[memoryview]) -> tuple[bool, list[str]]:
        """Write an entry from ``pieces``; (written, names deleted to stay within the bound)."""
        if self.backoff.skipped() is not None:
            return False, []
        path = self.root / relative_path(name)
        temporary = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        size = sum(piece.nbytes for piece in pieces)
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                pwritev_all(fd, list(pieces), 0)
            finally:
                os.close(fd)
            os.replace(temporary, path)
        except OSError as error:
            self.num_write_failures += 1
            self.backoff.failed(error)
            temporary.unlink(missing_ok=True)
            return False, []
        with self._lock:
            self.num_bytes += size - self._sizes.pop(name, 0)
            self._sizes[name] = size
            return True, self._evict()

    def read_into(self, name: str, pieces: list[memoryview]) -> bool:
        """Fill ``pieces`` from the entry's file; False where it is gone or not exactly that long."""
        want = sum(piece.nbytes for piece in pieces)
        try:
            with open(self.root / relative_path(name), "rb", buffering=0) as file:
                if os.fstat(file.fileno()).st_size != want:
                    return False
                for piece in pieces:
                    got = 0
                    while got < piece.nbytes:
                        n = file.readinto(piece[got:])
                        if not n:
                            return False
                        got += n
        except OSError:
            with self._lock:  # deleted by hand, or unreadable: no longer held
                self.num_bytes -= self._sizes.pop(name, 0)
            return False
        with self._lock:
            if name in self._sizes:
                self._sizes.move_to_end(name)
        return True

    def _evict(self) -> list[str]:
        """Under the lock: delete the least recently used entries beyond the bound."""
        deleted = []
        while self.num_bytes > self.max_bytes and self._sizes:
            name, size = self._sizes.popitem(last=False)
            self.num_bytes -= size
            (self.root / relative_path(name)).unlink(missing_ok=True)
            self.num_evictions += 1
            deleted.append(name)
        return deleted

    @property
    def num_entries(self) -> int:
        return len(self._sizes)
