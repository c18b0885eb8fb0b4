"""A tier written against kvtier's tier contract alone (``kvtier.tiers.base``), installed as a
plugin (the ``kvtier.tiers`` entry point ``memo`` in the distribution beside it): ``memo://``
keeps entries in a dict in kvtier's I/O process. The index, in the scheduler, lists what it
wrote; the store keeps each entry's header and payload and checks them on the way back, as
every tier does, so that a damaged or foreign entry is a miss."""

from __future__ import annotations

import threading

from kvtier.common.entry import HEADER_BYTES, check_entry, encode_header
from kvtier.tiers.base import TierIndex, TierKind, TierStore, gone


class MemoIndex(TierIndex):
    def __init__(self, name: str):
        self.name = name
        self.held: set[bytes] = set()

    def lookup(self, keys, token):
        return [key in self.held for key in keys]

    def prepare_store(self, keys):
        return {key: -1 for key in keys if key not in self.held}

    def complete_store(self, written, failed=(), deleted=(), full=False):
        self.held.update(written)
        if self.holdings is not None:  # KV events and miss reasons hear of it
            self.holdings += [("stored", self.name, key) for key in written]

    def complete_load(self, keys, bad_keys, gone_keys=()):
        self.held.difference_update([*bad_keys, *gone_keys])
        if self.holdings is not None:
            self.holdings += [("damaged", self.name, key) for key in bad_keys]

    def stats(self):
        return {"entries": len(self.held)}


class MemoStore(TierStore):
    def __init__(self, rank_fingerprint: bytes):
        self.fingerprint = rank_fingerprint
        self.entries: dict[bytes, bytes] = {}  # key -> header and payload
        self.lock = threading.Lock()  # the I/O process runs a tier's jobs on several threads

    def read_into(self, keys, slot_ids, locations, deadline, check=True):
        reasons = []
        for key, slot in zip(keys, slot_ids):
            with self.lock:
                entry = self.entries.get(key)
            if entry is None:
                reasons.append(gone("not in memory"))
                continue
            out = memoryview(self.host[slot])
            out[:] = entry[HEADER_BYTES:]
            reasons.append(check_entry(entry[:HEADER_BYTES], out, self.fingerprint, key, len(out), self.mac_key,
                                       check))
        return reasons

    def write_from(self, keys, slot_ids, locations, deadline, checksums=None):
        for i, (key, slot) in enumerate(zip(keys, slot_ids)):
            payload = memoryview(self.host[slot])
            header = encode_header(self.fingerprint, key, payload, self.mac_key,
                                   None if checksums is None else checksums[i])
            with self.lock:
                self.entries[key] = header + payload.tobytes()
        return [None] * len(keys)


KIND = TierKind("memo", lambda spec, slot_bytes, ranks: MemoIndex(spec.name),
                lambda spec, rank_fingerprint, slot_bytes: MemoStore(rank_fingerprint), medium="CPU")
