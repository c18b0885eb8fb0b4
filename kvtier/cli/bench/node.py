"""``kvtier bench node``: hits through the node cache server, each against its peer in the same run.

vLLM's one-process layout, one engine process per run, every hit after a reset of vLLM's own
prefix cache (so that kvtier serves it). A node server (``kvtier serve node``, with a disk) and
embedded kvtier (its own host pool and disk) serve the same prompts:

- embedded: an engine stores the prompts, then hits each in its own host pool; a new engine
  process on the same disk hits each from the disk (today's restart);
- node: engine A stores the prompts (into the node, through its own host pool) and hits each in
  its own host pool; a new engine B hits each in the node (A's entries), then at once in its own
  host pool (the pair meets B in one state); A restarted hits each in the node.

The figures: (a) B's hit through the server / an embedded host hit; (b) B's hit on A's entries /
B's own host hit; (c) the first request after a restart with the node / A's warm host hit, and
/ a disk hit after a restart without it. Each is a median over the prompts; the first prompt of
each process (not counted) warms its path up.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path

from kvtier.cli.bench.ttft import _run  # one engine process per run, as every engine benchmark runs it
from kvtier.cli.demo.model import make_model
from kvtier.cli.servers import local_node

FULL = dict(num_layers=6, hidden_size=512, num_heads=8, num_kv_heads=2, prompts=5, prompt_tokens=2000)
QUICK = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, prompts=2, prompt_tokens=600)
BLOCK = 32


def _median_ttft(run: dict, name: str) -> float:
    phases = [p for p in run["phases"] if p["name"] == name][1:]  # the first prompt warms the path up
    return statistics.median(p["ttft_s"][0] for p in phases)


def _served(run: dict, name: str, tier: str) -> int:
    return sum(p["kvtier_delta"].get(f"hit_tokens_{tier}", 0) for p in run["phases"] if p["name"] == name)


def _median_phases(run: dict, name: str) -> dict[str, float]:
    """Where a hit's time to first token went (``kvtier.scheduler.hit_times``), phase by phase: each
    phase's median over the counted prompts (one hit each)."""
    phases = [p["kvtier_delta"]["hit_phase_seconds"] for p in run["phases"] if p["name"] == name][1:]
    return {phase: statistics.median(p[phase] for p in phases) for phase in phases[0]}


