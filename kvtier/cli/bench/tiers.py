"""``kvtier bench tiers``: a hit from each tier inside vLLM, against the floor the bytes allow.

vLLM's one-process layout (the worker in the scheduler's process, as vLLM runs one
GPU; ``--large``: a model with 92 MiB of KV per prompt). For each tier below the
host pool (disk, shared directory, Redis, Mooncake):
a writer process serves the prompts once and exits (its writes flush at exit);
a new reader process, configured with that tier alone, serves each prompt again
(every block from the tier: its host pool is empty) and then at once a third time
(vLLM's own prefix cache hit), prompt after prompt, after one such pair not
counted, which warms up the tier hit's path. Each tier hit and the own hit
it is set against thus meet the process in the same state; on these 2 shared
cores, all tier hits first and all own hits after them gave ratios that moved by
a third from run to run. Measured in the same run, with the same bytes: the
store's raw read bandwidth (plain file reads; the raw Redis and Mooncake clients). The floor
of a tier hit is vLLM's own hit plus the prompt's bytes over that bandwidth.

The same raw read is also timed after a pause of twice vLLM's own hit: about the
time the I/O side sits idle between two loads, while the engine computes a tier
hit's forward and an own hit. On a machine whose idle cores slow down (virtual
machines), bytes read after such a pause move slower than back to back; the floor
keeps the back-to-back figure, and the paused one is reported beside it
(``raw_read_after_pause_gbps``).
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvtier.cli.bench.ttft import _run  # one engine process per run, as every engine benchmark runs it
from kvtier.cli.demo.model import make_model
from kvtier.cli.servers import local_mooncake, local_redis
from kvtier.common.entry import HEADER_BYTES

FULL = dict(num_layers=10, hidden_size=640, num_heads=10, num_kv_heads=2, prompts=8, prompt_tokens=3000)
QUICK = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, prompts=2, prompt_tokens=1000)
# A prompt with as much KV as a small served model's (92 MiB, 2 MiB per block): a load of many I/O jobs.
LARGE = dict(num_layers=16, hidden_size=1024, num_heads=16, num_kv_heads=8, prompts=3, prompt_tokens=3000)
BLOCK = 64
TIERS = ("disk", "file", "redis", "mooncake")


@contextmanager
def _tier(kind: str, workdir: Path):
    """(kvtier settings with this tier alone below the host pool, a raw reader of its bytes)."""
    base = {"host_bytes": "1GiB", "disk_dir": None}
    if kind in ("disk", "file"):
        root = (workdir / f"tier-{kind}").resolve()
        shutil.rmtree(root, ignore_errors=True)
        yield ({**base, "disk_dir": str(root)} if kind == "disk" else {**base, "remote_url": f"file://{root}"},
               lambda blocks, size, pauses: _raw_file_reads(root.parent, blocks, size, pauses))
        return
    context = local_redis() if kind == "redis" else local_mooncake(storage="4GB")
    with context as server:
        yield ({**base, "remote_url": server.url},
               lambda blocks, size, pauses: _raw_pool_reads(server.url, blocks, size, pauses))


def _raw_file_reads(near: Path, blocks: int, size: int, pauses: list[float], repeats: int = 3) -> list[float]:
    """Seconds to read ``blocks`` files of ``size`` bytes with plain reads, the best of ``repeats``
    reads after each pause in ``pauses`` (seconds idle before each read), each file into a place of
    its own in one buffer, as the raw pool clients read (and as a load must land them)."""
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    out = np.empty((blocks, size), np.uint8)
    best = []
    with tempfile.TemporaryDirectory(dir=near, prefix="raw-") as root:
        paths = [os.path.join(root, f"{i:06d}") for i in range(blocks)]
        for path in paths:
            with open(path, "wb") as file:
                file.write(payload)
        for pause_s in pauses:
            times = []
            for _ in range(repeats):
                time.sleep(pause_s)
                began = time.perf_counter()
                for path, place in zip(paths, out):
                    with open(path, "rb", buffering=0) as file:
                        file.readinto(place)
                times.append(time.perf_counter() - began)
            best.append(min(times))
    return best


def _raw_pool_reads(url: str, blocks: int, size: int, pauses: list[float]) -> list[float]:
    from kvtier.cli.bench.pool import raw_reads

    payload = np.random.default_rng(0).integers(0, 256, (blocks, size), dtype=np.uint8)
    return raw_reads(url, payload, blocks, pauses)


def main(args) -> dict:
    size = QUICK if args.quick else LARGE if args.large else FULL
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = str(make_model(workdir / f"model-{size['num_layers']}x{size['hidden_size']}",
                           **{k: size[k] for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads")}))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2000) for _ in range(size["prompt_tokens"])] for _ in range(size["prompts"])]
    full_tokens = size["prompt_tokens"] // BLOCK * BLOCK
    engine = {"block_size": BLOCK, "max_model_len": 8192, "prefix_caching": True, "max_num_seqs": 4}
    phase = lambda name, chosen: {"name": name, "prompts": chosen, "max_tokens": 1}  # noqa: E731
    # Each prompt's tier hit, then its own hit at once: the pair meets the reader in one state. A first
    # pair, not counted, warms up the tier hit's path as the reader's warm-up warms up vLLM's own hit.
    warm = [rng.randrange(3, 2000) for _ in range(size["prompt_tokens"])]
    paired = [phase(name, [prompt]) for prompt in [warm, *prompts] for name in ("tier hit", "own hit")]
    kinds = [k for k in (args.tiers.split(",") if args.tiers else TIERS)]
    result = {"model": f"{size['num_layers']} layers x {size['hidden_size']} wide, {size['num_kv_heads']} KV heads",
              "prompts": len(prompts), "prompt_tokens": size["prompt_tokens"], "block_size": BLOCK, "tiers": {}}
    for kind in kinds:
        with _tier(kind, workdir) as (extra, raw_read):
            spec = {"model": model, "engine": engine, "connector": "kvtier", "extra": extra}
            _run({**spec, "warmup": False, "phases": [phase("store", [warm, *prompts])]}, workdir, f"{kind}-writer")
            # Warmed up over a context as long as the prompts': the first such forward is slower.
            reader = _run({**spec, "warmup_tokens": size["prompt_tokens"], "phases": paired}, workdir, f"{kind}-reader")
            hits, owns = reader["phases"][2::2], reader["phases"][3::2]
            tier_ttft = statistics.median(p["ttft_s"][0] for p in hits)
            own_ttft = statistics.median(p["ttft_s"][0] for p in owns)
            prompt_bytes = sum(p["kvtier_delta"]["load_bytes"] for p in hits) / len(prompts)
            blocks = full_tokens // BLOCK
            entry_bytes = int(prompt_bytes // blocks) + HEADER_BYTES
            pause_s = 2 * own_ttft
            back_to_back_s, paused_s = raw_read(blocks, entry_bytes, [0.0, pause_s])
            raw_gbps = blocks * entry_bytes / back_to_back_s / 1e9
            paused_gbps = blocks * entry_bytes / paused_s / 1e9
        floor = own_ttft + prompt_bytes / (raw_gbps * 1e9)
        paused_floor = own_ttft + prompt_bytes / (paused_gbps * 1e9)
        served = [p["outputs"]["0"]["cached"] / full_tokens for p in hits]
        result["tiers"][kind] = {
            "hit_ttft_s": tier_ttft, "own_prefix_cache_ttft_s": own_ttft, "prompt_bytes": prompt_bytes,
            "raw_read_gbps": raw_gbps, "floor_s": floor, "hit_vs_floor": tier_ttft / floor,
            "raw_read_after_pause_gbps": paused_gbps, "pause_s": pause_s,
            "hit_vs_floor_after_pause": tier_ttft / paused_floor,
            "blocks_served_fraction": statistics.mean(served),
            "tier_hit_tokens": sum(p["kvtier_delta"].get(f"hit_tokens_{kind}", 0) for p in hits),
        }
    if not args.json:
        from kvtier.cli.bench.report import print_table
        rows = []
        for kind, r in result["tiers"].items():
            rows.append((f"{kind}: hit TTFT / floor (own hit {r['own_prefix_cache_ttft_s'] * 1e3:.0f} ms + "
                         f"{r['prompt_bytes'] / 2**20:.1f} MiB at {r['raw_read_gbps']:.2f} GB/s)",
                         f"{r['hit_ttft_s'] * 1e3:.0f} / {r['floor_s'] * 1e3:.0f} ms ({r['hit_vs_floor']:.2f}x), "
                         f"{r['blocks_served_fraction']:.0%} of blocks"))
            rows.append((f"{kind}: raw read after a pause of {r['pause_s'] * 1e3:.0f} ms",
                         f"{r['raw_read_after_pause_gbps']:.2f} GB/s (hit / that floor "
                         f"{r['hit_vs_floor_after_pause']:.2f}x)"))
        print_table(f"kvtier bench tiers: {result['model']}, {len(prompts)} x {size['prompt_tokens']}-token prompts, "
                    f"block {BLOCK}, one-process layout", rows)
    return result
