"""kvtier's tiers in vLLM's KV cache events, so KV-aware routers see them.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` for its device cache; the scheduler
adds what its connector's ``take_events`` returns. What is announced, and where
(``medium``, ``locality``, ``ownership``), is the core's (``kvtier.scheduler.announcements``);
this module gives each block vLLM's own block hashes, parent hash, token ids, block size,
LoRA and extra keys, and makes vLLM's events of them, so a router that reads vLLM's events
needs no change.

A block's vLLM metadata is taken from its request when kvtier keys it; only blocks with
metadata (full blocks that kvtier keyed in this process) are announced: not the partial
ones, which vLLM does not hash. Fields a vLLM release lacks (``locality``, ``ownership``
before 0.32) are left out.

A tier whose server publishes its blocks' events for every engine (the node server,
``kvtier.node.events``) is handed this engine's events of the blocks it stored there, encoded
as vLLM encodes them; the engine publishes none of its own for that tier.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from kvtier.scheduler.announcements import Announcements


class BlockMeta(NamedTuple):  # journaled as its fields, in this order
    block_hash: object  # vLLM's external form (bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent_hash: object
    token_ids: tuple
    lora_id: int | None
    lora_name: str | None
    extra_keys: object


def meta_of(fields: list) -> BlockMeta | None:
    """A journal record's fields as a block's metadata; None for a record of another shape."""
    if len(fields) != len(BlockMeta._fields) or not isinstance(fields[2], (list, tuple)):
        return None
    return BlockMeta(fields[0], fields[1], tuple(fields[2]), *fields[3:])


class KVEvents:
    """Builds vLLM events from kvtier's holdings. Lives in the scheduler; one thread."""

    def __init__(self, specs, max_unheld: int = 100_000, journals=None, held: Announcements | None = None,
                 rank_fingerprint: bytes | None = None):
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        self._stored, self._removed = BlockStored, BlockRemoved
        fields = set(getattr(BlockStored, "__struct_fields__", ()))
        self._has_locality = "locality" in fields and "ownership" in fields
        self.held = held or Announcements(specs, max_unheld, journals)
        # Tiers whose server publishes their events once for every engine: (tier name -> its sender).
        self._servers = {spec.name: spec.kind.announcer(spec, rank_fingerprint) for spec in specs
                         if spec.kind.announcer is not None and rank_fingerprint is not None}

    @classmethod
    def of(cls, manager) -> "KVEvents":
        """Events for ``manager``'s (a ``TierManager``'s) tiers (``Announcements.of``)."""
        return cls(manager.specs, held=Announcements.of(manager, meta_of),
                   rank_fingerprint=manager.rank_fingerprints[0])

    def remember(self, request, keys: list[bytes], first_block: int, block_size: int) -> None:
        """vLLM's metadata of ``keys``, the request's blocks from ``first_block`` on."""
        hashes = getattr(request, "block_hashes", None) or []
        lora = getattr(request, "lora_request", None)
        for i, key in enumerate(keys, start=first_block):
            if i >= len(hashes) or self.held.knows(key):
                continue
            self.held.remember(key, BlockMeta(
                _external(hashes[i]), _external(hashes[i - 1]) if i else None,
                tuple(request.all_token_ids[i * block_size:(i + 1) * block_size]),
                getattr(lora, "adapter_id", getattr(lora, "lora_int_id", None)) if lora else None,
                getattr(lora, "lora_name", None) if lora else None, _extra_keys(request, i, block_size)))

    def events(self, holdings: list[tuple[str, str, bytes]], block_size: int) -> list:
        """vLLM's events for ``holdings`` (``Announcements.take``)."""
        if self._servers:
            holdings = self._hand_over(holdings, block_size)
        return [self._event(*told, block_size) for told in self.held.take(holdings)]

    def _hand_over(self, holdings: list[tuple[str, str, bytes]], block_size: int) -> list[tuple[str, str, bytes]]:
        """The holdings of tiers whose server publishes their events: a stored block's two events (its
        storage, and its removal for the server to publish when it goes) go to the server; the rest
        are this engine's to publish."""
        told: dict[str, list] = {}
        rest = []
        for kind, tier, key in holdings:
            if tier not in self._servers:
                rest.append((kind, tier, key))
            elif kind == "stored" and (meta := self.held.meta(key)) is not None:
                place = self.held.place(tier)
                told.setdefault(tier, []).append((key, msgspec.msgpack.encode(self._event(True, meta, place, block_size)),
                                                  msgspec.msgpack.encode(self._event(False, meta, place, block_size))))
        for tier, events in told.items():
            self._servers[tier](events)
        return rest

    def announce_journal(self, block_size: int) -> list:
        """The blocks a previous process left in the tiers that list theirs: a batch per tier per call."""
        return [self._event(*told, block_size) for told in self.held.take_journaled()]

    def _event(self, stored: bool, meta: BlockMeta, place, block_size: int):
        where = {"locality": place.locality, "ownership": place.ownership} if self._has_locality else {}
        if not stored:
            return self._removed(block_hashes=[meta.block_hash], medium=place.medium, **where)
        return self._stored(block_hashes=[meta.block_hash], parent_block_hash=meta.parent_hash,
                            token_ids=list(meta.token_ids), block_size=block_size, lora_id=meta.lora_id,
                            medium=place.medium, lora_name=meta.lora_name, extra_keys=meta.extra_keys, **where)

    def take(self, ledger, block_size: int) -> list:
        """A step's events: what the disk held at start (a batch a step), then what changed."""
        return self.announce_journal(block_size) + self.events(ledger.take_holdings(), block_size)

    def close(self) -> None:
        self.held.close()
        for server in self._servers.values():
            server.close()

    @property
    def num_tracked(self) -> int:
        return self.held.num_tracked


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
