"""``kvtier bench pool``: the storage pool through kvtier vs the raw client, and
prefill/decode through it.

Put and get GB/s of whole blocks through kvtier's real path (jobs to its I/O
process: header, checksum, validation, zero-copy buffers) beside the store's own
client moving the same bytes in the same run, one batch at a time on both sides: Mooncake's ``batch_put_from``/``batch_get_into`` on one
registered buffer, Redis's pipelined ``SET``/``GET``. Then, on a generated model:
the decode instance's time to first token beside recompute, and the producer's
extra time for writing to the pool.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvtier.bench.io_path import IOPath
from kvtier.servers import local_mooncake, local_redis
from kvtier.tiers.base import TierSpec


def _blocks(num_blocks: int, slot_bytes: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (num_blocks, slot_bytes), dtype=np.uint8)


def _tier_round_trip(url: str, payload: np.ndarray, batch: int, repeats: int) -> tuple[float, float]:
    """kvtier's path: jobs to its I/O process, which encodes and checks each entry's header and
    moves values straight between the shared host pool and the pool (zero-copy where it can)."""
    from kvtier.tiers.registry import SCHEMES

    name, module = SCHEMES[url.split("://")[0]]
    path = IOPath(TierSpec(name, module, url, timeout_s=30.0, retry_s=1.0), len(payload), payload.shape[1])
    path.slots[:] = payload
    put_times, get_times = [], []
    for round_ in range(repeats):
        keys = [i.to_bytes(15, "little") + bytes([round_]) for i in range(len(payload))]
        put_times.append(path.run(True, keys, batch, in_flight=1))
        path.slots[:] = 0
        get_times.append(path.run(False, keys, batch, in_flight=1))
    assert np.array_equal(path.slots, payload), "kvtier read back other bytes than it wrote"
    path.close()
    return min(put_times), min(get_times)


def _raw_round_trip(url: str, payload: np.ndarray, batch: int, repeats: int) -> tuple[float, float]:
    """The store's own client moving the same bytes, one value per block, no kvtier."""
    out = np.zeros_like(payload)
    put_times, get_times = [], []
    if url.startswith("mooncake"):
        from kvtier.tiers.mooncake import MooncakeClient
        store = MooncakeClient(url, 30.0)
        raw = store._store
        for array in (payload, out):
            raw.register_buffer(array.ctypes.data, array.nbytes)
        size = payload.shape[1]
        for round_ in range(repeats):
            names = [f"bench/raw/{round_}/{i}" for i in range(len(payload))]
            began = time.perf_counter()
            for start in range(0, len(names), batch):
                part = range(start, min(start + batch, len(names)))
                codes = raw.batch_put_from([names[i] for i in part], [payload[i].ctypes.data for i in part],
                                           [size] * len(part))
                assert all(code == 0 for code in codes)
            put_times.append(time.perf_counter() - began)
            began = time.perf_counter()
            for start in range(0, len(names), batch):
                part = range(start, min(start + batch, len(names)))
                codes = raw.batch_get_into([names[i] for i in part], [out[i].ctypes.data for i in part],
                                           [size] * len(part))
                assert all(code == size for code in codes)
            get_times.append(time.perf_counter() - began)
    else:
        from kvtier.tiers.redis import RedisClient
        store = RedisClient(url, 30.0)
        client = store._client
        for round_ in range(repeats):
            names = [f"bench/raw/{round_}/{i}" for i in range(len(payload))]
            began = time.perf_counter()
            for start in range(0, len(names), batch):
                pipe = client.pipeline(transaction=False)
                for i in range(start, min(start + batch, len(names))):
                    pipe.set(names[i], memoryview(payload[i]))
                pipe.execute()
            put_times.append(time.perf_counter() - began)
            began = time.perf_counter()
            for start in range(0, len(names), batch):
                pipe = client.pipeline(transaction=False)
                part = range(start, min(start + batch, len(names)))
                for i in part:
                    pipe.get(names[i])
                for i, value in zip(part, pipe.execute()):
                    out[i] = np.frombuffer(value, np.uint8)
            get_times.append(time.perf_counter() - began)
    assert np.array_equal(out, payload)
    store.close()
    return min(put_times), min(get_times)


