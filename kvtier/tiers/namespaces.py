"""Namespace records: how each instance keys its blocks, kept beside the entries. Torch-free.

Block keys are chained from the namespace fingerprint (``kvtier.common.keys``), so an instance
with another model, dtype, block size, layout or tensor-parallel size never finds another's
entries, and from its own keys alone such a miss looks like a prompt never stored. So each
instance leaves a record of its namespace (plain JSON, owner-only) in every directory it
writes entries to: ``<disk_dir>/namespaces/`` and ``<shared dir>/namespaces/``. With them:

- ``kvtier doctor`` keys a prompt the way any recorded instance does, and names the
  fields in which two instances differ;
- ``ForeignProbe`` tells, off the scheduler's thread, whether the block at which a lookup
  missed is held under another recorded namespace: the miss reason "namespace_differs".
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Sequence

from kvtier.common.keys import Namespace, block_keys

logger = logging.getLogger("kvtier.tiers.namespaces")

FOLDER = "namespaces"
MAX_FOREIGN = 8  # the newest records probed; older ones are not
RELOAD_S = 30.0  # records of instances started since are seen within this


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file, renamed), readable by the owner only."""
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as out:
        out.write(data)
    os.replace(temporary, path)


def record_of(namespace: Namespace, rank_fingerprints: Sequence[bytes], slot_bytes: int) -> dict:
    return {"fingerprint": namespace.fingerprint().hex(),
            "rank_fingerprints": [fp.hex() for fp in rank_fingerprints], "slot_bytes": slot_bytes,
            "namespace": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(namespace).items()}}


def write_record_in(root: str, record: dict) -> str:
    """``<root>/namespaces/<fingerprint>.json``; its modification time says when it was last written."""
    folder = os.path.join(root, FOLDER)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, f"{record['fingerprint']}.json")
    write_private(path, json.dumps(record, indent=1).encode())
    return path


def read_records_in(roots: Sequence[str]) -> list[dict]:
    """The records found under ``roots``, newest first, one per fingerprint. Records that are not
    well-formed are skipped: they are hints, never trusted for bytes (entries carry their own checks)."""
    found: dict[str, tuple[float, dict]] = {}
    for root in roots:
        folder = os.path.join(root, FOLDER)
        try:
            names = [n for n in os.listdir(folder) if n.endswith(".json")]
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as stream:
                    record = json.loads(stream.read(1 << 20))
                when = os.stat(path).st_mtime
            except (OSError, ValueError):
                continue
            if not well_formed(record):
                continue
            if record["fingerprint"] not in found or found[record["fingerprint"]][0] < when:
                found[record["fingerprint"]] = (when, record)
    return [record for _, record in sorted(found.values(), key=lambda item: -item[0])]


def write_all(specs, record: dict) -> list[str]:
    """Leave ``record`` in every tier that keeps records; returns where it could not, and why."""
    from kvtier.tiers.registry import write_record

    failed = []
    for spec in specs:
        try:
            if write_record(spec, record) is False:
                failed.append(f"{spec.name}: not stored")
        except Exception as error:  # a tier's own trouble is reported by the tier; a record is a diagnosis
            failed.append(f"{spec.name}: {error}")
    return failed


def read_all(specs) -> list[dict]:
    """The records every tier keeps, one per fingerprint: directories' newest first, then pools'."""
    from kvtier.tiers.registry import read_records

    found: dict[str, dict] = {}
    for spec in specs:
        try:
            for record in read_records(spec):
                found.setdefault(record["fingerprint"], record)
        except Exception as error:
            logger.debug("kvtier: namespace records of %s not read: %s", spec.name, error)
    return list(found.values())


def well_formed(record) -> bool:
    try:
        bytes.fromhex(record["fingerprint"])
        [bytes.fromhex(fp) for fp in record["rank_fingerprints"]]
        int(record["slot_bytes"]), int(record["namespace"]["block_size"])
        return int(record["namespace"]["block_size"]) > 0
    except (ValueError, KeyError, TypeError):
        return False


def differences(ours: dict, theirs: dict) -> list[str]:
    """The namespace fields in which two records differ, e.g. ``["block_size: 32 here, 16 there"]``."""
    a, b = ours["namespace"], theirs["namespace"]
    return [f"{field}: {a.get(field)!r} here, {b.get(field)!r} there"
            for field in sorted(set(a) | set(b)) if a.get(field) != b.get(field)]