def main(args) -> dict:
    size = QUICK if args.quick else FULL
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = str(make_model(workdir / f"model-{size['num_layers']}x{size['hidden_size']}",
                           **{k: size[k] for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads")}))
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 2000) for _ in range(size["prompt_tokens"])] for _ in range(size["prompts"] + 1)]
    engine = {"block_size": BLOCK, "max_model_len": 8192, "prefix_caching": True, "max_num_seqs": 4}

    def hit(name, prompt):
        return {"name": name, "prompts": [prompt], "max_tokens": 1, "reset_prefix_cache": True}

    def spec(extra, phases):
        return {"model": model, "engine": engine, "connector": "kvtier", "extra": {"host_bytes": "1GiB", **extra},
                "warmup_tokens": size["prompt_tokens"], "phases": phases}

    store = {"name": "store", "prompts": prompts, "max_tokens": 1}
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-node-") as folder:
        embedded = {"disk_dir": f"{folder}/embedded-disk"}
        own = _run(spec(embedded, [store] + [hit("host hit", p) for p in prompts]), workdir, "embedded")
        restart = _run(spec(embedded, [hit("disk hit after restart", p) for p in prompts]), workdir, "embedded-restart")
        with local_node(folder, host_bytes="2GiB", log_path=str(workdir / "node-server.log")) as node:
            shared = {"node_socket": node.socket_path}
            a = _run(spec(shared, [store] + [hit("host hit", p) for p in prompts]), workdir, "node-a")
            b = _run(spec(shared, [hit(name, p) for p in prompts for name in ("hit on A's", "own host hit")]),
                     workdir, "node-b")
            again = _run(spec(shared, [hit("after restart", p) for p in prompts]), workdir, "node-a-restart")
    ttft = {
        "recompute": statistics.median(own["phases"][0]["ttft_s"][1:]),
        "embedded_host_hit": _median_ttft(own, "host hit"),
        "embedded_disk_hit_after_restart": _median_ttft(restart, "disk hit after restart"),
        "node_a_host_hit": _median_ttft(a, "host hit"),
        "node_b_hit_on_a": _median_ttft(b, "hit on A's"),
        "node_b_own_host_hit": _median_ttft(b, "own host hit"),
        "node_after_restart": _median_ttft(again, "after restart"),
    }
    full = size["prompt_tokens"] // BLOCK * BLOCK
    result = {
        "model": f"{size['num_layers']} layers x {size['hidden_size']} wide, {size['num_kv_heads']} KV heads",
        "prompts": size["prompts"], "prompt_tokens": size["prompt_tokens"], "block_size": BLOCK,
        "ttft_s": ttft,
        "ratios": {
            "a_node_hit_vs_embedded_host_hit": ttft["node_b_hit_on_a"] / ttft["embedded_host_hit"],
            "b_hit_on_a_vs_own_host_hit": ttft["node_b_hit_on_a"] / ttft["node_b_own_host_hit"],
            "c_after_restart_vs_warm_host_hit": ttft["node_after_restart"] / ttft["node_a_host_hit"],
            "c_after_restart_vs_embedded_disk_hit_after_restart":
                ttft["node_after_restart"] / ttft["embedded_disk_hit_after_restart"],
        },
        # Where (b)'s two hits spend their time: what the node's hit adds, phase by phase.
        "phase_s": {"node_b_hit_on_a": _median_phases(b, "hit on A's"),
                    "node_b_own_host_hit": _median_phases(b, "own host hit")},
        # Where each kind of hit came from (tokens over every prompt, the warm-up one included).
        "served_tokens": {
            "embedded_host_hit": _served(own, "host hit", "host"),
            "embedded_disk_hit_after_restart": _served(restart, "disk hit after restart", "disk"),
            "node_b_hit_on_a": _served(b, "hit on A's", "node"),
            "node_b_own_host_hit": _served(b, "own host hit", "host"),
            "node_after_restart": _served(again, "after restart", "node"),
            "expected_per_kind": full * len(prompts),
        },
    }
    if not args.json:
        from kvtier.cli.bench.report import print_table
        ms = {k: f"{v * 1e3:.1f} ms" for k, v in ttft.items()}
        r = result["ratios"]
        print_table(f"kvtier bench node: {result['model']}, {size['prompts']} x {size['prompt_tokens']}-token prompts, "
                    f"one-process layout", [
                        ("recompute (no hit)", ms["recompute"]),
                        ("(a) B's hit through the node / embedded host hit",
                         f"{ms['node_b_hit_on_a']} / {ms['embedded_host_hit']} ({r['a_node_hit_vs_embedded_host_hit']:.2f}x)"),
                        ("(b) B's hit on A's entries / B's own host hit",
                         f"{ms['node_b_hit_on_a']} / {ms['node_b_own_host_hit']} ({r['b_hit_on_a_vs_own_host_hit']:.2f}x)"),
                        ("(c) after a restart, node / A's warm host hit",
                         f"{ms['node_after_restart']} / {ms['node_a_host_hit']} ({r['c_after_restart_vs_warm_host_hit']:.2f}x)"),
                        ("(c) after a restart, node / embedded disk hit",
                         f"{ms['node_after_restart']} / {ms['embedded_disk_hit_after_restart']} "
                         f"({r['c_after_restart_vs_embedded_disk_hit_after_restart']:.2f}x)")] + [
                        (f"(b) phase {phase}: on A's / own",
                         f"{result['phase_s']['node_b_hit_on_a'][phase] * 1e3:.1f} / "
                         f"{result['phase_s']['node_b_own_host_hit'][phase] * 1e3:.1f} ms")
                        for phase in result["phase_s"]["node_b_hit_on_a"]])
    return result
