"""The host pool's memory: one preallocated buffer cut into slots.

The worker's pool is ``SharedHostMemory``: an anonymous memory file
(``memfd_create``) that kvtier's I/O process maps too, through the file
descriptor it inherits, so that storage I/O reads and writes the very bytes the
device copies use. It needs no ``/dev/shm`` (a container's is often 64 MiB), and
it goes away with the last process that maps it. On CUDA it is pinned in place
(``cudaHostRegister``) for DMA.
"""

from __future__ import annotations

import os

import torch

from kvtier.io.pages import make_huge, map_shared


def allocate_host_buffer(num_slots: int, slot_bytes: int, pin: bool) -> torch.Tensor:
    """A private ``num_slots * slot_bytes`` uint8 buffer, pinned for CUDA, every page touched."""
    buffer = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, pin_memory=pin)
    buffer.zero_()  # fault every page in now, so that no copy into the pool pays for it
    return buffer


class SharedHostMemory:
    """``num_bytes`` of memory that another process can map from ``fd``."""

    def __init__(self, num_bytes: int, pin: bool):
        self.num_bytes = num_bytes
        self.fd = os.memfd_create("kvtier-host-pool", os.MFD_CLOEXEC)  # inherited only where passed on purpose
        try:
            os.ftruncate(self.fd, num_bytes)
            mapping = map_shared(self.fd, num_bytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.huge_bytes = make_huge(mapping)  # before any byte is written: it assumes zeros
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping while it lives
        self.tensor.zero_()  # fault every page in now, so that no copy into the pool pays for it
        self._pinned = False
        if pin:
            code = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), num_bytes, 0)
            if int(code) != 0:
                raise RuntimeError(f"kvtier: cudaHostRegister of the {num_bytes}-byte host pool failed ({code})")
            self._pinned = True

    def close(self) -> None:
        """Unpin and close the descriptor; the mapping lives until the tensor is dropped."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