def key_at(record: dict, token_ids: Sequence[int], token: int, extra_keys: Sequence = ()) -> bytes | None:
    """The key under which ``record``'s instance holds the full block of ``token_ids`` that
    covers position ``token``; None where that block is not full."""
    block_size = int(record["namespace"]["block_size"])
    index = token // block_size
    if (index + 1) * block_size > len(token_ids):
        return None
    return block_keys(bytes.fromhex(record["fingerprint"]), token_ids[:(index + 1) * block_size], block_size,
                      extra_keys)[index]


class ForeignProbe:
    """Whether a missed block is held under another recorded namespace, answered on a thread of
    its own (record reads, key chains and tier checks never run on the scheduler's thread).

    It first leaves this instance's own record in every tier that keeps records, and again
    every ``RELOAD_S``, when it also reads the others' again. ``submit`` queues one miss (at
    most ``max_queued``; past that, or with no foreign record, it returns False and the caller
    counts the miss as never stored at once). Each answer comes back through ``take`` as
    (reason, tokens): "namespace_differs" or "never_stored".
    """

    def __init__(self, specs, own_record: dict, timeout_s: float, max_queued: int = 256):
        self._specs = list(specs)
        self._own = own_record
        self._timeout_s = timeout_s
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._answers: deque = deque()
        self._foreign: list[dict] = []
        self._loaded_at = -RELOAD_S
        self.num_probed = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-namespace-probe", daemon=True)
        if self._specs:
            self._thread.start()

    @property
    def foreign(self) -> list[dict]:
        return self._foreign

    def submit(self, token_ids: Sequence[int], token: int, extra_keys: Sequence, tokens_missed: int) -> bool:
        if not self._foreign or not self._thread.is_alive():
            return False
        try:
            self._queue.put_nowait((list(token_ids), token, tuple(extra_keys), tokens_missed))
        except queue.Full:
            return False
        return True

    def take(self) -> list[tuple[str, int]]:
        taken = []
        while self._answers:
            taken.append(self._answers.popleft())
        return taken

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            try:
                self._queue.put_nowait(None)  # wakes it now; a full queue is left at its next job
            except queue.Full:
                pass
            self._thread.join(timeout=self._timeout_s + 1)

    def _reload(self) -> None:
        """This instance's record left again (a pool may have let it expire), the others' read."""
        failed = write_all(self._specs, self._own)
        if failed and self._loaded_at < 0:
            logger.warning("kvtier: namespace record not left in %s", "; ".join(failed))
        own = self._own["fingerprint"]
        self._foreign = [r for r in read_all(self._specs) if r["fingerprint"] != own and well_formed(r)][:MAX_FOREIGN]
        self._loaded_at = time.monotonic()

    def _run(self) -> None:
        from kvtier.tiers.registry import release_outside

        try:
            self._serve()
        finally:
            for spec in self._specs:
                release_outside(spec)

    def _serve(self) -> None:
        while True:
            if time.monotonic() - self._loaded_at > RELOAD_S:  # at start (this instance's own record
                try:  # first), then every RELOAD_S: records expire in pools, instances come and go
                    self._reload()
                except Exception as error:  # a tier's trouble is its own to report; probing goes on
                    logger.warning("kvtier: namespace records not read: %s", error)
                    self._loaded_at = time.monotonic()
            try:
                job = self._queue.get(timeout=RELOAD_S)
            except queue.Empty:
                continue
            if job is None or self._closed.is_set():
                return
            token_ids, token, extra_keys, tokens_missed = job
            try:
                reason = "namespace_differs" if self._held_elsewhere(token_ids, token, extra_keys) else "never_stored"
            except Exception as error:  # a probe is a diagnosis: its failure is logged, never raised
                logger.warning("kvtier: namespace probe failed: %s", error)
                reason = "never_stored"
            self.num_probed += 1
            self._answers.append((reason, tokens_missed))

    def _held_elsewhere(self, token_ids, token, extra_keys) -> bool:
        from kvtier.tiers.registry import held_from_outside

        for record in self._foreign:
            key = key_at(record, token_ids, token, extra_keys)
            if key is None:
                continue
            ranks = [bytes.fromhex(fp) for fp in record["rank_fingerprints"]]
            for spec in self._specs:
                if held_from_outside(spec, int(record["slot_bytes"]), ranks, [key]):
                    return True
        return False
