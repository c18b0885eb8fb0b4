"""The self-describing format of a stored block (disk file or remote value). Torch-free.

An entry is a 64-byte header followed by the block's bytes (one host slot):

    magic "KVTIER\\0\\1" | format version u32 | reserved u32 | namespace fingerprint 16B
    | key 16B | payload length u64 | payload checksum xxh3-64 u64      (little-endian)

A reader accepts an entry only if every field matches what it expects and the
payload's checksum is right; anything else (corrupt, truncated, another model or
layout or rank, another format version) is a miss. Nothing is ever unpickled.
"""

from __future__ import annotations

import struct

import xxhash

from kvtier.keys import FORMAT_VERSION, KEY_BYTES

MAGIC = b"KVTIER\x00\x01"
_HEADER = struct.Struct("<8sII16s16sQQ")
HEADER_BYTES = 64
assert _HEADER.size <= HEADER_BYTES


def checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(fingerprint: bytes, key: bytes, payload) -> bytes:
    if len(fingerprint) != KEY_BYTES or len(key) != KEY_BYTES:
        raise ValueError("fingerprint and key must be 16 bytes")
    packed = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, key, len(payload), checksum(payload))
    return packed.ljust(HEADER_BYTES, b"\x00")


def check_entry(header: bytes, payload, fingerprint: bytes, key: bytes, payload_bytes: int) -> str | None:
    """None if the entry is the expected one, else why it is not (a miss)."""
    if len(header) < HEADER_BYTES:
        return "truncated header"
    magic, version, _, entry_fingerprint, entry_key, length, entry_checksum = _HEADER.unpack_from(header)
    if magic != MAGIC:
        return "not a kvtier entry"
    if version != FORMAT_VERSION:
        return f"format version {version}, expected {FORMAT_VERSION}"
    if entry_fingerprint != fingerprint:
        return "foreign namespace"
    if entry_key != key:
        return "other key"
    if length != payload_bytes or len(payload) != payload_bytes:
        return f"truncated or wrong length ({len(payload)} of {length} bytes, expected {payload_bytes})"
    if checksum(payload) != entry_checksum:
        return "checksum mismatch"
    return None



def read_header(header: bytes, fingerprint: bytes, payload_bytes: int) -> bytes | None:
    """The key an entry's header names, if it is a kvtier entry of this namespace and size."""
    if len(header) < HEADER_BYTES:
        return None
    magic, version, _, entry_fingerprint, key, length, _ = _HEADER.unpack_from(header)
    if magic != MAGIC or version != FORMAT_VERSION or entry_fingerprint != fingerprint or length != payload_bytes:
        return None
    return key


def read_header_length(header: bytes) -> int | None:
    """The payload length a kvtier header declares, or None if it is not one."""
    if len(header) < HEADER_BYTES:
        return None
    magic, version, _, _, _, length, _ = _HEADER.unpack_from(header)
    return length if magic == MAGIC and version == FORMAT_VERSION else None
