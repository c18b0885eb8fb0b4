"""The self-describing format of a stored block (disk file or remote value). Torch-free.

An entry is a 64-byte header followed by the block's bytes (one host slot):

    magic "KVTIER\\0\\1" | format version u32 | flags u32 | namespace fingerprint 16B
    | key 16B | payload length u64 | payload checksum u64      (little-endian)

A reader accepts an entry only if every field matches what it expects and the
payload's checksum is right; anything else (corrupt, truncated, another model or
layout or rank, another format version) is a miss. Nothing is ever unpickled.

The checksum (xxh3-64 of the payload) catches damage, not forgery. With an entry
key (``entry_key_file``), it is instead a keyed BLAKE3 tag (64 bits) over the
header's fields and the payload, and the ``KEYED`` flag is set: an entry written
without the key, or with another, is a miss. Readers with a key accept only keyed
entries, readers without one only plain ones.
"""

from __future__ import annotations

import struct
from pathlib import Path

import blake3
import xxhash

from kvtier.common.keys import FORMAT_VERSION, KEY_BYTES
from kvtier.common.outcomes import Miss, bad

MAGIC = b"KVTIER\x00\x01"
_HEADER = struct.Struct("<8sII16s16sQQ")
HEADER_BYTES = 64
assert _HEADER.size <= HEADER_BYTES


KEYED = 1  # flag: the checksum field is a keyed tag
MIN_KEY_BYTES = 16


def checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def load_entry_key(path: str | None) -> bytes | None:
    """The 32-byte MAC key derived from the file at ``path`` (None: no key)."""
    if path is None:
        return None
    return blake3.blake3(Path(path).read_bytes(), derive_key_context="kvtier entry key v1").digest()


def _tag(mac_key: bytes, fingerprint: bytes, key: bytes, payload) -> int:
    digest = blake3.blake3(fingerprint + key + len(payload).to_bytes(8, "little"), key=mac_key)
    digest.update(payload)
    return int.from_bytes(digest.digest(length=8), "little")


def encode_header(fingerprint: bytes, key: bytes, payload, mac_key: bytes | None = None,
                  check: int | None = None) -> bytes:
    """``check``: the payload's ``checksum``, where it was already taken (a keyed tag is always made here)."""
    if len(fingerprint) != KEY_BYTES or len(key) != KEY_BYTES:
        raise ValueError("fingerprint and key must be 16 bytes")
    if mac_key is not None:
        flags, check = KEYED, _tag(mac_key, fingerprint, key, payload)
    else:
        flags, check = 0, checksum(payload) if check is None else check
    packed = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, fingerprint, key, len(payload), check)
    return packed.ljust(HEADER_BYTES, b"\x00")


def check_entry(header: bytes, payload, fingerprint: bytes, key: bytes, payload_bytes: int,
                mac_key: bytes | None = None, check: bool = True) -> Miss | int | None:
    """None if the entry is the expected one, else why it is not (a ``Miss`` of kind ``BAD``).

    ``check`` False: the caller checks a plain entry's checksum itself (a load's copy to the
    device takes it as it reads the payload): the payload is not read here, and the header's
    checksum is the answer. A keyed entry's tag is always checked here."""
    if len(header) < HEADER_BYTES:
        return bad("truncated header")
    magic, version, flags, entry_fingerprint, entry_key, length, entry_checksum = _HEADER.unpack_from(header)
    if magic != MAGIC:
        return bad("not a kvtier entry")
    if version != FORMAT_VERSION:
        return bad(f"format version {version}, expected {FORMAT_VERSION}")
    if entry_fingerprint != fingerprint:
        return bad("foreign namespace")
    if entry_key != key:
        return bad("other key")
    if length != payload_bytes or len(payload) != payload_bytes:
        return bad(f"truncated or wrong length ({len(payload)} of {length} bytes, expected {payload_bytes})")
    if mac_key is not None:
        if not flags & KEYED:
            return bad("not signed with the entry key")
        return None if _tag(mac_key, fingerprint, key, payload) == entry_checksum else bad("entry key tag mismatch")
    if flags & KEYED:
        return bad("signed with an entry key, and none is configured")
    if not check:
        return entry_checksum
    if checksum(payload) != entry_checksum:
        return bad("checksum mismatch")
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
