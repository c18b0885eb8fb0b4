"""The host pool's memory: one preallocated buffer cut into slots."""

from __future__ import annotations

import torch


def allocate_host_buffer(num_slots: int, slot_bytes: int, pin: bool) -> torch.Tensor:
    """A ``num_slots * slot_bytes`` uint8 buffer, pinned for CUDA, every page touched."""
    buffer = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, pin_memory=pin)
    buffer.zero_()  # fault every page in now, so that no copy into the pool pays for it
    return buffer
