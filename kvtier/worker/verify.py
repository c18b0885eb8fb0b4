"""Test mode (``verify_loads``): every loaded block is compared with what was stored.

The worker tells the verifier what each host slot received (a device block copied
in, an entry read from a tier); after a load, the verifier reads the device
blocks back and compares checksums. It wraps the worker from outside: the worker
calls three hooks and knows nothing else of it.
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
