"""kvtier's tiers in vLLM's KV cache events, so KV-aware routers see them.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` for its device cache; the scheduler
adds what its connector's ``take_events`` returns. This module turns the manager's
holdings log (a block became loadable from a tier, or stopped being) into the same
events, under vLLM's own block hashes, parent hash, token ids, block size, LoRA and
extra keys, so a router that reads vLLM's events needs no change:

- ``medium``: ``CPU`` for the host pool, and the medium each tier declares (``STORAGE``
  for the disk, a shared directory and the storage pools);
- ``locality``: ``LOCAL`` for this instance's own tiers, ``REMOTE`` for those its kind
  declares shared;
- ``ownership``: ``kvtier:<tier>``, and for a shared tier ``kvtier:<tier>:<pool>``
  (its address, no password), the same string on every instance that reads it.

A block's vLLM metadata is taken from its request when kvtier keys it, and kept while a
tier of this instance holds the block (for its removal), plus the last ``max_unheld``
others; only blocks with metadata (full blocks that kvtier keyed in this process) are
announced: not the partial ones, which vLLM does not hash.
Fields a vLLM release lacks (``locality``, ``ownership`` before 0.32) are left out.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

@dataclass(frozen=True)
class BlockMeta:
    block_hash: object  # vLLM's external form (bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent_hash: object
    token_ids: tuple
    lora_id: int | None
    lora_name: str | None
    extra_keys: object


class KVEvents:
    """Builds vLLM events from kvtier's holdings. Lives in the scheduler; one thread."""

    def __init__(self, specs, max_unheld: int = 100_000, journals: "dict[str, DiskJournal] | None" = None):
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        self._stored, self._removed = BlockStored, BlockRemoved
        fields = set(getattr(BlockStored, "__struct_fields__", ()))
        self._has_locality = "locality" in fields and "ownership" in fields
        self._where = {"host": ("CPU", "LOCAL", "kvtier:host")}
        self._shared = {spec.name for spec in specs if spec.kind.shared}  # ``specs``: the tiers' ``TierSpec``s
        for spec in specs:
            shared = spec.name in self._shared
            self._where[spec.name] = (spec.kind.medium, "REMOTE" if shared else "LOCAL",
                                      f"kvtier:{spec.name}:{spec.kind.address(spec)}" if shared else
                                      f"kvtier:{spec.name}")
        self._meta: dict[bytes, BlockMeta] = {}
        self._held_in: dict[bytes, set[str]] = {}  # announced in a local tier: key -> those tiers
        # Keys with metadata that no local tier holds, oldest first: at most ``max_unheld`` of them.
        # A held key's metadata is kept until its last removal is told (a router must hear it).
        self._unheld: OrderedDict[bytes, None] = OrderedDict()
        self.max_unheld = max_unheld
        # Per tier that lists its entries across restarts (the disk): its blocks' metadata, for a
        # restart to announce them.
        self.journals = journals or {}

    @classmethod
    def of(cls, manager) -> "KVEvents":
        """Events for ``manager``'s (a ``TierManager``'s) tiers; a tier that lists its entries across
        restarts (``TierIndex.listing``) keeps a journal beside them, so that a restart announces them."""
        listings = {tier.name: tier.listing() for tier in manager.tiers}
        return cls(manager.specs, journals={name: DiskJournal(*listing) for name, listing in listings.items()
                                            if listing is not None})

    def remember(self, request, keys: list[bytes], first_block: int, block_size: int) -> None:
        """vLLM's metadata of ``keys``, the request's blocks from ``first_block`` on."""
        hashes = getattr(request, "block_hashes", None) or []
        lora = getattr(request, "lora_request", None)
        for i, key in enumerate(keys, start=first_block):
            if key in self._meta or i >= len(hashes):
                continue
            self._meta[key] = BlockMeta(
                _external(hashes[i]), _external(hashes[i - 1]) if i else None,
                tuple(request.all_token_ids[i * block_size:(i + 1) * block_size]),
                getattr(lora, "adapter_id", getattr(lora, "lora_int_id", None)) if lora else None,
                getattr(lora, "lora_name", None) if lora else None, _extra_keys(request, i, block_size))
            self._unheld[key] = None
        while len(self._unheld) > self.max_unheld:
            del self._meta[self._unheld.popitem(last=False)[0]]

    def events(self, holdings: list[tuple[str, str, bytes]], block_size: int, announcing: bool = False) -> list:
        """Events for ``holdings``. A shared tier's blocks are announced but not tracked (other
        instances and the pool's own eviction change them unseen): only an entry that a load found
        damaged or gone is told as removed; this instance's own tiers are told both ways."""
        out = []
        for kind, tier, key in holdings:
            meta = self._meta.get(key)
            if meta is None or tier not in self._where:
                continue
            medium, locality, ownership = self._where[tier]
            where = {"locality": locality, "ownership": ownership} if self._has_locality else {}
            shared = tier in self._shared
            journal = self.journals.get(tier)
            if kind == "stored":
                out.append(self._stored(block_hashes=[meta.block_hash], parent_block_hash=meta.parent_hash,
                                        token_ids=list(meta.token_ids), block_size=block_size, lora_id=meta.lora_id,
                                        medium=medium, lora_name=meta.lora_name, extra_keys=meta.extra_keys,
                                        **where))
                if not shared:
                    self._held_in.setdefault(key, set()).add(tier)
                    self._unheld.pop(key, None)
                if journal is not None and not announcing:
                    journal.append(key, meta)
            elif shared or tier in self._held_in.get(key, ()):
                out.append(self._removed(block_hashes=[meta.block_hash], medium=medium, **where))
                if journal is not None:
                    journal.drop(key)
                tiers = self._held_in.get(key)
                if tiers is not None:
                    tiers.discard(tier)
                    if not tiers:
                        del self._held_in[key]
                        self._unheld[key] = None  # newest: its metadata may serve a next store
        return out

    def announce_journal(self, block_size: int) -> list:
        """The blocks a previous process left in the tiers that list theirs, from their journals: a
        batch per tier per call."""
        out = []
        for tier, journal in self.journals.items():
            found = journal.take_found()
            for key, meta in found:
                self._meta.setdefault(key, meta)
            out += self.events([("stored", tier, key) for key, _ in found], block_size, announcing=True)
        return out

    def close(self) -> None:
        for journal in self.journals.values():
            journal.close()

    @property
    def num_tracked(self) -> int:
        return len(self._meta)


