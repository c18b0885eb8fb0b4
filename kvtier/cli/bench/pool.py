"""``kvtier bench pool``: the storage pool through kvtier vs the raw client, and
prefill/decode through it.

Put and get GB/s of whole blocks through kvtier's real path (jobs to its I/O
process: header, validation, zero-copy buffers), as a CPU worker's: a put frames
each entry with the checksum that the copy filling its slot took; a get checks
every field of each entry's header and answers its checksum, which the load's copy
to the device compares as it reads the slot (``kvtier bench transfer``'s load
takes it; here it is compared after the clock). Beside it, the store's own client
moves the same bytes in the same run, one batch at a time on both sides:
Mooncake's ``batch_put_from``/``batch_get_into`` on one registered buffer, Redis's
pipelined ``SET``/``GET``. The two take turns batch by batch over 3 rounds, after one
round not counted, in three trials of a new pair each (``throughput``). Then, on a
generated model: the decode instance's time to first token beside recompute, and the
producer's extra time for writing to the pool.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvtier.cli.bench.io_path import IOPath
from kvtier.cli.servers import local_mooncake, local_redis
from kvtier.tiers.base import TierSpec


def _blocks(num_blocks: int, slot_bytes: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (num_blocks, slot_bytes), dtype=np.uint8)


class _TierPath:
    """kvtier's path: jobs to its I/O process, which encodes and checks each entry's header and
    moves values straight between the shared host pool and the pool (zero-copy where it can). The
    slots are filled as a CPU worker's store fills them, by the native copy that takes their
    checksums (``IOPath.fill``), before the clock starts, as the store's copy from the device is."""

    def __init__(self, url: str, payload: np.ndarray):
        from kvtier.tiers.registry import kind_of, module_of

        name, module = kind_of(url).name, module_of(url)
        self.payload = payload
        self.path = IOPath(TierSpec(name, module, url, timeout_s=30.0, retry_s=1.0), len(payload), payload.shape[1])

    def start(self, op: str) -> None:
        if op == "put":  # as a store fills its slots: the copy takes each one's checksum
            self.sums = self.path.fill(self.payload)
        else:
            self.path.slots[:] = 0

    def batch(self, op: str, round_: int, part: range) -> float:
        keys = [i.to_bytes(15, "little") + bytes([round_]) for i in part]
        sums = [self.sums[i] for i in part]
        if op == "put":
            return self.path.job(True, keys, list(part), sums)
        seconds = self.path.job(False, keys, list(part), check_in_copy=True)
        assert self.path.answered_sums == sums, "a get answered other checksums than its entries were put with"
        return seconds

    def check(self) -> None:
        assert np.array_equal(self.path.slots, self.payload), "kvtier read back other bytes than it wrote"

    def close(self) -> None:
        self.path.close()


class _RawClient:
    """The store's own client moving the same bytes, one value per block, no kvtier: Mooncake's
    batch calls on registered memory, or a Redis pipeline."""

    def __init__(self, url: str, payload: np.ndarray):
        self.payload, self.out = payload, np.zeros_like(payload)
        self.mooncake = url.startswith("mooncake")
        if self.mooncake:
            from kvtier.tiers.mooncake import MooncakeClient
            self.store = MooncakeClient(url, 30.0)
            for array in (self.payload, self.out):
                self.store._store.register_buffer(array.ctypes.data, array.nbytes)
        else:
            from kvtier.tiers.redis import RedisClient
            self.store = RedisClient(url, 30.0)

    def start(self, op: str) -> None:
        if op == "get":
            self.out[:] = 0

    def batch(self, op: str, round_: int, part: range) -> float:
        names, size = [f"bench/raw/{round_}/{i}" for i in part], self.payload.shape[1]
        began = time.perf_counter()
        if self.mooncake and op == "put":
            codes = self.store._store.batch_put_from(names, [self.payload[i].ctypes.data for i in part],
                                                     [size] * len(part))
            assert all(code == 0 for code in codes)
        elif self.mooncake:
            codes = self.store._store.batch_get_into(names, [self.out[i].ctypes.data for i in part], [size] * len(part))
            assert all(code == size for code in codes)
        else:
            pipe = self.store._client.pipeline(transaction=False)
            for name, i in zip(names, part):
                if op == "put":
                    pipe.set(name, memoryview(self.payload[i]))
                else:
                    pipe.get(name)
            values = pipe.execute()
            if op == "get":
                for i, value in zip(part, values):
                    self.out[i] = np.frombuffer(value, np.uint8)
        return time.perf_counter() - began

    def check(self) -> None:
        assert np.array_equal(self.out, self.payload), "the raw client read back other bytes than it wrote"

    def clear(self) -> None:
        """Remove every value from the server, kvtier's too."""
        if self.mooncake:
            self.store._store.remove_all(True)
        else:
            self.store._client.flushdb()

    def close(self) -> None:
        self.store.close()


def _batches(num_blocks: int, batch: int) -> list[range]:
    return [range(start, min(start + batch, num_blocks)) for start in range(0, num_blocks, batch)]


