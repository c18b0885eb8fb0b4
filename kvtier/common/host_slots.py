"""How slots lie in the host pool's memory. Torch-free: the I/O process maps the pool too.

A slot holds one block's bytes. A slot may have a head: ``head_bytes`` (an entry header,
``kvtier.common.entry.HEADER_BYTES``) right before its bytes, where a store writes and checks the
header of the entry the slot holds. An entry (header, then block) is then one run of
memory, which a storage pool moves in one piece: a Mooncake value put from or got into
two buffers costs a second transfer descriptor per entry (``kvtier bench pool`` shows the
gap to the raw client, which puts one buffer).

The CPU worker's slots have heads. The CUDA worker's do not: runs of adjacent slots there
move in one DMA copy each, which a head between slots would split; its stores keep the
headers apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HostSlots:
    num_slots: int
    slot_bytes: int
    head_bytes: int = 0

    @property
    def pitch(self) -> int:
        """Bytes from one slot's start (its head's) to the next's."""
        return self.head_bytes + self.slot_bytes

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.pitch

    def views(self, memory) -> tuple[np.ndarray, np.ndarray | None]:
        """(``[num_slots, slot_bytes]`` slots, ``[num_slots, head_bytes]`` heads or None) over
        ``memory``, a writable buffer of at least ``num_bytes``."""
        rows = np.frombuffer(memory, np.uint8, count=self.num_bytes).reshape(self.num_slots, self.pitch)
        return rows[:, self.head_bytes:], (rows[:, :self.head_bytes] if self.head_bytes else None)


def num_host_slots(host_bytes: int, slot_bytes: int) -> int:
    """Both sides size the host pool with this, so they agree on slot ids."""
    return host_bytes // slot_bytes
