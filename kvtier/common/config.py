"""kvtier's one configuration object, validated in one place.

Sources, later ones winning: built-in defaults, a YAML file (``config_file`` key or
the ``KVTIER_CONFIG`` environment variable), ``KVTIER_<KEY>`` environment
variables, then the dict the engine passes (vLLM's ``kv_connector_extra_config``).
Every key, its default and its meaning are listed in ``KEYS``; docs/configuration.md's table
is printed from it by ``kvtier config --markdown``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import quote, unquote, unquote_plus, urlencode, urlparse

import yaml

from kvtier.common.redact import redact
from kvtier.common.units import parse_bytes  # noqa: F401  (re-exported: callers size things with it)


class ConfigError(ValueError):
    """A configuration key is unknown or has a value that is not allowed."""


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def _parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("a boolean is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return int(str(value).strip())


def _parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return float(value)


def _parse_store_to(value: Any) -> tuple[str, ...]:
    names = value if isinstance(value, (list, tuple)) else [v for v in str(value).replace(" ", "").split(",") if v]
    unknown = [n for n in names if n not in ("disk", "remote")]
    if unknown:
        raise ValueError(f"unknown tier(s) {unknown}")
    return tuple(dict.fromkeys(names))


def _parse_tier_list(value: Any) -> tuple[str, ...] | None:
    """A YAML list, or (from a KVTIER_TIERS variable) a JSON list or URLs split by commas or spaces."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        return None
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else text.replace(",", " ").split()
    if not isinstance(value, (list, tuple)) or not all(isinstance(url, str) and url for url in value):
        raise ValueError("not a list of tier URLs")
    return tuple(value)


def _valid_tier_list(value: tuple[str, ...] | None) -> bool:
    """kvtier's own options of each tier; what a tier's module says of its URL is asked when the
    tiers are built (``kvtier.tiers.registry.tier_specs``), still at start-up: the configuration
    imports no tier."""
    if value is not None:
        _tier_entries(value, None)  # raises ValueError naming the entry and the reason
    return True


# kvtier's own options of a tier, in its URL's query (taken out before the tier reads its URL) ->
# the key whose value is their default and whose rule they follow.
TIER_OPTIONS = {"timeout_s": "remote_timeout_s", "retry_s": "remote_retry_s", "ttl_s": "remote_ttl_s",
                "audit_s": "remote_audit_s", "answer_s": "remote_answer_s", "threads": "disk_io_threads",
                "write": "verify_loads"}  # write: a boolean, as verify_loads is; true by default


@dataclass(frozen=True)
class TierEntry:
    """One tier of the ``tiers`` list (or of the shorthand), kvtier's own options read."""

    url: str  # the tier's URL without kvtier's own options
    name: str | None  # ``name=``; None: the kind's name
    write: bool
    timeout_s: float
    retry_s: float
    ttl_s: float
    audit_s: float
    answer_s: float
    threads: int


def _tier_entries(urls, config: "KVTierConfig | None") -> list[TierEntry]:
    """``urls`` read into entries; options they leave out take ``config``'s keys (None: the defaults)."""
    entries = []
    for i, url in enumerate(urls):
        scheme = urlparse(url).scheme
        address, _, query = url.partition("?")
        own, rest = {}, []
        for part in query.split("&") if query else []:  # the tier's own options kept as written
            name, _, value = part.partition("=")
            if unquote(name) in (*TIER_OPTIONS, "name"):
                own[unquote(name)] = unquote_plus(value)
            else:
                rest.append(part)
        values = {}
        for option, key in TIER_OPTIONS.items():
            if option not in own:
                values[option] = True if option == "write" else (
                    getattr(config, key) if config is not None else KEYS[key].parse(KEYS[key].default))
                continue
            try:
                values[option] = KEYS[key].parse(own[option])
                ok = KEYS[key].check(values[option])
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"tier {i} ({scheme}://...): option {option}={own[option]!r} is not allowed; "
                                 f"allowed: {KEYS[key].allowed}")
        entries.append(TierEntry(f"{address}?{'&'.join(rest)}" if rest else address, own.get("name"), **values))
    return entries


