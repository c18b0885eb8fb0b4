"""Which module builds which tier, and the configured tiers as specs. Torch-free; imports no
tier module until one is used.

The tiers below the host pool are the ``tiers`` key's URLs, in lookup order, or, where it is
not set, the shorthand it expands: ``disk_dir`` (a ``disk://`` tier bounded by ``disk_bytes``)
then ``remote_url``, written through as ``store_to`` says. A tier is a module that declares
a ``KIND`` (``kvtier.tiers.base.TierKind``) and a line in ``SCHEMES``; a tier from another
distribution is an entry point of group ``kvtier.tiers`` instead (docs/architecture.md).
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from typing import Sequence
from urllib.parse import urlparse

from kvtier.common.config import KVTierConfig, not_allowed
from kvtier.common.entry import load_entry_key
from kvtier.tiers import base
from kvtier.tiers.base import TierIndex, TierKind, TierSpec, TierStore

# URL scheme -> the module that declares the tier's ``KIND``.
SCHEMES: dict[str, str] = {
    "disk": "kvtier.tiers.disk",
    "file": "kvtier.tiers.shared_dir",
    "redis": "kvtier.tiers.redis",
    "rediss": "kvtier.tiers.redis",
    "redis+cluster": "kvtier.tiers.redis",
    "rediss+cluster": "kvtier.tiers.redis",
    "mooncake": "kvtier.tiers.mooncake",
    "node": "kvtier.tiers.node",
}

@functools.cache
def _plugins() -> dict[str, str]:
    """Tiers that installed distributions add: entry points of group ``kvtier.tiers``, each a URL
    scheme naming a module that declares a ``KIND`` (kvtier's own schemes stand)."""
    return {point.name: point.value for point in entry_points(group="kvtier.tiers") if point.name not in SCHEMES}


def module_of(url: str) -> str:
    scheme = urlparse(url).scheme
    module = SCHEMES.get(scheme) or _plugins().get(scheme)
    if module is None:
        raise ValueError(f"scheme {scheme!r} is not one of {', '.join([*SCHEMES, *_plugins()])}")
    return module


def kind_of(url: str) -> TierKind:
    return importlib.import_module(module_of(url)).KIND


def validate_url(url: str, shared_only: bool = False) -> str:
    """Raise ValueError unless ``url`` names a tier kvtier can use (``shared_only``: one that
    instances share, as ``remote_url`` must)."""
    kind = kind_of(url)
    if shared_only and not kind.shared:
        raise ValueError(f"a {urlparse(url).scheme}:// tier is not shared between instances; list it in 'tiers'")
    if kind.validate is not None:
        kind.validate(url)
    return url


def check_tiers(entries) -> None:
    """Raise ValueError, naming the entry, unless every tier of ``entries`` (``TierEntry``s) is usable
    and their names differ."""
    names: list[str] = []
    for i, entry in enumerate(entries):
        try:
            validate_url(entry.url)
            names.append(_name(kind_of(entry.url), entry.name, names))
        except ValueError as error:
            raise ValueError(f"tier {i} ({urlparse(entry.url).scheme}://...): {error}") from None


def _name(kind: TierKind, given: str | None, taken: list[str]) -> str:
    name = given or kind.name
    number = 2
    while given is None and name in taken:  # a second disk is "disk2"
        name, number = f"{kind.name}{number}", number + 1
    if name in taken or name == "host" or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"tier name {name!r} is taken, reserved or not a plain word")
    return name


def tier_specs(config: KVTierConfig) -> list[TierSpec]:
    """The configured tiers below the host pool, in lookup order (``KVTierConfig.tier_entries``).
    Raises ``ConfigError``, naming the key, for a tier kvtier cannot use: every path that builds
    tiers comes here first, at start-up."""
    key = "tiers" if config.tiers is not None else "remote_url"
    try:
        if config.tiers is not None:
            check_tiers(config.tier_entries())
        elif config.remote_url is not None:
            validate_url(config.remote_url, shared_only=True)
    except ValueError as error:
        raise not_allowed(key, getattr(config, key), error) from None
    specs: list[TierSpec] = []
    for entry in config.tier_entries():
        kind = kind_of(entry.url)
        where, capacity = kind.place(entry.url) if kind.place is not None else (entry.url, None)
        if kind.place is not None and capacity is None and kind.directory is not None:
            capacity = config.disk_bytes  # a local directory's bound, where its URL sets none
        specs.append(TierSpec(_name(kind, entry.name, [s.name for s in specs]), module_of(entry.url),
                              where, capacity, entry.timeout_s, entry.retry_s, threads=entry.threads,
                              options={"write": entry.write, "ttl_s": entry.ttl_s, "audit_s": entry.audit_s,
                                       "answer_s": entry.answer_s, "entry_key_file": config.entry_key_file},
                              job_bytes=kind.job_bytes or base.JOB_BYTES))
    return specs


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]) -> TierIndex:
    return spec.kind.make_index(spec, slot_bytes, rank_fingerprints)


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> TierStore:
    store = spec.kind.make_store(spec, rank_fingerprint, slot_bytes)
    store.mac_key = load_entry_key(spec.options.get("entry_key_file"))  # read here, in the I/O process
    return store


def write_record(spec: TierSpec, record: dict) -> bool | None:
    """Leave a namespace record (``kvtier.tiers.namespaces``) in the tier; None: it keeps none."""
    write = spec.kind.write_record
    return write(spec, record) if write is not None else None


def read_records(spec: TierSpec) -> list[dict]:
    """The namespace records that instances left in the tier."""
    read = spec.kind.read_records
    return read(spec) if read is not None else []


def release_outside(spec: TierSpec) -> None:
    """Close what ``held_from_outside`` and the records kept open for ``spec`` (a client)."""
    if spec.kind.release_outside is not None:
        spec.kind.release_outside(spec)


def held_from_outside(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes],
                      keys: Sequence[bytes]) -> set[bytes]:
    """Which of ``keys`` (of any namespace, named by its ranks' fingerprints) the tier holds, asked
    as a process outside the engine would: no pins, no lock taken, within the tier's own timeout.
    A tier that cannot be asked so holds none, as far as it tells."""
    held = spec.kind.held_from_outside
    return held(spec, slot_bytes, rank_fingerprints, keys) if held is not None else set()
