"""``kvtier bench serve``: vLLM's own benchmark client against your model, served three ways in turn.

Servers, one at a time, each vLLM's OpenAI server on loopback with the same model and flags:

- ``none``: no connector;
- ``kvtier``: kvtier with your configuration (``--kvtier-config``, a JSON object of
  ``kv_connector_extra_config``; by default the embedded default with its disk in the workdir);
- ``ideal`` (``--ideal``): no connector, with a device KV cache of ``--ideal-blocks`` blocks,
  one that holds every prefix of the workload.

Each is driven by vLLM's own client (``vllm.benchmarks.serve``: any dataset it has, any
concurrency), the same requests in the same order. The table sets kvtier against the others
measured in the same run: TTFT (mean, median, p99), time per output token, requests per
second, and the prompt tokens kvtier loaded by tier (its ``/metrics``). ``--explain`` adds where
a kvtier hit's time to first token went, phase by phase, from kvtier's own counters
(``kvtier.scheduler.hit_times``), beside the gap to the ideal cache measured by the client.

A fair comparison gives every server the same CPUs. vLLM's CPU build reserves one more core
per rank for its other processes whenever any KV connector is configured (in its layout with
the worker in a process of its own): left alone, the worker computes on fewer cores with
kvtier than without, or, where the reservation exceeds the machine, on more. So every server
here runs with the same ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (``--reserved-cpus``), and the
threads each server's worker computes on are read from its process (the CPUs its OpenMP
threads are bound to): where they differ, the result says so (``fair``: false) and the
command exits with status 3.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# Defaults that run on a small CPU machine in a few minutes on a generated model: shared prefixes
# that return after others pushed them out of a device cache that holds about a third of them.
DATASET = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
           "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "12",
           "--prefix-repetition-output-len", "16", "--num-prompts", "192"]
BLOCKS = 96  # 3,072 tokens at block size 32: about 5 of the 12 prefixes
# kvtier's default here: a host pool of about two of the 12 prefixes (of the default model), so that
# most hits come from the disk tier behind it, the case where kvtier's own path costs the most.
HOST_BYTES = "8MiB"
IDEAL_BLOCKS = 640  # every prefix and every running request's own tokens
VLLM_ARGS = ["--max-model-len", "2048", "--block-size", "32", "--gpu-memory-utilization", "0.3"]
CLIENT = ("import argparse, sys\n"
          "from vllm.benchmarks import serve\n"
          "parser = argparse.ArgumentParser()\n"
          "serve.add_cli_args(parser)\n"
          "serve.main(parser.parse_args(sys.argv[1:]))\n")
START_TIMEOUT_S = 600
STATS_INTERVAL_S = 10.5  # vLLM logs and publishes its stats every 10 s


def worker_threads(pid: int) -> int | None:
    """The threads the model computes on: the number of CPUs the process that computes it is bound
    to (vLLM's CPU worker binds its OpenMP threads, one per CPU, ``OMP_NUM_THREADS`` of them, as
    ``VLLM_CPU_OMP_THREADS_BIND`` and the reservation say). That process is the server's
    ``Worker`` (vLLM's layout with the worker in a process of its own), else its engine core, else
    the server itself. Its environment is no witness: a forked worker's ``/proc`` environment is
    the one its parent started with. None where the server is gone."""
    import psutil

    try:
        server = psutil.Process(pid)
        family = [server, *server.children(recursive=True)]
    except psutil.Error:
        return None
    ranked = sorted(family, key=lambda p: (0 if "Worker" in _title(p) else 1 if "EngineCore" in _title(p) else 2))
    for process in ranked:
        try:
            return len(process.cpu_affinity())
        except psutil.Error:
            continue
    return None


def _title(process) -> str:
    try:
        return " ".join([process.name(), *process.cmdline()[:1]])
    except Exception:
        return ""


def fair(threads: dict[str, int | None]) -> bool:
    """Whether every server's worker computed on the same number of threads (all read)."""
    values = set(threads.values())
    return len(values) == 1 and None not in values


def settled_metrics(server: "Server", timeout_s: float = 40.0) -> str:
    """The ``/metrics`` page once it has kvtier's counters and two reads a stats interval apart
    agree on its hits: vLLM publishes a connector's counters at its next stats interval, not at once."""
    deadline, last, text = time.monotonic() + timeout_s, None, ""
    while time.monotonic() < deadline:
        text = server.metrics()
        figures = (kvtier_hit_tokens(text), _total(text, "vllm:kvtier_hit_requests_total"))
        if "vllm:kvtier_" in text and figures == last:
            return text
        last = figures
        time.sleep(STATS_INTERVAL_S)
    return text


def kvtier_hit_tokens(metrics_text: str) -> dict[str, float]:
    """Prompt tokens kvtier loaded, by tier, from a Prometheus text page."""
    return _labelled(metrics_text, "vllm:kvtier_hit_tokens_total", "tier")


def _labelled(metrics_text: str, name: str, label: str) -> dict[str, float]:
    """One counter's values by one label, summed over the others (engines)."""
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def _total(metrics_text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def explain(metrics_text: str) -> dict:
    """Where kvtier's hits' time to first token went, from its counters on ``/metrics``: the mean
    of each phase over the hits counted (``kvtier.scheduler.hit_times``), in ms, and the phases an
    ideal cache would not have had (all but queue and forward)."""
    from kvtier.scheduler.hit_times import PHASES

    requests = _total(metrics_text, "vllm:kvtier_hit_requests_total")
    seconds = _labelled(metrics_text, "vllm:kvtier_hit_phase_seconds_total", "phase")
    if not requests:
        return {"hit_requests": 0}
    phases_ms = {phase: 1000 * seconds.get(phase, 0.0) / requests for phase in PHASES}
    # Hits copied within the step of their forward, and the rest (loaded beside the steps), apart.
    in_step = _total(metrics_text, "vllm:kvtier_hit_in_step_requests_total")
    in_step_seconds = _labelled(metrics_text, "vllm:kvtier_hit_in_step_phase_seconds_total", "phase")
    paths = {}
    for path, hits, spent in (("in_step", in_step, in_step_seconds),
                              ("beside_steps", requests - in_step,
                               {phase: seconds.get(phase, 0.0) - in_step_seconds.get(phase, 0.0) for phase in PHASES})):
        if hits:
            paths[path] = {"hits": int(hits), "beyond_ideal_ms": sum(1000 * spent.get(phase, 0.0) / hits
                                                                     for phase in PHASES if phase not in IDEAL_PHASES)}
    return {"hit_requests": int(requests),
            "lookup_rounds_per_hit": _total(metrics_text, "vllm:kvtier_hit_lookup_rounds_total") / requests,
            "load_bytes_per_hit": _total(metrics_text, "vllm:kvtier_load_bytes_total") / requests,
            "phases_ms": phases_ms,
            "beyond_ideal_ms": sum(ms for phase, ms in phases_ms.items() if phase not in IDEAL_PHASES),
            "paths": paths}


IDEAL_PHASES = ("queue", "forward")  # what a hit of an ideal device cache spends too


class Server:
    """One vLLM OpenAI server on loopback, started and stopped here."""

    def __init__(self, name: str, model: str, args: list[str], env: dict, port: int, log: Path):
        self.name, self.port, self.log = name, port, log
        # Another process on the port would answer the health check for a server that failed to bind.
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise RuntimeError(f"port {port} on 127.0.0.1 is in use: stop what listens there or pass --port")
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--host", "127.0.0.1", "--port", str(port), *args]
        self._log = open(log, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.name} server exited ({self.process.returncode}); its log: {self.log}\n"
                                   + _tail(self.log))
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the {self.name} server did not start within {timeout_s:.0f} s; its log: {self.log}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as answer:
            return answer.read().decode()

    def stop(self) -> None:
        """Ctrl-C, as a user stops it; one not gone within a minute is killed with its children."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run(model: str, workdir: str, kvtier_config: dict | None = None, dataset: list[str] | None = None,
        concurrency: int = 4, vllm_args: list[str] | None = None, blocks: int | None = BLOCKS,
        ideal: bool = True, ideal_blocks: int = IDEAL_BLOCKS, reserved_cpus: int = 1, port: int = 8321,
        layout: str = "multiprocess", rounds: int = 1, progress=lambda name: None) -> dict:
    """Serve the workload with each server in turn, ``rounds`` times over; their results, measured in
    this run. ``layout``: vLLM's, for every server: "multiprocess" (its default: the engine and its
    worker in processes of their own) or "in_process" (the worker in the engine's process, one GPU's
    layout). With several rounds, each figure is the median of a server's rounds, beside its
    ``spread`` (largest over smallest, less 1): a ratio between servers closer to 1 than their own
    spreads is not told apart by this run. Round r's client draws its prompts with seed r, the same
    for every server, so no round finds what an earlier one stored."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    extra = kvtier_config if kvtier_config is not None else {"disk_dir": str(work / "kv-cache"),
                                                             "host_bytes": HOST_BYTES}
    kv = json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                     "kv_role": "kv_both", "kv_connector_extra_config": extra})
    flags = list(VLLM_ARGS if vllm_args is None else vllm_args)
    sized = [] if blocks is None else ["--num-gpu-blocks-override", str(blocks)]
    servers = {"none": flags + sized, "kvtier": flags + sized + ["--kv-transfer-config", kv]}
    if ideal:
        servers["ideal"] = flags + ["--num-gpu-blocks-override", str(ideal_blocks)]
    # The same reservation for every server (see the module's notes); the rest of the environment as given.
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if layout == "in_process" else "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    measured: dict[str, list[dict]] = {name: [] for name in servers}
    pages = []  # kvtier's /metrics of each round: its counters, summed over rounds by ``explain``
    for round_ in range(rounds):
        # Servers alternate within each round, so a drift of the machine falls on all of them alike.
        for name, args in servers.items():
            progress(name if rounds == 1 else f"{name}, round {round_ + 1} of {rounds}")
            figures, metrics = _serve(name, model, args, env, port, work, concurrency, dataset, seed=round_)
            measured[name].append(figures)
            pages += [metrics] if name == "kvtier" else []
    results = {name: _median(runs) for name, runs in measured.items()}
    results["kvtier"]["explain"] = explain("\n".join(pages))
    threads = {f"{name} {i}": r["worker_threads"] for name, runs in measured.items() for i, r in enumerate(runs)}
    report = {"model": model, "concurrency": concurrency, "dataset": DATASET if dataset is None else dataset,
              "vllm_args": flags, "device_blocks": blocks, "reserved_cpus": reserved_cpus, "layout": layout,
              "kvtier_config": extra, "rounds": rounds,
              "servers": results, "fair": fair(threads)}
    if rounds > 1:
        report["round_figures"] = measured
    for peer in ("none", "ideal"):
        if peer in results:
            report[f"kvtier_vs_{peer}"] = _ratios(results["kvtier"], results[peer])
    return report


