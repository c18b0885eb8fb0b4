"""Which module builds which tier. Torch-free; imports no tier module until one is used.

A tier below the host pool is configured by ``disk_dir`` (the local disk tier) and
``remote_url`` (a tier that many instances share, chosen by the URL's scheme).
Adding a tier is a module with ``make_index(spec, slot_bytes, rank_fingerprints)``
and ``make_store(spec, rank_fingerprint, slot_bytes)`` (plus ``validate(url)``
for a URL scheme, and ``JOB_BYTES`` where its jobs should not move the default)
and one line below.
"""

from __future__ import annotations

import importlib
from typing import Sequence
from urllib.parse import urlparse

from kvtier.entry import load_entry_key
from kvtier.tiers import base
from kvtier.tiers.base import TierIndex, TierSpec, TierStore

# URL scheme -> (tier name, module).
SCHEMES: dict[str, tuple[str, str]] = {
    "mooncake": ("mooncake", "kvtier.tiers.mooncake"),
    "redis": ("redis", "kvtier.tiers.redis"),
    "rediss": ("redis", "kvtier.tiers.redis"),
    "redis+cluster": ("redis", "kvtier.tiers.redis"),
    "rediss+cluster": ("redis", "kvtier.tiers.redis"),
    "file": ("file", "kvtier.tiers.shared_dir"),
}
DISK_MODULE = "kvtier.tiers.disk"


def validate_url(url: str) -> str:
    """Raise ValueError unless ``url`` names a supported shared tier."""
    scheme = urlparse(url).scheme
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    importlib.import_module(SCHEMES[scheme][1]).validate(url)
    return url


def tier_specs(config) -> list[TierSpec]:
    """The configured tiers below the host pool, in lookup order: local before shared.
    ``config`` is a ``KVTierConfig`` (not imported: the configuration imports this module)."""
    specs = []
    if config.disk_dir:
        specs.append(TierSpec("disk", DISK_MODULE, config.disk_dir, config.disk_bytes, threads=config.disk_io_threads,
                              options={"write": "disk" in config.store_to,
                                       "entry_key_file": config.entry_key_file},
                              job_bytes=job_bytes(DISK_MODULE)))
    if config.remote_url:
        name, module = SCHEMES[urlparse(config.remote_url).scheme]
        specs.append(TierSpec(name, module, config.remote_url, None, config.remote_timeout_s, config.remote_retry_s,
                              threads=config.disk_io_threads,
                              options={"write": "remote" in config.store_to, "ttl_s": config.remote_ttl_s,
                                       "audit_s": config.remote_audit_s, "answer_s": config.remote_answer_s,
                                       "entry_key_file": config.entry_key_file},
                              job_bytes=job_bytes(module)))
    return specs


def job_bytes(module: str) -> int:
    """About what one I/O job of the tier built by ``module`` moves: its ``JOB_BYTES``, else the default."""
    return getattr(importlib.import_module(module), "JOB_BYTES", base.JOB_BYTES)


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]) -> TierIndex:
    return importlib.import_module(spec.module).make_index(spec, slot_bytes, rank_fingerprints)


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> TierStore:
    store = importlib.import_module(spec.module).make_store(spec, rank_fingerprint, slot_bytes)
    store.mac_key = load_entry_key(spec.options.get("entry_key_file"))  # read here, in the I/O process
    return store


def write_record(spec: TierSpec, record: dict) -> bool | None:
    """Leave a namespace record (``kvtier.namespaces``) in the tier; None: it keeps none."""
    write = getattr(importlib.import_module(spec.module), "write_record", None)
    return write(spec, record) if write is not None else None


def read_records(spec: TierSpec) -> list[dict]:
    """The namespace records that instances left in the tier."""
    read = getattr(importlib.import_module(spec.module), "read_records", None)
    return read(spec) if read is not None else []


def release_outside(spec: TierSpec) -> None:
    """Close what ``held_from_outside`` and the records kept open for ``spec`` (a client)."""
    release = getattr(importlib.import_module(spec.module), "release_outside", None)
    if release is not None:
        release(spec)


def held_from_outside(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes],
                      keys: Sequence[bytes]) -> set[bytes]:
    """Which of ``keys`` (of any namespace, named by its ranks' fingerprints) the tier holds, asked
    as a process outside the engine would: no pins, no lock taken, within the tier's own timeout.
    A tier module that cannot be asked so (no ``held_from_outside``) holds none, as far as it tells."""
    held = getattr(importlib.import_module(spec.module), "held_from_outside", None)
    return held(spec, slot_bytes, rank_fingerprints, keys) if held is not None else set()
