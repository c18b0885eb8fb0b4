"""``kvtier bench ttft``: time to first token, recompute vs kvtier vs ExampleConnector.

One generated model, six engine processes, every figure from this run:
- recompute: unique prompts, no connector, in one process before kvtier's and one after
  (a machine's pace drifts by 10% to 20% between processes on shared cores: the median of
  both brackets kvtier's);
- kvtier cold: as many other unique prompts, each stored as it is computed (the store's extra
  cost), their median;
- kvtier host hit: the first of those again, vLLM's own prefix cache reset first;
- kvtier disk hit: a new process on the same disk directory;
- ExampleConnector: stores the prompt, then serves it from its files in a new process;
- a multi-turn workload whose working set exceeds vLLM's KV cache, with no
  connector, ExampleConnector and kvtier (total seconds).
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from kvtier.cli.demo.model import make_model

FULL = dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4, conversations=3, turns=3,
            history_tokens=1500, turn_tokens=150, num_blocks=160)
QUICK = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, conversations=2, turns=2,
             history_tokens=600, turn_tokens=100, num_blocks=64)
COLD_PROMPTS = 3  # unique prompts per cold measurement, in each process


def _tokens(rng, n):
    return [rng.randrange(3, 2000) for _ in range(n)]


def _multi_turn(size, rng) -> list[list[int]]:
    histories = [_tokens(rng, size["history_tokens"]) for _ in range(size["conversations"])]
    prompts = []
    for _ in range(size["turns"]):
        for i in range(len(histories)):
            histories[i] = histories[i] + _tokens(rng, size["turn_tokens"])
            prompts.append(list(histories[i]))
    return prompts


def _run(spec: dict, workdir: Path, name: str) -> dict:
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    with open(workdir / f"{name}.log", "w") as log:
        code = subprocess.run([sys.executable, "-m", "kvtier.cli.demo.runner", str(spec_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"the {name} engine failed; see {workdir / (name + '.log')}")
    return json.loads(out_path.read_text())


def main(args) -> dict:
    size = QUICK if args.quick else FULL
    prompt_tokens = min(args.prompt_tokens, 1000) if args.quick else args.prompt_tokens
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("kvtier-disk", "example-files"):
        shutil.rmtree(workdir / stale, ignore_errors=True)
    model = str(make_model(workdir / f"model-{size['num_layers']}x{size['hidden_size']}",
                           **{k: size[k] for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads")}))
    rng = random.Random(3)
    cold_prompts = [_tokens(rng, prompt_tokens) for _ in range(COLD_PROMPTS)]
    shared_prompt = _tokens(rng, prompt_tokens)
    kvtier_cold = [shared_prompt] + [_tokens(rng, prompt_tokens) for _ in range(COLD_PROMPTS - 1)]
    workload = _multi_turn(size, rng)
    engine = {"num_blocks": size["num_blocks"], "max_model_len": min(8192, (size["num_blocks"] - 1) * 32),
              "prefix_caching": True, "max_num_seqs": 4}
    kvtier_extra = {"disk_dir": str(workdir / "kvtier-disk"), "host_bytes": "2GiB"}
    example_extra = {"shared_storage_path": str(workdir / "example-files")}

    def phase(name, prompts, reset=False):
        return {"name": name, "prompts": prompts, "max_tokens": 1 if name != "workload" else 8,
                "reset_prefix_cache": reset}

    progress = _progress(args, 6)
    none = _run({"model": model, "engine": engine, "phases": [
        phase("recompute", cold_prompts), phase("workload", workload)]}, workdir, "none")
    progress()
    kvtier = _run({"model": model, "engine": engine, "connector": "kvtier", "extra": kvtier_extra, "phases": [
        phase("cold", kvtier_cold), phase("host hit", [shared_prompt], reset=True),
        phase("workload", workload, reset=True)]}, workdir, "kvtier")
    progress()
    none_after = _run({"model": model, "engine": engine, "phases": [phase("recompute", cold_prompts)]},
                      workdir, "none-after")
    progress()
    kvtier_restart = _run({"model": model, "engine": engine, "connector": "kvtier", "extra": kvtier_extra,
                           "phases": [phase("disk hit", [shared_prompt])]}, workdir, "kvtier-restart")
    progress()
    example = _run({"model": model, "engine": engine, "connector": "example", "extra": example_extra, "phases": [
        phase("cold", [shared_prompt]), phase("workload", workload, reset=True)]}, workdir, "example")
    progress()
    example_restart = _run({"model": model, "engine": engine, "connector": "example", "extra": example_extra,
                            "phases": [phase("hit", [shared_prompt])]}, workdir, "example-restart")
    progress()

    first = lambda result, i: result["phases"][i]["ttft_s"][0]  # noqa: E731
    recomputes = none["phases"][0]["ttft_s"] + none_after["phases"][0]["ttft_s"]
    recompute = statistics.median(recomputes)
    result = {
        "model": f"{size['num_layers']} layers x {size['hidden_size']} wide, {size['num_kv_heads']} KV heads",
        "prompt_tokens": prompt_tokens,
        "recompute_ttft_s": recompute,
        "recompute_ttft_runs_s": recomputes,  # the process before kvtier's, then the one after
        "kvtier_cold_ttft_s": statistics.median(kvtier["phases"][0]["ttft_s"]),
        "kvtier_cold_ttft_runs_s": kvtier["phases"][0]["ttft_s"],
        "kvtier_host_ttft_s": first(kvtier, 1),
        "kvtier_disk_ttft_s": first(kvtier_restart, 0),
        "example_cold_ttft_s": first(example, 0),
        "example_hit_ttft_s": first(example_restart, 0),
        "kvtier_host_cached_tokens": kvtier["phases"][1]["outputs"]["0"]["cached"],
        "kvtier_disk_cached_tokens": kvtier_restart["phases"][0]["outputs"]["0"]["cached"],
        "example_cached_tokens": example_restart["phases"][0]["outputs"]["0"]["cached"],
        "workload_requests": len(workload),
        "workload_prompt_tokens": sum(len(p) for p in workload),
        "vllm_cache_tokens": size["num_blocks"] * 32,
        "workload_s_none": none["phases"][1]["seconds"],
        "workload_s_example": example["phases"][1]["seconds"],
        "workload_s_kvtier": kvtier["phases"][2]["seconds"],
        "workload_ttft_median_s_none": statistics.median(none["phases"][1]["ttft_s"]),
        "workload_ttft_median_s_example": statistics.median(example["phases"][1]["ttft_s"]),
        "workload_ttft_median_s_kvtier": statistics.median(kvtier["phases"][2]["ttft_s"]),
    }
    result["host_speedup_vs_recompute"] = recompute / result["kvtier_host_ttft_s"]
    result["disk_speedup_vs_recompute"] = recompute / result["kvtier_disk_ttft_s"]
    result["example_speedup_vs_recompute"] = recompute / result["example_hit_ttft_s"]
    result["store_overhead_fraction"] = (result["kvtier_cold_ttft_s"] - recompute) / recompute
    result["workload_kvtier_vs_example"] = result["workload_s_example"] / result["workload_s_kvtier"]
    if not args.json:
        _print(result)
    return result


def _progress(args, total):
    from rich.progress import Progress

    progress = Progress(transient=True, disable=args.json)
    progress.start()
    task = progress.add_task(f"bench ttft ({total} engine processes)", total=total)

    def advance():
        progress.advance(task)
        if progress.finished:
            progress.stop()
    return advance


def _print(r: dict) -> None:
    from kvtier.cli.bench.report import print_table

    print_table(f"kvtier bench ttft: {r['model']}, {r['prompt_tokens']}-token prompt", [
        ("recompute TTFT (median, before and after kvtier)", f"{r['recompute_ttft_s']:.3f} s"),
        ("kvtier host hit TTFT (x faster)", f"{r['kvtier_host_ttft_s']:.3f} s ({r['host_speedup_vs_recompute']:.1f}x)"),
        ("kvtier disk hit, new process (x faster)",
         f"{r['kvtier_disk_ttft_s']:.3f} s ({r['disk_speedup_vs_recompute']:.1f}x)"),
        ("ExampleConnector hit, new process (x faster)",
         f"{r['example_hit_ttft_s']:.3f} s ({r['example_speedup_vs_recompute']:.1f}x)"),
        ("kvtier cold TTFT, median (store overhead)",
         f"{r['kvtier_cold_ttft_s']:.3f} s ({r['store_overhead_fraction']:+.1%})"),
        (f"workload: {r['workload_requests']} requests, no connector", f"{r['workload_s_none']:.2f} s"),
        ("workload, ExampleConnector", f"{r['workload_s_example']:.2f} s"),
        ("workload, kvtier (x vs ExampleConnector)",
         f"{r['workload_s_kvtier']:.2f} s ({r['workload_kvtier_vs_example']:.2f}x)"),
    ])