def throughput(mib: int = 256, slot_bytes: int = 1 << 20, batch: int = 16, repeats: int = 3) -> dict:
    payload = _blocks(max(1, (mib << 20) // slot_bytes), slot_bytes)
    results = {"bytes": payload.nbytes, "slot_bytes": slot_bytes}
    for name, context in (("mooncake", lambda: local_mooncake(storage="8GB")),
                          ("redis", lambda: local_redis(maxmemory="4gb"))):  # every round kept: no eviction
        with context() as server:
            tier_put, tier_get = _tier_round_trip(server.url, payload, batch, repeats)
            raw_put, raw_get = _raw_round_trip(server.url, payload, batch, repeats)
        results.update({
            f"{name}_put_gbps": payload.nbytes / tier_put / 1e9, f"{name}_get_gbps": payload.nbytes / tier_get / 1e9,
            f"{name}_raw_put_gbps": payload.nbytes / raw_put / 1e9, f"{name}_raw_get_gbps": payload.nbytes / raw_get / 1e9,
        })
        results[f"{name}_put_vs_raw"] = results[f"{name}_put_gbps"] / results[f"{name}_raw_put_gbps"]
        results[f"{name}_get_vs_raw"] = results[f"{name}_get_gbps"] / results[f"{name}_raw_get_gbps"]
    return results


def disaggregated(workdir: Path, quick: bool) -> dict:
    """Decode-instance TTFT from the pool beside recompute; the producer's extra time."""
    from kvtier.demo.model import make_model

    size = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2) if quick else \
        dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4)
    prompt_tokens = 1000 if quick else 4000
    model = str(make_model(workdir / f"model-{size['num_layers']}x{size['hidden_size']}", **size))
    rng = random.Random(11)
    plain_prompt = [rng.randrange(3, 2000) for _ in range(prompt_tokens)]
    handed_prompt = [rng.randrange(3, 2000) for _ in range(prompt_tokens)]
    engine = {"max_model_len": 8192, "max_num_seqs": 4}

    def run(name, spec):
        spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
        spec_path.write_text(json.dumps({"model": model, "engine": {**engine, **spec.pop("engine", {})}, **spec}))
        with open(workdir / f"{name}.log", "w") as log:
            code = subprocess.run([sys.executable, "-m", "kvtier.demo.runner", str(spec_path), str(out_path)],
                                  stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise RuntimeError(f"the {name} engine failed; see {workdir / (name + '.log')}")
        return json.loads(out_path.read_text())["phases"][0]["ttft_s"][0]

    recompute = run("recompute", {"phases": [{"prompts": [plain_prompt], "max_tokens": 1}]})
    with local_mooncake(storage="4GB") as server:
        extra = {"remote_url": server.url, "disk_dir": None, "host_bytes": "1GiB"}
        producer = run("producer", {"connector": "kvtier", "extra": extra, "engine": {"role": "kv_producer"},
                                    "phases": [{"prompts": [handed_prompt], "max_tokens": 1}]})
        consumer = run("consumer", {"connector": "kvtier", "extra": extra, "engine": {"role": "kv_consumer"},
                                    "phases": [{"prompts": [handed_prompt], "max_tokens": 1}]})
    return {"pd_prompt_tokens": prompt_tokens, "pd_recompute_ttft_s": recompute, "pd_producer_ttft_s": producer,
            "pd_decode_ttft_s": consumer, "pd_decode_speedup_vs_recompute": recompute / consumer,
            "pd_producer_overhead_fraction": (producer - recompute) / recompute}


def main(args) -> dict:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    result = throughput(mib=64 if args.quick else 512)
    result.update(disaggregated(workdir, args.quick))
    if not args.json:
        from kvtier.bench.report import print_table
        rows = []
        for name in ("mooncake", "redis"):
            rows += [(f"{name} put GB/s: kvtier / raw client",
                      f"{result[f'{name}_put_gbps']:.2f} / {result[f'{name}_raw_put_gbps']:.2f} "
                      f"({result[f'{name}_put_vs_raw']:.2f}x)"),
                     (f"{name} get GB/s: kvtier / raw client",
                      f"{result[f'{name}_get_gbps']:.2f} / {result[f'{name}_raw_get_gbps']:.2f} "
                      f"({result[f'{name}_get_vs_raw']:.2f}x)")]
        rows += [("recompute TTFT", f"{result['pd_recompute_ttft_s']:.3f} s"),
                 ("decode instance TTFT, from the pool",
                  f"{result['pd_decode_ttft_s']:.3f} s ({result['pd_decode_speedup_vs_recompute']:.1f}x faster)"),
                 ("producer TTFT, writing to the pool",
                  f"{result['pd_producer_ttft_s']:.3f} s ({result['pd_producer_overhead_fraction']:+.1%})")]
        print_table(f"kvtier bench pool ({result['bytes'] / 2**20:.0f} MiB in 1 MiB blocks, loopback)", rows)
    return result