FIGURES = ("completed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
           "request_throughput", "output_throughput", "total_input_tokens", "duration")
SPREAD = ("mean_ttft_ms", "mean_tpot_ms", "request_throughput")  # the figures the ratios compare


def _serve(name: str, model: str, args: list[str], env: dict, port: int, work: Path, concurrency: int,
           dataset: list[str] | None, seed: int) -> tuple[dict, str]:
    """One server started, driven by vLLM's client and stopped: its figures, and its /metrics (kvtier's)."""
    server = Server(name, model, args, env, port, work / f"{name}.log")
    try:
        server.wait_ready()
        threads = worker_threads(server.process.pid)
        client = [sys.executable, "-c", CLIENT, "--backend", "vllm", "--base-url", server.url(), "--model", model,
                  "--endpoint", "/v1/completions", "--max-concurrency", str(concurrency), "--seed", str(seed),
                  "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
                  "--save-result", "--result-dir", str(work), "--result-filename", f"{name}.json",
                  "--disable-tqdm", *(DATASET if dataset is None else dataset)]
        with open(work / f"{name}-client.log", "w") as log:
            done = subprocess.run(client, env=env, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM's client failed against the {name} server; its log: "
                               f"{work / f'{name}-client.log'}\n" + _tail(work / f"{name}-client.log"))
        answer = json.loads((work / f"{name}.json").read_text())
        metrics = settled_metrics(server) if name == "kvtier" else ""
    finally:
        server.stop()
    figures = {key: answer.get(key) for key in FIGURES}
    figures.update(worker_threads=threads, hit_tokens_by_tier=kvtier_hit_tokens(metrics))
    return figures, metrics