def _parse_disk_dir(value: Any) -> str | None:
    """A usable directory, or None."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        return None
    if not str(value).strip():
        raise ValueError("an empty path (null disables the disk tier)")
    return usable_directory(str(value))


def usable_directory(value: str) -> str:
    """Checked at start-up, so that a bad path fails there, naming the key, rather than as failed
    writes later: it must be a directory (or creatable as one) that this process can write."""
    path = Path(os.path.expanduser(value))
    existing = path
    while not existing.exists():  # the folders kvtier would make must go where it can write
        if existing.is_symlink():
            raise ValueError(f"{existing} is a broken symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{existing} is not writable by this process (or on a read-only filesystem)")
    return str(path)


def _valid_key_file(value: str) -> bool:
    from kvtier.common.entry import MIN_KEY_BYTES

    path = Path(os.path.expanduser(value))
    if not path.is_file():
        raise ValueError("no such file")
    if path.stat().st_mode & 0o077:
        raise ValueError("the file is readable by others than its owner (chmod 600 it)")
    if path.stat().st_size < MIN_KEY_BYTES:
        raise ValueError(f"a key needs at least {MIN_KEY_BYTES} bytes")
    return True


def _parse_optional_str(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return str(value)


@dataclass(frozen=True)
class _Key:
    default: Any
    parse: Callable[[Any], Any]
    check: Callable[[Any], bool]
    allowed: str
    doc: str


def _default_disk_dir() -> str:
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "kvtier")


# Every configuration key. Adding a key here is all it takes for it to be parsed,
# validated, documented and settable from the dict, YAML and KVTIER_* variables.
KEYS: dict[str, _Key] = {
    "host_bytes": _Key(
        "1GiB", parse_bytes, lambda v: v > 0,
        "a byte count > 0, as an integer or a string such as '4GiB'",
        "Size of the host memory pool (the first tier), shared memory that kvtier's I/O process maps too. "
        "Pinned when the device is CUDA. It holds host_bytes // (one block's bytes) blocks; on CPU each "
        "slot also has a 64-byte head, for its entry's header."),
    "tiers": _Key(
        None, _parse_tier_list, _valid_tier_list,
        "null, or a list of tier URLs (disk:///dir, file:///dir, redis://, rediss://, redis+cluster://, "
        "mooncake://...), each with optional ?max_bytes= (disk, file), name=, write=, timeout_s=, retry_s=, "
        "ttl_s=, audit_s=, answer_s=, threads=",
        "The tiers below the host pool, in lookup order (a block is loaded from the first that holds it, and "
        "stored to each with write=true, the default). A tier's own options default to the keys they are "
        "named after (max_bytes: disk_bytes; timeout_s: remote_timeout_s; threads: disk_io_threads; ...). "
        "Tiers are named by kind (disk, file, redis, mooncake), a second one of a kind disk2, or by name=. "
        "Null: disk_dir, disk_bytes, remote_url and store_to say which tiers there are (set either those or "
        "this)."),
    "disk_dir": _Key(
        _default_disk_dir(), _parse_disk_dir, lambda v: True,
        "a writable directory (made if missing), or null to disable the disk tier",
        "Directory of the local disk tier (the embedded default's second tier). Instances on one directory "
        "(servers of one node, all on the default) each take a file of their own and share no entry; "
        "instances that should share entries use remote_url: file:///... Null disables it. "
        "Default: $XDG_CACHE_HOME/kvtier."),
    "disk_bytes": _Key(
        "16GiB", parse_bytes, lambda v: v > 0,
        "a byte count > 0, as an integer or a string such as '100GiB'",
        "Byte capacity of the disk tier; least recently used entries are evicted beyond it, or beyond what it "
        "holds once its filesystem is found full."),
    "block_size": _Key(
        None, lambda v: None if v is None else _parse_int(v), lambda v: v is None or v > 0,
        "an integer > 0, or null to take the engine's",
        "Tokens per block, where the engine does not give it (vLLM does)."),
    "store_partial_block": _Key(
        False, _parse_bool, lambda v: True, "true or false",
        "Also store a prompt's last, partial block under its own key."),
    "disk_io_threads": _Key(
        2, _parse_int, lambda v: 1 <= v <= 64, "an integer from 1 to 64",
        "Threads per tier in kvtier's I/O process (its own interpreter), at least 2: that many of a tier's "
        "I/O jobs (about 4 MiB of entries each, 32 MiB on Mooncake and the node; read or written in order) run side "
        "by side."),
    "copy_threads": _Key(
        2, _parse_int, lambda v: 1 <= v <= 64, "an integer from 1 to 64",
        "Threads that copy blocks between the engine's KV cache and the host pool (CPU device)."),
    "remote_url": _Key(
        None, _parse_optional_str, lambda v: True,  # its tier's module checks it (``tier_specs``)
        "null, or a mooncake://host:port?metadata=URL, redis://, rediss://, redis+cluster:// or file:///path URL",
        "The tier that instances share (third tier): a storage pool (Mooncake Store, Redis/Valkey) or a "
        "shared directory (file:///mnt/kv, optional ?max_bytes=100GiB); null for none."),
    "node_socket": _Key(
        None, _parse_optional_str, lambda v: v is None or os.path.isabs(v),
        "null, or the absolute path of a node server's Unix socket",
        "Share the node's cache: the host pool and disk of `kvtier serve node` at this socket (one for every "
        "engine on the machine, warm across engine restarts) are the first tier below this engine's host pool, "
        "in place of the disk at disk_dir (then remote_url, if set). Null: kvtier runs embedded."),
    "remote_timeout_s": _Key(
        2.0, _parse_float, lambda v: 0 < v <= 600, "a number of seconds in (0, 600]",
        "Longest wait for one call to the pool; a slower or failed call marks it down, and a read still in "
        "flight then is cut (Redis; a Mooncake call cannot be, and its load is given up at load_timeout_s)."),
    "remote_retry_s": _Key(
        10.0, _parse_float, lambda v: 0 < v <= 3600, "a number of seconds in (0, 3600]",
        "How long the pool is skipped after a failure before kvtier reconnects."),
    "remote_ttl_s": _Key(
        86400.0, _parse_float, lambda v: 0 <= v <= 10 * 365 * 86400, "a number of seconds >= 0 (0: never)",
        "Redis/Valkey: entries kvtier writes expire after this long (SET EX), so a pool without an "
        "eviction policy does not fill up with KV nobody reads. 0: no expiry. Mooncake evicts on its own."),
    "remote_answer_s": _Key(
        1.0, _parse_float, lambda v: 0 < v <= 3600, "a number of seconds in (0, 3600]",
        "How long the shared tier's answer about a request's blocks stands for that request: vLLM asks "
        "again every step about a request it cannot schedule yet (no room in its KV cache), and within "
        "this time it gets the same answer instead of a new check of the tier. Longer: fewer checks; a "
        "block the tier dropped meanwhile costs a failed load (recomputed), one stored meanwhile by another "
        "instance is found later (this instance's own stores end the answer at once)."),
    "remote_audit_s": _Key(
        10.0, _parse_float, lambda v: 0 <= v <= 3600, "a number of seconds in [0, 3600] (0: never)",
        "How often the shared tier is asked whether the blocks this instance stored there are still held "
        "(up to 4096 of them each time, least recently asked first, in one call off the scheduler's thread): "
        "what it dropped on its own (Mooncake's evictions, another instance's max_bytes, a Redis that "
        "publishes no eviction notices) is then announced as removed (KV events) and explains later misses. "
        "0: only a load that finds a block gone tells it."),
    "store_to": _Key(
        "disk,remote", _parse_store_to, lambda v: True, "a comma-separated subset of disk, remote (or empty)",
        "Tiers that stores are written through to, besides the host pool (where configured)."),
    "load_timeout_s": _Key(
        10.0, _parse_float, lambda v: 0 < v <= 3600, "a number of seconds in (0, 3600]",
        "A load whose disk or pool reads take longer is abandoned: its blocks are recomputed."),
    "handoff_stall_s": _Key(
        5.0, _parse_float, lambda v: 0 < v <= 3600, "a number of seconds in (0, 3600]",
        "Prefill/decode: a decode request handed over by a prefill instance waits for the prompt blocks "
        "that instance still stores while they keep arriving; once none has arrived for this long (the "
        "prefill instance died or is stuck), it loads what is there and computes the rest. It waits "
        "load_timeout_s at most in any case."),
    "idle_step_wait_s": _Key(
        0.002, _parse_float, lambda v: 0 <= v <= 0.1, "a number of seconds in [0, 0.1]",
        "In an engine step that computes nothing while a load is in flight, the engine's thread waits this "
        "long at most for a job to finish instead of stepping again at once, leaving the CPU to kvtier's I/O; "
        "with no load in flight, as long for the answers that lookups wait for from a storage pool or shared "
        "directory (a new request waits as long at most). 0: never waits."),
    "shutdown_flush_s": _Key(
        10.0, _parse_float, lambda v: 0 <= v <= 3600, "a number of seconds in [0, 3600]",
        "At a clean shutdown, how long kvtier may take to store finished requests' blocks still waiting for "
        "host slots (planned for every worker by the scheduler side) and to finish the disk and pool writes "
        "already queued; what is left then is dropped and logged."),
    "load_failure_policy": _Key(
        "recompute", str, lambda v: v in ("recompute", "fail"), "'recompute' or 'fail'",
        "What the engine does with blocks that fail to load (missing, corrupt, store down): recompute "
        "them, or fail the request with an error (strict)."),
    "verify_loads": _Key(
        False, _parse_bool, lambda v: True, "true or false",
        "Test mode: the worker checks every loaded block's bytes against the checksum taken when it was stored."),
    "layerwise": _Key(
        False, _parse_bool, lambda v: True, "true or false",
        "Move KV layer by layer, overlapped with the model's compute: hits loaded within the step "
        "(in_step_load_bytes) load during the forward, each layer waited for alone; stores start as each "
        "layer's KV is written."),
    "in_step_load_bytes": _Key(
        "64MiB", parse_bytes, lambda v: v >= 0, "a byte count >= 0, as an integer or a string such as '64MiB'",
        "A hit held whole in the host pool, of up to this many bytes per worker, is copied into the device "
        "cache within the engine's step that computes the rest of its prompt (vLLM's synchronous load), "
        "as vLLM's own prefix cache would serve it; a larger one, and any hit read from a tier below, loads "
        "beside the steps and is scheduled once loaded (a step later at least). 0: every hit loads beside "
        "the steps."),
    "save_only_first_rank": _Key(
        False, _parse_bool, lambda v: True, "true or false",
        "Tensor parallelism with KV that every rank holds alike (MLA; one replicated KV head): only rank 0 "
        "stores, and on a hit rank 0 reads and broadcasts to the other ranks in shards."),
    "broadcast_shard_blocks": _Key(
        16, _parse_int, lambda v: 1 <= v <= 1_000_000, "an integer from 1 to 1000000",
        "Blocks per broadcast shard: about 2 shards of receive buffers are alive on a rank at once."),
    "entry_key_file": _Key(
        None, _parse_optional_str, lambda v: v is None or _valid_key_file(v),
        "null, or the path of a file of at least 16 bytes readable by its owner only (mode 600)",
        "A secret shared by the instances that trust each other: every entry written is tagged with a keyed "
        "BLAKE3 MAC of its header and bytes, and only entries with a valid tag load. Without it, checksums "
        "catch damage but not entries planted by whoever can write to disk_dir or the pool."),
    "model_id": _Key(
        None, _parse_optional_str, lambda v: True,
        "a string, or null: a hub model by its name, a local one by its files' content alone",
        "Model identity mixed into every key (beside the weights' content fingerprint, which is always there): "
        "a local model's path is not, so the same files mounted elsewhere share KV."),
    "config_file": _Key(
        None, _parse_optional_str, lambda v: v is None or Path(v).is_file(), "the path of an existing YAML file",
        "YAML file with any of these keys (also KVTIER_CONFIG)."),
}


@dataclass(frozen=True)
class KVTierConfig:
    host_bytes: int
    tiers: tuple[str, ...] | None
    disk_dir: str | None
    disk_bytes: int
    block_size: int | None
    store_partial_block: bool
    disk_io_threads: int
    copy_threads: int
    remote_url: str | None
    node_socket: str | None
    remote_timeout_s: float
    remote_retry_s: float
    remote_ttl_s: float
    remote_answer_s: float
    remote_audit_s: float
    store_to: tuple[str, ...]
    load_timeout_s: float
    handoff_stall_s: float
    idle_step_wait_s: float
    shutdown_flush_s: float
    load_failure_policy: str
    verify_loads: bool
    layerwise: bool
    in_step_load_bytes: int
    save_only_first_rank: bool
    broadcast_shard_blocks: int
    entry_key_file: str | None
    model_id: str | None
    config_file: str | None

    @classmethod
    def from_sources(
        cls,
        extra_config: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> "KVTierConfig":
        """Merge defaults, YAML, ``KVTIER_*`` variables and ``extra_config``; validate."""
        environ = os.environ if environ is None else environ
        extra_config = dict(extra_config or {})
        _reject_unknown(extra_config, "kv_connector_extra_config")
        env_values = {
            name[len("KVTIER_"):].lower(): value
            for name, value in environ.items()
            if name.startswith("KVTIER_") and name != "KVTIER_CONFIG"
        }
        _reject_unknown(env_values, "environment (KVTIER_*)")

        config_file = extra_config.get("config_file", env_values.get("config_file", environ.get("KVTIER_CONFIG")))
        raw: dict[str, Any] = {name: key.default for name, key in KEYS.items()}
        loaded: dict[str, Any] = {}
        if config_file is not None:
            raw["config_file"] = config_file
            file_path = _validated("config_file", config_file)
            if file_path is not None:
                loaded = yaml.safe_load(Path(file_path).read_text()) or {}
                if not isinstance(loaded, dict):
                    raise ConfigError(f"kvtier config: {file_path} must hold a mapping of keys, not {type(loaded).__name__}")
                _reject_unknown(loaded, str(file_path))
                raw.update(loaded)
        raw.update(env_values)
        raw.update(extra_config)
        _reject_shorthand_beside_tiers(raw, {*loaded, *env_values, *extra_config})
        if raw.get("node_socket") is not None and raw.get("disk_dir") is not None and \
                "disk_dir" in {*loaded, *env_values, *extra_config}:
            raise ConfigError("kvtier config: key 'node_socket' gives this engine the node's disk, so key 'disk_dir' "
                              "cannot be set beside it (the node server's --disk-dir is the node's disk)")
        return cls(**{name: _validated(name, value) for name, value in raw.items()})

    def tier_entries(self) -> list[TierEntry]:
        """The tiers below the host pool, in lookup order: the ``tiers`` list, or the one its shorthand
        keys stand for (the disk at ``disk_dir`` bounded by ``disk_bytes``, then ``remote_url``)."""
        if self.tiers is not None:
            return _tier_entries(self.tiers, self)
        entries = []
        if self.node_socket:  # the node's disk stands in for this engine's own
            entries.append(f"node://{quote(self.node_socket)}")
        elif self.disk_dir:
            query = urlencode({"max_bytes": self.disk_bytes, "write": "disk" in self.store_to})
            entries.append(f"disk://{quote(os.path.abspath(self.disk_dir))}?{query}")  # a relative one: from here
        if self.remote_url:
            write = urlencode({"write": "remote" in self.store_to})
            entries.append(f"{self.remote_url}{'&' if '?' in self.remote_url else '?'}{write}")
        return _tier_entries(entries, self)

    def replace(self, **changes: Any) -> "KVTierConfig":
        _reject_unknown(changes, "replace()")
        merged = dataclasses.asdict(self) | changes
        if "tiers" in changes:  # the list replaces the shorthand's tiers; what they were set to stays unused
            _reject_shorthand_beside_tiers(merged, changes.keys())
        return KVTierConfig(**{name: _validated(name, value) for name, value in merged.items()})


SHORTHAND = ("disk_dir", "remote_url", "store_to", "node_socket")  # the keys that ``tiers`` stands in for (disk_bytes: its default bound)


def _reject_shorthand_beside_tiers(raw: Mapping[str, Any], given) -> None:
    """Both ways of saying which tiers there are, at once: which one stands is not guessed."""
    try:
        if _parse_tier_list(raw.get("tiers")) is None:
            return
    except ValueError:  # reported, naming the key, where the value is checked
        return
    both = [name for name in SHORTHAND if name in given]
    if both:
        raise ConfigError(f"kvtier config: key 'tiers' lists the tiers, so key '{both[0]}' cannot be set beside it "
                          f"(give each tier's options in its URL: disk:///dir?max_bytes=100GiB&write=false)")


def _reject_unknown(values: Mapping[str, Any], source: str) -> None:
    for name in values:
        if name not in KEYS:
            close = difflib.get_close_matches(name, KEYS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"kvtier config: unknown key '{name}' in {source}{hint} Known keys: {', '.join(sorted(KEYS))}")


def _validated(name: str, value: Any) -> Any:
    key = KEYS[name]
    try:
        parsed = key.parse(value)
        ok = key.check(parsed)
    except (TypeError, ValueError) as error:
        raise not_allowed(name, value, error) from None
    if not ok:
        raise ConfigError(f"kvtier config: key '{name}' has value {redact(repr(value))}, which is not allowed; "
                          f"allowed: {key.allowed}")
    return parsed


def not_allowed(name: str, value: Any, error: BaseException) -> ConfigError:
    """The error for key ``name`` set to ``value``, which ``error`` says is wrong."""
    return ConfigError(f"kvtier config: key '{name}' has value {redact(repr(value))}, which is not allowed "
                       f"({redact(error)}); allowed: {KEYS[name].allowed}")


def markdown_table() -> str:
    """The configuration table of docs/configuration.md, from ``KEYS``."""
    lines = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for name, key in KEYS.items():
        default = "`$XDG_CACHE_HOME/kvtier`" if name == "disk_dir" else f"`{key.default}`"
        lines.append(f"| `{name}` | {default} | {key.allowed} | {key.doc} |")
    return "\n".join(lines)
