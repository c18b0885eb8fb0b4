"""``kvtier bench serve``: its fairness check and metric reading, and a short run with three real
vLLM servers on a generated model, each worker computing on the same CPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvtier.cli.bench import serve


def test_a_comparison_is_fair_only_when_every_worker_was_read_and_they_agree():
    assert serve.fair({"none": 1, "kvtier": 1, "ideal": 1})
    assert not serve.fair({"none": 1, "kvtier": 2})  # vLLM reserved one more core beside a connector
    assert not serve.fair({"none": None, "kvtier": 1})  # a worker not read is no evidence


def test_hit_tokens_are_read_by_tier_from_the_metrics_page():
    page = "\n".join([
        '# HELP vllm:kvtier_hit_tokens_total prompt tokens loaded',
        'vllm:kvtier_hit_tokens_total{engine="0",model_name="m",tier="host"} 512.0',
        'vllm:kvtier_hit_tokens_total{engine="0",model_name="m",tier="disk"} 1024.0',
        'vllm:kvtier_miss_tokens_total{engine="0",model_name="m",reason="never_stored"} 64.0'])
    assert serve.kvtier_hit_tokens(page) == {"host": 512.0, "disk": 1024.0}


def test_explain_gives_each_phase_its_mean_per_hit_from_kvtiers_counters():
    labels = 'engine="0",model_name="m"'
    page = "\n".join([
        f'vllm:kvtier_hit_requests_total{{{labels}}} 4.0',
        f'vllm:kvtier_hit_lookup_rounds_total{{{labels}}} 2.0',
        f'vllm:kvtier_load_bytes_total{{{labels}}} 4194304.0',
        *(f'vllm:kvtier_hit_phase_seconds_total{{{labels},phase="{phase}"}} {seconds}'
          for phase, seconds in [("queue", 0.4), ("lookup", 0.02), ("read", 0.08), ("copy", 0.04), ("forward", 0.2)]),
        f'vllm:kvtier_hit_in_step_requests_total{{{labels}}} 1.0',  # one hit copied within its step
        *(f'vllm:kvtier_hit_in_step_phase_seconds_total{{{labels},phase="{phase}"}} {seconds}'
          for phase, seconds in [("queue", 0.1), ("lookup", 0.002), ("copy", 0.001), ("forward", 0.05)])])
    figures = serve.explain(page)
    assert figures["hit_requests"] == 4 and figures["lookup_rounds_per_hit"] == 0.5
    assert figures["load_bytes_per_hit"] == 2**20
    assert figures["phases_ms"]["queue"] == pytest.approx(100) and figures["phases_ms"]["plan"] == 0
    assert figures["beyond_ideal_ms"] == pytest.approx(5 + 20 + 10)  # lookup, read, copy: not queue nor forward
    assert figures["paths"]["in_step"] == {"hits": 1, "beyond_ideal_ms": pytest.approx(2 + 1)}
    assert figures["paths"]["beside_steps"] == {"hits": 3, "beyond_ideal_ms": pytest.approx((18 + 80 + 39) / 3)}
    assert serve.explain("") == {"hit_requests": 0}  # no hit: nothing to explain


def test_a_port_another_process_listens_on_is_refused_before_a_server_starts(tmp_path):
    """Else that process would answer the health check of a server that could not bind."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is in use"):
            serve.Server("none", "model", [], dict(os.environ), port, tmp_path / "none.log")
    assert not (tmp_path / "none.log").exists()  # nothing was started


def test_the_worker_threads_are_the_cpus_its_process_is_bound_to():
    """A child bound to one CPU, as vLLM binds its CPU worker: one thread, whatever its environment says."""
    code = "import os, time; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "7"})
    try:
        deadline = time.monotonic() + 10
        while serve.worker_threads(child.pid) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert serve.worker_threads(child.pid) == 1
    finally:
        child.kill()
        child.wait()
    assert serve.worker_threads(child.pid) is None  # gone: nothing read


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_bench_serve_runs_three_servers_with_the_same_cpus_and_kvtier_serves_hits(tmp_path):
    """Prefixes that return after others pushed them out of a 24-block device cache: kvtier loads
    them; every server's worker computes on the same number of threads, read from its process."""
    client = ("--dataset-name prefix_repetition --prefix-repetition-prefix-len 256 --prefix-repetition-suffix-len 32 "
              "--prefix-repetition-num-prefixes 6 --prefix-repetition-output-len 4 --num-prompts 12")
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "serve", "--workdir", str(tmp_path),
                           "--client-args", client, "--blocks", "24",
                           "--vllm-args", "--max-model-len 512 --block-size 32 --gpu-memory-utilization 0.3", "--ideal-blocks", "160", "--concurrency", "2",
                           "--port", str(8400 + os.getpid() % 500), "--json"],
                          capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert set(report["servers"]) == {"none", "kvtier", "ideal"}
    threads = {name: r["worker_threads"] for name, r in report["servers"].items()}
    assert report["fair"] and len(set(threads.values())) == 1 and None not in threads.values(), threads
    assert all(r["completed"] == 12 for r in report["servers"].values())
    assert sum(report["servers"]["kvtier"]["hit_tokens_by_tier"].values()) > 0, report["servers"]["kvtier"]
    assert report["kvtier_vs_none"]["mean_ttft_ms"] > 0 and (tmp_path / "result.json").exists()


def test_rounds_give_each_figure_its_median_and_each_server_its_own_spread():
    def round_(ttft, tpot, rps, threads=1, host=100.0):
        figures = {key: 1.0 for key in serve.FIGURES}
        figures.update(mean_ttft_ms=ttft, mean_tpot_ms=tpot, request_throughput=rps, completed=12,
                       worker_threads=threads, hit_tokens_by_tier={"host": host})
        return figures

    merged = serve._median([round_(30.0, 4.0, 10.0), round_(36.0, 4.4, 9.0, host=300.0), round_(33.0, 4.2, 12.0)])
    assert merged["mean_ttft_ms"] == 33.0 and merged["mean_tpot_ms"] == 4.2 and merged["request_throughput"] == 10.0
    assert merged["completed"] == 12 and merged["worker_threads"] == 1
    assert merged["hit_tokens_by_tier"] == {"host": pytest.approx(500 / 3)}  # per round
    assert merged["spread"] == pytest.approx({"mean_ttft_ms": 0.2, "mean_tpot_ms": 0.1, "request_throughput": 1 / 3})
    # A server whose rounds computed on different numbers of threads makes the comparison unfair.
    assert serve._median([round_(1, 1, 1, threads=1), round_(1, 1, 1, threads=2)])["worker_threads"] is None
    assert not serve.fair({"none 0": 1, "kvtier 0": 1, "none 1": 2})
    assert "spread" not in serve._median([round_(30.0, 4.0, 10.0)])  # one round: no spread to tell
