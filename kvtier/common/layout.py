"""Where a block's bytes live in an engine's paged KV cache. Torch-free.

An engine hands kvtier its KV cache as one tensor per layer (or one for all
layers). For every block id, each tensor holds the block in one or more contiguous
byte runs ("segments"): segment s of block b starts at
``address + s.offset + b * s.stride`` and is ``s.nbytes`` long.

A host slot holds one block for all layers: the segments of every tensor, one
after the other, ``slot_bytes`` in all.

Supported layouts (``KVLayout.kind``):
- ``blocks_first``: any ``[num_blocks, ...]`` tensor, as vLLM CPU's
  ``[num_blocks, kv_heads, block_size, 2 * head_size]`` or FlashInfer's
  ``[num_blocks, 2, block_size, heads, head_size]``: one run per block where its
  bytes are contiguous. vLLM 0.33+ hands views of one allocation in the physical
  order its KV cache layout names (``LBNHC``, ``BLHNC``, ...): read from the strides,
  a block is one run wherever it is dense, and one run per head where heads are
  placed outside blocks (``LHBNC``, ``BHLNC``).
- ``kv_first``: ``[2, num_blocks, block_size, heads, head_size]`` (vLLM CUDA
  FlashAttention): K and V are two runs.
- ``mla``: ``[num_blocks, block_size, latent_size]``: one run.
- ``cross_layer``: one tensor ``[num_blocks, num_layers, ...]`` where one block holds
  all layers: one run. It cannot be told from a one-layer model by its shape, so
  it is named explicitly.

The bytes of a slot follow the device layout, so entries written under one layout
are not readable under another: the layout is part of every rank's fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

LAYOUT_KINDS = ("blocks_first", "kv_first", "mla", "cross_layer")


class LayoutError(ValueError):
    """The KV cache's shape is not one kvtier knows how to address."""


@dataclass(frozen=True)
class TensorInfo:
    """What kvtier needs to know of one KV cache tensor (no torch here)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, as torch reports them
    itemsize: int
    address: int


@dataclass(frozen=True)
class Segment:
    tensor_index: int
    offset: int  # bytes from the tensor's address to block 0's run
    stride: int  # bytes between the runs of block b and block b + 1
    nbytes: int
    slot_offset: int  # where this run sits inside a host slot


@dataclass(frozen=True)
class KVLayout:
    kind: str
    num_blocks: int
    block_size: int
    num_layers: int
    block_shape: tuple[int, ...]  # one layer's per-block shape, for the key namespace
    segments: tuple[Segment, ...]
    # The tensor's dimensions in memory order where a block's are not in their natural one (vLLM
    # 0.33+'s ``LBNHC``: heads inside tokens); None where they are.
    order: tuple[int, ...] | None = None

    def describe(self) -> str:
        """What a slot's bytes mean, for the rank's fingerprint: the kind, a block's shape, and the
        order in memory where it is not the natural one."""
        return f"{self.kind}{list(self.block_shape)}" + (f"order{list(self.order)}" if self.order else "")

    @property
    def slot_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def copy_runs(
        self,
        tensor_addresses: Sequence[int],
        host_address: int,
        block_ids: np.ndarray,
        slot_ids: np.ndarray,
        to_host: bool,
        tensor_indices: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dst, src, length) int64 arrays that move ``block_ids`` <-> ``slot_ids``,
        for every tensor or only those in ``tensor_indices`` (one layer, layer-wise).

        Runs that are adjacent on both sides are merged into one copy.
        """
        block_ids = np.asarray(block_ids, dtype=np.int64)
        slot_ids = np.asarray(slot_ids, dtype=np.int64)
        if block_ids.shape != slot_ids.shape:
            raise ValueError("block_ids and slot_ids must have the same length")
        if block_ids.size and (block_ids.min() < 0 or block_ids.max() >= self.num_blocks):
            raise ValueError(f"block id out of range [0, {self.num_blocks})")
        device_parts, host_parts, length_parts = [], [], []
        slot_base = host_address + slot_ids * self.slot_bytes
        for seg in self.segments_of(tensor_indices):
            device_parts.append(tensor_addresses[seg.tensor_index] + seg.offset + block_ids * seg.stride)
            host_parts.append(slot_base + seg.slot_offset)
            length_parts.append(np.full(block_ids.size, seg.nbytes, dtype=np.int64))
        device = np.concatenate(device_parts) if device_parts else np.empty(0, np.int64)
        host = np.concatenate(host_parts) if host_parts else np.empty(0, np.int64)
        lengths = np.concatenate(length_parts) if length_parts else np.empty(0, np.int64)
        dst, src = (host, device) if to_host else (device, host)
        return coalesce(dst, src, lengths)

    def segment_table(self, tensor_addresses: Sequence[int], tensor_indices: Sequence[int] | None = None) -> np.ndarray:
        """The segments of every tensor (or of ``tensor_indices`` only) as int64 rows
        (device address of block 0's run, stride, slot offset, bytes): what the native
        ``copy_blocks`` walks, so that a copy needs no run list planned per job."""
        return np.array([(tensor_addresses[seg.tensor_index] + seg.offset, seg.stride, seg.slot_offset, seg.nbytes)
                         for seg in self.segments_of(tensor_indices)], dtype=np.int64).reshape(-1, 4)

    def segments_of(self, tensor_indices: Sequence[int] | None) -> tuple[Segment, ...]:
        if tensor_indices is None:
            return self.segments
        wanted = set(tensor_indices)
        return tuple(seg for seg in self.segments if seg.tensor_index in wanted)


