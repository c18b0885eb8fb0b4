"""Block keys: deterministic, versioned, namespaced. Torch-free.

A prompt is cut into blocks of ``block_size`` tokens. Block i's key is a 128-bit
blake3 hash over (key of block i-1, a domain tag, the extra keys, block i's token
ids); block 0's parent is the namespace fingerprint. The same tokens give the same
key in every process and on every machine: nothing here depends on Python's
``hash`` or on PYTHONHASHSEED.

A last, partial block is hashed under another domain tag together with its length,
so its key can never equal a full block's key. Writer and reader both call
``block_keys``; there is no second implementation.

Tensor-parallel ranks each hold a shard of a block. The scheduler keys blocks
with the namespace fingerprint (which includes the world size, not the rank); each
rank stores its shard under the same key but in a place named by its own rank's
fingerprint (``Namespace.for_rank``: rank and device layout), and stamps the entry
with that fingerprint, so ranks and layouts never read each other's bytes.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, replace
from typing import Sequence

import blake3
import msgspec
import numpy as np

FORMAT_VERSION = 1
KEY_BYTES = 16

_FULL_BLOCK_TAG = b"F"
_PARTIAL_BLOCK_TAG = b"P"


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two caches' blocks incompatible."""

    model: str
    kv_dtype: str
    layout: str
    geometry: tuple[int, ...]  # per-block shape of one layer's KV, e.g. (2, block_size, heads * head_size)
    num_layers: int
    block_size: int
    tp_size: int = 1
    tp_rank: int | None = None  # None: the scheduler's view, shared by all ranks
    device_layout: str = ""  # a rank's KV layout and per-block shape; "" in the scheduler's view
    format_version: int = FORMAT_VERSION
    weights: str = ""  # the model's content and KV-changing settings (``kvtier.common.model_identity``)

    def fingerprint(self) -> bytes:
        encoded = msgspec.msgpack.encode(astuple(self))
        return blake3.blake3(b"kvtier-namespace" + encoded).digest(length=KEY_BYTES)

    def for_rank(self, rank: int, device_layout: str = "") -> "Namespace":
        """The namespace of one rank's stored entries: its rank and its device layout."""
        return replace(self, tp_rank=rank, device_layout=device_layout)


def _extra_bytes(extra_keys: Sequence[str | bytes | int]) -> bytes:
    if not extra_keys:
        return b""
    return msgspec.msgpack.encode([k if isinstance(k, (bytes, int)) else str(k) for k in extra_keys])


def block_keys(
    fingerprint: bytes,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra_keys: Sequence[str | bytes | int] = (),
    include_partial: bool = False,
    start_block: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Keys of the blocks of ``token_ids``: one per full block, plus one for the
    trailing partial block when ``include_partial`` and one exists.

    ``start_block``/``parent`` continue a chain: pass the number of blocks already
    keyed and the last of their keys to key only the new ones.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    token_bytes = tokens.astype("<u4").tobytes()
    extra = _extra_bytes(extra_keys)
    parent_key = fingerprint if parent is None else parent
    num_full = len(tokens) // block_size
    stride = 4 * block_size
    keys: list[bytes] = []
    for i in range(start_block, num_full):
        chunk = token_bytes[i * stride:(i + 1) * stride]
        parent_key = blake3.blake3(parent_key + _FULL_BLOCK_TAG + extra + chunk).digest(length=KEY_BYTES)
        keys.append(parent_key)
    remainder = len(tokens) - num_full * block_size
    if include_partial and remainder:
        chunk = token_bytes[num_full * stride:]
        tag = _PARTIAL_BLOCK_TAG + remainder.to_bytes(4, "little")
        keys.append(blake3.blake3(parent_key + tag + extra + chunk).digest(length=KEY_BYTES))
    return keys

