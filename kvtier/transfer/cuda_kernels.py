"""One-launch gather and scatter of KV blocks on the GPU (Triton).

A block's bytes sit in many segments (each layer's K and V) spread over separate
tensors. Moving them with one torch op per segment costs a kernel launch per segment
and chunk, and then the host's launch rate, not the copy engine, sets the speed. These
kernels move every segment of a chunk's blocks between the KV cache and a staging
buffer laid out like host slots in one launch, from a device table of segments.

Triton ships with PyTorch's CUDA builds on Linux; where it is missing,
``load_block_mover`` returns None and the copier falls back to torch ops.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # not on this install: the copier uses torch ops instead
    triton = None

ELEMENTS_PER_PROGRAM = 2048
_ELEMENT_TYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

if triton is not None:
    @triton.jit
    def _move_blocks(table_ptr, ids_ptr, staging_ptr, row_elements, TO_STAGING: tl.constexpr,
                     BLOCK: tl.constexpr):
        # program (row, segment, part): one part of one segment of one block.
        row = tl.program_id(0)
        segment = tl.program_id(1)
        part = tl.program_id(2)
        address = tl.load(table_ptr + segment * 4)  # bytes: block 0's run of this segment
        stride = tl.load(table_ptr + segment * 4 + 1)  # elements between blocks
        column = tl.load(table_ptr + segment * 4 + 2)  # elements into the staging row
        length = tl.load(table_ptr + segment * 4 + 3)  # elements in the run
        block = tl.load(ids_ptr + row)  # int64: block * stride does not overflow
        offsets = part * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < length
        cache = address.to(staging_ptr.dtype) + block * stride + offsets
        staging = staging_ptr + row * row_elements + column + offsets
        if TO_STAGING:
            tl.store(staging, tl.load(cache, mask=mask), mask=mask)
        else:
            tl.store(cache, tl.load(staging, mask=mask), mask=mask)


class BlockMover:
    """Gathers (``to_staging``) or scatters one set of segments; built once per set."""

    def __init__(self, segment_rows: np.ndarray, row_bytes: int, device: torch.device):
        # segment_rows: int64 [segments, 4] = (address of block 0's run, stride, column, bytes)
        widths = [8, 4, 2, 1]
        itemsize = next(w for w in widths if not (segment_rows % w).any() and row_bytes % w == 0)
        self.dtype = _ELEMENT_TYPES[itemsize]
        table = segment_rows.copy()
        table[:, 1:] //= itemsize  # stride, column and length in elements; the address stays in bytes
        self._table = torch.from_numpy(table).to(device)
        self._row_elements = row_bytes // itemsize
        self._num_segments = len(table)
        self._num_parts = max(1, -(-int(table[:, 3].max()) // ELEMENTS_PER_PROGRAM)) if len(table) else 1

    def __call__(self, device_ids: torch.Tensor, staging: torch.Tensor, to_staging: bool) -> None:
        """staging: ``[len(device_ids), row_bytes]`` uint8, on the current stream like everything here."""
        if device_ids.numel() == 0 or self._num_segments == 0:
            return
        grid = (device_ids.numel(), self._num_segments, self._num_parts)
        _move_blocks[grid](self._table, device_ids, staging.view(self.dtype), self._row_elements,
                           TO_STAGING=to_staging, BLOCK=ELEMENTS_PER_PROGRAM)


def load_block_mover():
    """The ``BlockMover`` class, or None where Triton is not installed."""
    return BlockMover if triton is not None else None