def coalesce(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge run i+1 into run i where both sides continue exactly where i ends."""
    if lengths.size <= 1:
        return dst, src, lengths
    continues = (dst[:-1] + lengths[:-1] == dst[1:]) & (src[:-1] + lengths[:-1] == src[1:])
    starts = np.concatenate(([0], np.flatnonzero(~continues) + 1))
    return dst[starts], src[starts], np.add.reduceat(lengths, starts)


def detect_layout(
    tensors: Sequence[TensorInfo],
    num_blocks: int,
    block_size: int,
    kind: str | None = None,
) -> KVLayout:
    """Recognise the layout of an engine's KV tensors, or raise LayoutError naming the shape."""
    if not tensors:
        raise LayoutError("no KV cache tensors were given")
    if kind is not None and kind not in LAYOUT_KINDS:
        raise LayoutError(f"unknown layout kind {kind!r}; known: {', '.join(LAYOUT_KINDS)}")
    first = tensors[0].shape
    for info in tensors:
        if info.shape != first or info.itemsize != tensors[0].itemsize:
            raise LayoutError(f"KV tensors differ in shape or dtype: {first} and {info.shape}")
        if info.strides != tensors[0].strides:
            raise LayoutError(f"KV tensors differ in strides: {tensors[0].strides} and {info.strides}")
    kind = kind or _guess_kind(first, num_blocks, block_size, len(tensors))
    itemsize = tensors[0].itemsize
    if kind == "kv_first":
        if len(first) < 3 or first[0] != 2 or first[1] != num_blocks:
            raise LayoutError(f"shape {first} is not [2, num_blocks={num_blocks}, block_size, ...]")
        block_shape = (2, *first[2:])
        block_dim = 1
        num_layers = len(tensors)
    else:
        if len(first) < 2 or first[0] != num_blocks:
            raise LayoutError(f"shape {first} does not start with num_blocks={num_blocks} for layout {kind!r}")
        block_shape = tuple(first[1:])
        block_dim = 0
        num_layers = first[1] if kind == "cross_layer" else len(tensors)
    runs, order = _block_runs(first, tensors[0].strides, block_dim)
    stride = tensors[0].strides[block_dim] * itemsize
    segments, slot_offset = [], 0
    for index in range(len(tensors)):
        for offset, elements in runs:
            segments.append(Segment(index, offset * itemsize, stride, elements * itemsize, slot_offset))
            slot_offset += elements * itemsize
    return KVLayout(kind, num_blocks, block_size, num_layers, block_shape, tuple(segments), order)


def _block_runs(shape: tuple[int, ...], strides: tuple[int, ...], block_dim: int
                ) -> tuple[list[tuple[int, int]], tuple[int, ...] | None]:
    """One block's contiguous runs, as (offset, elements) in memory order, and the order in memory
    of the block's own dimensions where it is not their natural one (None where it is).

    The dimensions of a block whose strides pack densely from the innermost out make one run;
    those outside it (a K/V pair's halves, or heads placed outside the block dimension as vLLM's
    ``LHBNC`` layout does) each split it into runs. A block's slot holds its runs in memory order,
    so the same shape in another physical order (vLLM's ``LBNHC`` against ``LBHNC``) keys other
    entries (``describe``)."""
    if any(stride < 0 for stride in strides):
        raise LayoutError(f"KV tensor strides {strides} are negative")
    dims = [d for d in range(len(shape)) if d != block_dim and shape[d] != 1]
    by_stride = sorted(dims, key=lambda d: (strides[d], -d))
    elements, inner = 1, 0
    for d in by_stride:
        if strides[d] != elements:
            break
        elements *= shape[d]
        inner += 1
    outer = by_stride[inner:][::-1]  # outermost first
    offsets = [0]
    for d in outer:
        offsets = [o + i * strides[d] for o in offsets for i in range(shape[d])]
    offsets.sort()
    for a, b in zip(offsets, offsets[1:]):
        if b < a + elements:
            raise LayoutError(f"KV tensor of shape {shape} (strides {strides}) overlaps itself within a block")
    memory_order = tuple(sorted(dims, key=lambda d: (-strides[d], d)))
    return [(o, elements) for o in offsets], (None if list(memory_order) == dims else memory_order)


def _guess_kind(shape: tuple[int, ...], num_blocks: int, block_size: int, num_tensors: int) -> str:
    kv_first = len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks
    blocks_first = len(shape) >= 2 and shape[0] == num_blocks
    if kv_first and blocks_first:
        raise LayoutError(f"KV cache shape {shape} is ambiguous with num_blocks={num_blocks}: both "
                          f"[2, num_blocks, ...] and [num_blocks, ...] fit; pass the layout kind explicitly")
    if kv_first:
        return "kv_first"
    if blocks_first:
        return "mla" if len(shape) == 3 and shape[1] == block_size else "blocks_first"
    raise LayoutError(
        f"KV cache shape {shape} (num_blocks={num_blocks}, block_size={block_size}) matches no known layout; "
        f"known: [num_blocks, ...] with each block contiguous (blocks_first: vLLM CPU "
        f"[num_blocks, kv_heads, block_size, 2 * head_size], FlashInfer [num_blocks, 2, block_size, heads, head_size]; "
        f"mla: [num_blocks, block_size, latent]), [2, num_blocks, ...] (kv_first: FlashAttention), and one "
        f"[num_blocks, num_layers, ...] tensor named explicitly (cross_layer)")