def raw_reads(url: str, payload: np.ndarray, batch: int, pauses: list[float], repeats: int = 3) -> list[float]:
    """The raw client's best get of ``payload`` over ``repeats`` gets after each pause in ``pauses``
    (seconds idle before each get); the payload is put once, by the same client."""
    raw = _RawClient(url, payload)
    parts = _batches(len(payload), batch)
    for part in parts:
        raw.batch("put", 0, part)
    best = []
    for pause_s in pauses:
        times = []
        for _ in range(repeats):
            raw.start("get")
            time.sleep(pause_s)
            times.append(sum(raw.batch("get", 0, part) for part in parts))
            raw.check()
        best.append(min(times))
    raw.close()
    return best


def _round_trips(url: str, payload: np.ndarray, batch: int, repeats: int, tier_first: bool = True) -> dict[str, float]:
    """Seconds that a new kvtier path and a new raw client (made in that order, or the other with
    ``tier_first`` False) took to put, then get, every block ``repeats`` times. The two take turns
    batch by batch, each first in every other batch, so that both meet the same machine: on these
    2 cores the same batch's time moves by a third from one moment to the next, and whole passes of
    one side after the other's gave ratios from 0.7x to 1x. Before them, one round that is not
    counted; each round's values are removed before the next, so that the counted rounds write into
    server memory already touched, as a pool that has run a while (the first touch of fresh server
    memory slows a round's puts several times over)."""
    makers = [("tier", _TierPath), ("raw", _RawClient)]
    sides = {name: make(url, payload) for name, make in (makers if tier_first else makers[::-1])}
    totals = {f"{side}_{op}": 0.0 for side in sides for op in ("put", "get")}
    for round_ in range(repeats + 1):
        for op in ("put", "get"):
            for side in sides.values():
                side.start(op)
            for n, part in enumerate(_batches(len(payload), batch)):
                for name in (("tier", "raw") if n % 2 == 0 else ("raw", "tier")):
                    seconds = sides[name].batch(op, round_, part)
                    if round_ > 0:  # round 0 warms both up
                        totals[f"{name}_{op}"] += seconds
        for side in sides.values():
            side.check()
        sides["raw"].clear()
    for side in sides.values():
        side.close()
    return {name: seconds / repeats for name, seconds in totals.items()}


def throughput(mib: int = 256, slot_bytes: int = 1 << 20, batch: int = 16, repeats: int = 3, pairs: int = 3) -> dict:
    """Each store's GB/s through kvtier and through its raw client, over ``pairs`` trials, each with a
    new kvtier path (I/O process and client) and a new raw client, made first in turn. A client keeps
    its pace for its life (two kvtier I/O processes running the same code, taking turns in one run,
    differ steadily), so one pair's ratio moves from run to run; several pairs even that out.
    ``*_vs_raw`` is over every trial's time; ``*_vs_raw_pairs``, each trial's own."""
    payload = _blocks(max(1, (mib << 20) // slot_bytes), slot_bytes)
    results = {"bytes": payload.nbytes, "slot_bytes": slot_bytes, "pairs": pairs}
    for name, context in (("mooncake", lambda: local_mooncake(storage="8GB")),
                          ("redis", lambda: local_redis(maxmemory="4gb"))):  # every round kept: no eviction
        with context() as server:
            trials = [_round_trips(server.url, payload, batch, repeats, tier_first=i % 2 == 0) for i in range(pairs)]
        for op in ("put", "get"):
            tier, raw = (sum(t[f"{side}_{op}"] for t in trials) / pairs for side in ("tier", "raw"))
            results[f"{name}_{op}_gbps"] = payload.nbytes / tier / 1e9
            results[f"{name}_raw_{op}_gbps"] = payload.nbytes / raw / 1e9
            results[f"{name}_{op}_vs_raw"] = raw / tier
            results[f"{name}_{op}_vs_raw_pairs"] = [t[f"raw_{op}"] / t[f"tier_{op}"] for t in trials]
    return results


def disaggregated(workdir: Path, quick: bool) -> dict:
    """Decode-instance TTFT from the pool beside recompute; the producer's extra time."""
    from kvtier.cli.demo.model import make_model

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
            code = subprocess.run([sys.executable, "-m", "kvtier.cli.demo.runner", str(spec_path), str(out_path)],
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
        from kvtier.cli.bench.report import print_table
        rows = []
        for name in ("mooncake", "redis"):
            for op in ("put", "get"):
                pairs = result[f"{name}_{op}_vs_raw_pairs"]
                rows.append((f"{name} {op} GB/s: kvtier / raw client",
                             f"{result[f'{name}_{op}_gbps']:.2f} / {result[f'{name}_raw_{op}_gbps']:.2f} "
                             f"({result[f'{name}_{op}_vs_raw']:.2f}x; pairs {min(pairs):.2f}x to {max(pairs):.2f}x)"))
        rows += [("recompute TTFT", f"{result['pd_recompute_ttft_s']:.3f} s"),
                 ("decode instance TTFT, from the pool",
                  f"{result['pd_decode_ttft_s']:.3f} s ({result['pd_decode_speedup_vs_recompute']:.1f}x faster)"),
                 ("producer TTFT, writing to the pool",
                  f"{result['pd_producer_ttft_s']:.3f} s ({result['pd_producer_overhead_fraction']:+.1%})")]
        print_table(f"kvtier bench pool ({result['bytes'] / 2**20:.0f} MiB in 1 MiB blocks, loopback)", rows)
    return result