def _median(runs: list[dict]) -> dict:
    """A server's rounds as one: each figure's median, hit tokens per round, and the spread."""
    import statistics

    if len(runs) == 1:
        return dict(runs[0])
    out = {key: statistics.median(r[key] for r in runs) if all(r.get(key) is not None for r in runs) else None
           for key in FIGURES}
    threads = {r["worker_threads"] for r in runs}
    out["worker_threads"] = threads.pop() if len(threads) == 1 else None  # differing rounds: not fair
    tiers = {tier for r in runs for tier in r["hit_tokens_by_tier"]}
    out["hit_tokens_by_tier"] = {tier: sum(r["hit_tokens_by_tier"].get(tier, 0) for r in runs) / len(runs)
                                 for tier in tiers}
    out["spread"] = {key: max(r[key] for r in runs) / min(r[key] for r in runs) - 1 for key in SPREAD
                     if all(r.get(key) for r in runs)}
    return out


def _ratios(kvtier: dict, peer: dict) -> dict:
    out = {}
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "request_throughput"):
        if kvtier.get(key) is not None and peer.get(key):
            out[key] = kvtier[key] / peer[key]
    return out


def plot(report: dict, path: Path) -> Path | None:
    """TTFT mean, median and p99 of each server, side by side (needs matplotlib: ``kvtier[demo]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(report["servers"])
    keys = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")
    figure, axis = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        axis.bar([k + i * width for k in range(len(keys))], [report["servers"][name][key] or 0 for key in keys],
                 width, label=name)
    axis.set_xticks([k + width * (len(names) - 1) / 2 for k in range(len(keys))], ["mean", "median", "p99"])
    axis.set_ylabel("time to first token (ms)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def explain_rows(report: dict) -> list[tuple[str, str]]:
    """``--explain``: a kvtier hit's mean time by phase, beside the TTFT gap to the ideal cache."""
    figures = report["servers"]["kvtier"].get("explain") or {}
    if not figures.get("hit_requests"):
        return [("where a hit's time goes", "no request loaded from kvtier")]
    rows = [(f"hit: {phase} (mean of {figures['hit_requests']} hits)", f"{ms:.1f} ms")
            for phase, ms in figures["phases_ms"].items()]
    rows.append(("hit: phases an ideal cache has not", f"{figures['beyond_ideal_ms']:.1f} ms "
                                                      f"({figures['lookup_rounds_per_hit']:.1f} lookup rounds, "
                                                      f"{figures['load_bytes_per_hit'] / 2**20:.2f} MiB loaded)"))
    for path, figures_of_path in figures.get("paths", {}).items():
        rows.append((f"hit: beyond an ideal hit, {path.replace('_', ' ')} ({figures_of_path['hits']} hits)",
                     f"{figures_of_path['beyond_ideal_ms']:.1f} ms"))
    if "ideal" in report["servers"]:
        gap = report["servers"]["kvtier"]["mean_ttft_ms"] - report["servers"]["ideal"]["mean_ttft_ms"]
        rows.append(("mean TTFT, kvtier - ideal (every request)", f"{gap:.1f} ms"))
    return rows


