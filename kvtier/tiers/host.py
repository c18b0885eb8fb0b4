"""Host pool, the first tier: which block is in which slot. Torch-free.

This class runs in the scheduler and holds no tensor. The slots' bytes live in the
worker (``kvtier.transfer.host_buffer``); both sides agree on ``num_slots`` and on
slot ids, which travel in the plans.

A slot is free, being written (pinned by its writer, not yet readable) or ready.
A ready slot may be pinned by loads reading it. Only ready, unpinned slots are in
the LRU list, so eviction never touches a slot that a transfer reads or writes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StorePlan:
    """Keys to write and the slots reserved for them (both in order)."""

    keys: list[bytes]
    slot_ids: list[int]


class HostPoolIndex:
    """Slot allocator, key index, pins and LRU eviction of the host pool."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"the host pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free_slot_ids: list[int] = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[bytes, int] = {}
        self._key_of: list[bytes | None] = [None] * num_slots
        self._ready = bytearray(num_slots)
        self._pins = [0] * num_slots
        self._num_pins = 0  # sum of _pins, and slots with a pin: kept as counters, read every step
        self._num_pinned = 0
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ready, unpinned; oldest first
        self.num_evictions = 0
        self.holdings: list | None = None  # ("stored" | "evicted" | "damaged", "host", key), as in ``TierIndex``

    # --- queries -------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` whose blocks are ready in the pool; marks them used."""
        hits = 0
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None or not self._ready[slot]:
                break
            if slot in self._evictable:
                self._evictable.move_to_end(slot)
            hits += 1
        return hits

    def contains(self, key: bytes) -> bool:
        """True if ``key`` is ready or being written (a store of it would be redundant)."""
        return key in self._slot_of

    def is_being_written(self, key: bytes) -> bool:
        """True if ``key`` has a slot whose writer has not completed it yet."""
        slot = self._slot_of.get(key)
        return slot is not None and not self._ready[slot]

    def is_evictable(self, key: bytes) -> bool:
        """True if ``key`` is ready and unpinned: a store could evict it now."""
        slot = self._slot_of.get(key)
        return slot is not None and slot in self._evictable

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free_slot_ids)

    @property
    def num_available(self) -> int:
        """Slots a store could get now: free ones plus evictable ones."""
        return len(self._free_slot_ids) + len(self._evictable)

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    @property
    def num_pins(self) -> int:
        return self._num_pins

    # --- loads ---------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the ready slots of ``keys`` for reading and return them.

        Raises KeyError (changing nothing) if a key is not ready. The slots stay
        protected from eviction until ``complete_load``.
        """
        slot_ids = []
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None or not self._ready[slot]:
                raise KeyError(key.hex())
            slot_ids.append(slot)
        for slot in slot_ids:
            self._pin(slot)
        return slot_ids

    def complete_load(self, slot_ids: Sequence[int]) -> None:
        """Release the pins that ``prepare_load`` took."""
        for slot in slot_ids:
            self._unpin(slot)

    # --- stores --------------------------------------------------------------
    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Reserve slots for the ``keys`` not yet in the pool, evicting LRU blocks.

        Returns None, changing nothing, if every key is already present or there
        are not enough free or evictable slots. The reserved slots are pinned and unreadable until ``complete_store``.
        """
        new_keys = list(dict.fromkeys(k for k in keys if k not in self._slot_of))
        if not new_keys or len(new_keys) > len(self._free_slot_ids) + len(self._evictable):
            return None
        while len(self._free_slot_ids) < len(new_keys):
            self._evict_one()
        # Ascending, so that slots freed together (pushed in order, popped reversed) form
        # runs again: a run of consecutive slots moves in one copy (one DMA on CUDA).
        taken = sorted(self._free_slot_ids.pop() for _ in new_keys)
        slot_ids = []
        for key, slot in zip(new_keys, taken):
            self._slot_of[key] = slot
            self._key_of[slot] = key
            self._pin(slot)  # the writer's pin, until complete_store
            slot_ids.append(slot)
        return StorePlan(new_keys, slot_ids)

    def complete_store(self, slot_ids: Sequence[int], success: bool) -> None:
        """Make written slots readable, or on failure free them and forget their keys."""
        for slot in slot_ids:
            if success:
                self._ready[slot] = 1
                self._unpin(slot)
                if self.holdings is not None:
                    self.holdings.append(("stored", "host", self._key_of[slot]))
            else:
                self._unpin(slot)
                if self._pins[slot] == 0:
                    self._free(slot)

    def discard(self, key: bytes) -> None:
        """Forget a ready, unpinned block (e.g. found corrupt). Pinned blocks stay."""
        slot = self._slot_of.get(key)
        if slot is not None and self._ready[slot] and self._pins[slot] == 0:
            self._evictable.pop(slot, None)
            self._free(slot, "damaged")

    # --- internals -----------------------------------------------------------
    def _pin(self, slot: int) -> None:
        if self._pins[slot] == 0:
            self._evictable.pop(slot, None)
            self._num_pinned += 1
        self._pins[slot] += 1
        self._num_pins += 1

    def _unpin(self, slot: int) -> None:
        if self._pins[slot] <= 0:
            raise RuntimeError(f"slot {slot} released more often than pinned")
        self._pins[slot] -= 1
        self._num_pins -= 1
        if self._pins[slot] == 0:
            self._num_pinned -= 1
            if self._ready[slot]:
                self._evictable[slot] = None

    def _evict_one(self) -> None:
        slot, _ = self._evictable.popitem(last=False)
        self._free(slot, "evicted")
        self.num_evictions += 1

    def _free(self, slot: int, why: str = "evicted") -> None:
        key = self._key_of[slot]
        if key is not None and self._ready[slot] and self.holdings is not None:
            self.holdings.append((why, "host", key))  # it was loadable: say that it is no more, and why
        if key is not None:
            del self._slot_of[key]
        self._key_of[slot] = None
        self._ready[slot] = 0
        self._free_slot_ids.append(slot)