def _external(block_hash):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(block_hash)


def _extra_keys(request, block: int, block_size: int):
    """vLLM's per-block extra keys (LoRA name, cache salt), as its own events carry them."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    except ImportError:  # an older release: its events carry none either
        return None
    extra, _ = generate_block_hash_extra_keys(request, block * block_size, (block + 1) * block_size, 0)
    return to_event_extra_keys([extra])


class DiskJournal:
    """What a restart needs to announce a disk tier's blocks: vLLM's metadata of each block
    written to it, appended to ``<disk tier file>.events`` (msgpack records, never pickled) on
    a thread of its own, never the scheduler's. At start the journal is read on that thread,
    kept to the blocks the disk still holds (rewritten), and those are announced, ``batch`` at
    a time, with the engine's next steps."""

    def __init__(self, path, held_keys: set[bytes], batch: int = 1000):
        import queue
        import threading

        self.path = str(path)
        self.batch = batch
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._found: list[tuple[bytes, BlockMeta]] = []  # read back at start, to announce
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(held_keys,), name="kvtier-events-journal",
                                        daemon=True)
        self._thread.start()

    def append(self, key: bytes, meta: BlockMeta) -> None:
        self._writes.put((key, meta))

    def drop(self, key: bytes) -> None:
        """The disk no longer holds ``key``: the next rewrite leaves it out."""
        self._writes.put((key, None))

    def take_found(self) -> list[tuple[bytes, BlockMeta]]:
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
        found: dict[bytes, BlockMeta] = {}
        try:
            with open(self.path, "rb") as journal:
                # A block stored again since the last rewrite has a record each time: the last one stands,
                # and the block is announced once.
                for record in _records(journal):
                    key, *fields = record
                    if isinstance(key, bytes) and key in held_keys and len(fields) == 6:
                        meta = BlockMeta(fields[0], fields[1], tuple(fields[2]), fields[3], fields[4], fields[5])
                        live[key] = _frame(encoder, key, meta)
                        found[key] = meta
        except (OSError, ValueError, msgspec.DecodeError):  # none yet, or cut short: what was read stands
            pass
        with self._lock:
            self._found.extend(found.items())
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
        from kvtier.common.namespaces import write_private

        write_private(self.path, b"".join(live.values()))
        return os.fdopen(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW), "wb")


def _frame(encoder, key: bytes, meta: BlockMeta) -> bytes:
    body = encoder.encode([key, meta.block_hash, meta.parent_hash, list(meta.token_ids), meta.lora_id,
                           meta.lora_name, meta.extra_keys])
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