def main(args) -> dict:
    from rich.progress import Progress

    from kvtier.cli.bench.report import print_table

    # A SIGTERM (a CI job's timeout, kill) unwinds like Ctrl-C, so the server under way is stopped
    # with its children: it runs in a session of its own and would outlive this process.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.rounds < 1:
        raise SystemExit(f"kvtier bench serve: --rounds must be at least 1, not {args.rounds}")
    model = args.model
    if model is None:
        from kvtier.cli.demo.model import make_model

        model = str(make_model(Path(args.workdir) / "model", num_layers=4, hidden_size=512, num_heads=8))
    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task("bench serve", total=None)
        report = run(model, args.workdir, json.loads(args.kvtier_config) if args.kvtier_config else None,
                     args.client_args.split() if args.client_args else None, args.concurrency,
                     args.vllm_args.split() if args.vllm_args is not None else None,
                     None if args.blocks == 0 else args.blocks, args.ideal, args.ideal_blocks, args.reserved_cpus,
                     args.port, args.layout, args.rounds,
                     lambda name: progress.update(task, description=f"bench serve: {name}"))
    report["plot"] = str(plot(report, Path(args.workdir) / "ttft.png"))
    (Path(args.workdir) / "result.json").write_text(json.dumps(report, indent=2))
    if not args.json:
        rows = []
        for name, r in report["servers"].items():
            hits = ", ".join(f"{tier} {int(n):,}" for tier, n in r["hit_tokens_by_tier"].items()) or "-"
            rows.append((f"{name}: TTFT mean / median / p99", f"{r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / "
                                                               f"{r['p99_ttft_ms']:.0f} ms"))
            rows.append((f"{name}: TPOT mean, requests/s", f"{r['mean_tpot_ms']:.1f} ms, {r['request_throughput']:.2f}"))
            rows.append((f"{name}: worker threads, kvtier hits", f"{r['worker_threads']}, {hits}"))
            if r.get("spread"):
                rows.append((f"{name}: spread of its {report['rounds']} rounds (TTFT, TPOT, requests/s)",
                             ", ".join(f"{100 * r['spread'].get(key, 0):.1f} %" for key in SPREAD)))
        for peer in ("none", "ideal"):
            ratios = report.get(f"kvtier_vs_{peer}", {})
            if ratios:
                rows.append((f"kvtier / {peer}: mean TTFT, requests/s",
                             f"{ratios['mean_ttft_ms']:.2f}x, {ratios['request_throughput']:.2f}x"))
        rows.append(("same CPUs for every server", f"{report['fair']} (VLLM_CPU_NUM_OF_RESERVED_CPU="
                                                   f"{report['reserved_cpus']})"))
        if args.explain:
            rows += explain_rows(report)
        print_table(f"kvtier bench serve ({report['servers']['none']['completed']} requests, concurrency "
                    f"{report['concurrency']})", rows)
    if not report["fair"]:
        print("kvtier bench serve: the servers' workers computed on different numbers of threads "
              f"({ {n: r['worker_threads'] for n, r in report['servers'].items()} }): not a fair comparison",
              file=sys.stderr)
        args.exit_status = 3
    return report
