"""``kvtier demo``: vLLM serving long shared prefixes, with and without kvtier.

The workload: questions over long documents and multi-turn conversations, in an
order where a prefix comes back only after others have pushed it out of vLLM's
own KV cache (capped below the working set). Four phases, three processes:

- no connector: vLLM alone (its own prefix cache on), the workload twice;
- kvtier cold: first pass with kvtier (everything computed and stored);
- kvtier warm: the same workload again in the same process (host pool hits);
- kvtier after restart: a new process on the same disk directory (disk hits).

Prints, per phase, time to first token (median, p90), tokens served per tier and
bytes moved; writes ``ttft.png`` with every request's time to first token.
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

FULL = dict(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4, document_tokens=1500,
            num_documents=3, questions_per_document=3, conversations=2, turns=3, num_blocks=128)
QUICK = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, document_tokens=600,
             num_documents=3, questions_per_document=2, conversations=1, turns=2, num_blocks=64)


def build_workload(size: dict, seed: int = 0) -> list[list[int]]:
    """Prompts as token ids, interleaved so that each prefix returns after the others."""
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(3, 2000) for _ in range(n)]

    documents = [tokens(size["document_tokens"]) for _ in range(size["num_documents"])]
    prompts = []
    for _ in range(size["questions_per_document"]):  # round-robin over documents
        prompts += [document + tokens(64) for document in documents]
    histories = [tokens(size["document_tokens"] // 2) for _ in range(size["conversations"])]
    for _ in range(size["turns"]):  # each turn resends the conversation so far plus a new message
        for i in range(len(histories)):
            histories[i] = histories[i] + tokens(96)
            prompts.append(list(histories[i]))
    return prompts


def _run_process(spec: dict, workdir: Path, name: str, progress, task) -> dict:
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    log = open(workdir / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.demo.runner", str(spec_path), str(out_path)],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    for line in proc.stdout:
        if line.startswith("kvtier-progress"):
            progress.advance(task)
    if proc.wait() != 0:
        raise RuntimeError(f"the {name} engine failed; see {workdir / (name + '.log')}")
    return json.loads(out_path.read_text())


def _summary(phase: dict) -> dict:
    ttfts = sorted(t for t in phase["ttft_s"] if t is not None)
    p90 = ttfts[min(len(ttfts) - 1, int(round(0.9 * (len(ttfts) - 1))))]
    delta = phase.get("kvtier_delta", {})
    return {"name": phase["name"], "requests": len(ttfts), "ttft_median_s": statistics.median(ttfts),
            "ttft_p90_s": p90, "host_hit_tokens": delta.get("hit_tokens_host", 0),
            "disk_hit_tokens": delta.get("hit_tokens_disk", 0),
            "engine_cached_tokens": sum(o["cached"] for o in phase["outputs"].values()),
            "loaded_bytes": delta.get("load_bytes", 0), "stored_bytes": delta.get("store_bytes", 0)}


def main(args) -> dict:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    size = QUICK if args.quick else FULL
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    disk_dir = workdir / "disk"
    shutil.rmtree(disk_dir, ignore_errors=True)
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 130)
    console.print(f"kvtier demo: generating a {size['num_layers']}-layer, {size['hidden_size']}-wide random Llama "
                  f"in {workdir / 'model'} (nothing is downloaded)")
    model = str(make_model(workdir / f"model-{size['num_layers']}x{size['hidden_size']}",
                           **{k: size[k] for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads")}))
    prompts = build_workload(size)
    # vLLM keeps one block back, and refuses a max_model_len its cache cannot hold.
    engine = {"num_blocks": size["num_blocks"], "max_model_len": min(4096, (size["num_blocks"] - 1) * 32),
              "prefix_caching": True, "max_num_seqs": 4}
    working_set = sum(len(p) for p in prompts)
    console.print(f"{len(prompts)} requests, {working_set} prompt tokens; vLLM's own KV cache holds "
                  f"{size['num_blocks'] * 32} tokens")
    phase = lambda name: {"name": name, "mode": "sequential", "prompts": prompts, "max_tokens": 8}  # noqa: E731
    extra = {"disk_dir": str(disk_dir), "host_bytes": "1GiB"}
    with Progress(console=console) as progress:
        task = progress.add_task("serving", total=len(prompts) * 5)
        baseline = _run_process({"model": model, "engine": engine, "phases": [phase("no connector"),
                                                                                phase("no connector, again")]},
                                workdir, "baseline", progress, task)
        first = _run_process({"model": model, "connector": "kvtier", "extra": extra, "engine": engine,
                              "phases": [phase("kvtier cold"), phase("kvtier warm (host)")]},
                             workdir, "kvtier", progress, task)
        restarted = _run_process({"model": model, "connector": "kvtier", "extra": extra, "engine": engine,
                                  "phases": [phase("kvtier after restart (disk)")]}, workdir, "restart", progress, task)
    phases = baseline["phases"] + first["phases"] + restarted["phases"]
    summaries = [_summary(p) for p in phases]
    table = Table(title="kvtier demo: time to first token per phase")
    for column in ("phase", "requests", "TTFT median", "TTFT p90", "vLLM cache hits", "host hits", "disk hits",
                   "loaded", "stored"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for s in summaries:
        table.add_row(s["name"], str(s["requests"]), f"{s['ttft_median_s'] * 1000:.0f} ms",
                      f"{s['ttft_p90_s'] * 1000:.0f} ms",
                      f"{s['engine_cached_tokens'] - s['host_hit_tokens'] - s['disk_hit_tokens']} tok",
                      f"{s['host_hit_tokens']} tok", f"{s['disk_hit_tokens']} tok",
                      f"{s['loaded_bytes'] / 1e6:.1f} MB", f"{s['stored_bytes'] / 1e6:.1f} MB")
    console.print(table)
    reference = {i: o["tokens"] for i, o in baseline["phases"][0]["outputs"].items()}
    same = {p["name"]: sum(o["tokens"] == reference[i] for i, o in p["outputs"].items()) for p in phases}
    console.print("outputs equal to the first no-connector phase's: "
                  + ", ".join(f"{name} {count}/{len(reference)}" for name, count in same.items()))
    plot = _plot(phases, workdir / "ttft.png")
    console.print(f"per-request time to first token: {plot}")
    return {"phases": summaries, "plot": str(plot), "working_set_tokens": working_set,
            "vllm_cache_tokens": size["num_blocks"] * 32, "same_tokens_as_no_connector": same}


def _plot(phases: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5))
    for phase in phases:
        axes.plot([t * 1000 for t in phase["ttft_s"]], marker="o", markersize=3, label=phase["name"])
    axes.set_xlabel("request (in workload order)")
    axes.set_ylabel("time to first token (ms)")
    axes.set_yscale("log")
    axes.set_title("kvtier demo: time to first token per request")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
