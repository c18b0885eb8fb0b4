"""Test mode (``verify_loads``): every loaded block is compared with what was stored.

The verifier hears what each host slot received (a device block copied in, an
entry read from a tier); after a load, it reads the device blocks back and
compares checksums. It wraps the load and store paths from outside
(``VerifiedLoads``, ``VerifiedStores``, put together by ``kvtier.worker.wrappers``):
the paths themselves know nothing of it.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np
import torch

from kvtier.common.entry import checksum
from kvtier.common.layout import KVLayout

logger = logging.getLogger("kvtier.worker.verify")


class LoadVerifier:
    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], host_slots: np.ndarray):
        self.layout = layout
        self.tensors = tensors
        self.host_slots = host_slots
        self._expected: dict[int, int] = {}  # slot -> checksum of the bytes it received
        self._lock = threading.Lock()
        self.num_failures = 0

    def received(self, slot_ids: Sequence[int]) -> None:
        """These slots now hold a block (a store's copy, or a tier's read)."""
        sums = {slot: checksum(self.host_slots[slot]) for slot in slot_ids}
        with self._lock:
            self._expected.update(sums)

    def check(self, block_ids: Sequence[int], slot_ids: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        """Device blocks that differ from their slot's bytes (after the load's copy finished)."""
        scratch = np.empty((1, self.layout.slot_bytes), np.uint8)
        bad = []
        for block_id, slot_id, key in zip(block_ids, slot_ids, keys):
            with self._lock:
                expected = self._expected.get(slot_id)
            if expected is None:
                continue
            self._read_back(block_id, scratch)
            if checksum(scratch[0]) != expected:
                self.num_failures += 1
                logger.error("kvtier: loaded block %d (key %s) differs from what was stored", block_id, key.hex())
                bad.append(block_id)
        return bad

    def _read_back(self, block_id: int, scratch: np.ndarray) -> None:
        """Copy one device block into ``scratch`` in slot layout (synchronous)."""
        if self.tensors[0].is_cuda:
            from kvtier.transfer.cuda import segment_views
            views = segment_views(self.layout, self.tensors)  # the load's event was seen: its copies are done
            scratch[0] = torch.cat([view[block_id] for view in views]).cpu().numpy()
            return
        from kvtier._native import copy_runs
        addresses = [t.data_ptr() for t in self.tensors]
        dst, src, lengths = self.layout.copy_runs(addresses, scratch.ctypes.data, np.array([block_id]),
                                                  np.array([0]), to_host=True)
        copy_runs.copy(dst, src, lengths)

    # A part of the worker's wrapping (``kvtier.worker.wrappers``): nothing to poll, rebind or close.
    def poll(self) -> list:
        return []

    def rebind(self, tensors) -> None:
        return None

    def close(self, timeout_s: float) -> None:
        return None

    def counters(self) -> dict[str, int]:
        return {"verify_failures": self.num_failures}


class VerifiedLoads:
    """Around ``LoadPath``: what each read put in a slot is noted, and a load's copied blocks are
    read back and compared before it is reported."""

    verifier: LoadVerifier

    def _filled(self, load, blocks, slots, keys, reasons, sums=None) -> None:
        self.verifier.received([s for s, why in zip(slots, reasons) if why is None])  # before any copy reads them
        super()._filled(load, blocks, slots, keys, reasons, sums)

    def copied(self, load, result) -> None:
        if result.success and load.usable:  # the copies are done: the device blocks can be read back
            load.report.failed_block_ids += self.verifier.check(*zip(*load.usable))
        super().copied(load, result)


class VerifiedStores:
    """Around ``StorePath``: what a store's copy put in its slots is noted, before the writes go."""

    verifier: LoadVerifier

    def copied(self, store, result) -> None:
        with self.book.lock:
            raced = store.raced
        if result.success and not raced:
            self.verifier.received(store.job.slot_ids)
        super().copied(store, result)
