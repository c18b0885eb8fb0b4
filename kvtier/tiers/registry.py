"""Which module builds which tier. Torch-free; imports no tier module until one is used.

A tier below the host pool is configured by ``disk_dir`` (the local disk tier) and
``remote_url`` (a tier that many instances share, chosen by the URL's scheme).
Adding a tier is a module with ``make_index(spec, slot_bytes, rank_fingerprints)``
and ``make_store(spec, rank_fingerprint, slot_bytes)`` (plus ``validate(url)``
for a URL scheme) and one line below.
"""

from __future__ import annotations

import importlib
from typing import Sequence
from urllib.parse import urlparse

from kvtier.entry import load_entry_key
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
                                       "entry_key_file": config.entry_key_file}))
    if config.remote_url:
        name, module = SCHEMES[urlparse(config.remote_url).scheme]
        specs.append(TierSpec(name, module, config.remote_url, None, config.remote_timeout_s, config.remote_retry_s,
                              threads=config.disk_io_threads,
                              options={"write": "remote" in config.store_to, "ttl_s": config.remote_ttl_s,
                                       "entry_key_file": config.entry_key_file}))
    return specs


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]) -> TierIndex:
    return importlib.import_module(spec.module).make_index(spec, slot_bytes, rank_fingerprints)


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> TierStore:
    store = importlib.import_module(spec.module).make_store(spec, rank_fingerprint, slot_bytes)
    store.mac_key = load_entry_key(spec.options.get("entry_key_file"))  # read here, in the I/O process
    return store
