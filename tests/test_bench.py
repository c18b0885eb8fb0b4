"""The benchmarks run, check their bytes, and report the keys
they promise. Speed is reported by them, never asserted here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli.bench import layerwise


def test_bench_transfer_reports_every_promised_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "transfer", "--gib", "0.02", "--repeats", "1",
                          "--disk-dir", str(tmp_path), "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    for key in ("offload_gbps", "load_gbps", "memcpy_gbps", "disk_write_gbps", "disk_read_gbps",
                "file_write_gbps", "file_read_gbps", "hash_tokens_per_s"):
        assert result[key] > 0, key


def test_the_disk_hit_bench_loads_exact_bytes_from_disk_then_host_and_reports_its_peers(tmp_path):
    """``bench transfer --device cuda``'s disk hit, run on the CPU: the same steps (store, push
    out of the host pool, a disk hit, a host hit), each load checked byte for byte."""
    from kvtier.cli.bench import transfer_cuda

    result = transfer_cuda.disk_hit(str(tmp_path), num_moved=8, num_layers=3, repeats=2, device="cpu")
    assert result["disk_hit_exact"] and result["disk_hit_blocks"] == 8
    for key in ("disk_hit_ms", "host_hit_ms", "plain_h2d_ms", "page_cache_read_ms", "host_hit_vs_plain_copy",
                "disk_hit_vs_read_plus_copy"):
        assert result[key] > 0, key


def test_the_gpu_check_says_no_gpu_and_exits_3_where_there_is_none(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: scripts/gpu_check.sh runs its checks instead")
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    out = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "no CUDA GPU here" in out.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == {"gpu": False}


def test_bench_layerwise_moves_exact_bytes_and_reports_the_overlap():
    result = layerwise.run(num_layers=3, num_blocks=16, repeats=1)
    assert result["exact"]
    assert 0.0 <= result["overlap_fraction"] <= 1.0 and 0.0 <= result["load_overlap_fraction"] <= 1.0


@pytest.mark.vllm
def test_bench_tiers_reports_every_promised_key(tmp_path):
    """Two engine processes (the disk tier, quick size): the keys, and every block served."""
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "tiers", "--quick", "--tiers", "disk",
                          "--workdir", str(tmp_path), "--json"], capture_output=True, text=True, check=True)
    tier = json.loads(out.stdout)["tiers"]["disk"]
    for key in ("hit_ttft_s", "own_prefix_cache_ttft_s", "raw_read_gbps", "floor_s", "hit_vs_floor",
                "raw_read_after_pause_gbps", "hit_vs_floor_after_pause"):
        assert tier[key] > 0, key
    assert tier["blocks_served_fraction"] == 1.0 and tier["tier_hit_tokens"] > 0


@pytest.mark.vllm
def test_bench_node_reports_every_promised_key_and_each_hit_from_where_it_says(tmp_path):
    """Five engine processes and a node server (quick size): every ratio, and every hit served whole
    from the tier it names (host pool, disk, node)."""
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "node", "--quick", "--workdir", str(tmp_path),
                          "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    for key in ("a_node_hit_vs_embedded_host_hit", "b_hit_on_a_vs_own_host_hit", "c_after_restart_vs_warm_host_hit",
                "c_after_restart_vs_embedded_disk_hit_after_restart"):
        assert result["ratios"][key] > 0, key
    served = result["served_tokens"]
    expected = served.pop("expected_per_kind")
    assert served == dict.fromkeys(served, expected)
    # (b)'s breakdown: the node's hit reads from the server; B's own host hit, copied in the step of
    # its forward, reads nothing and waits for no report and no resumption.
    from kvtier.scheduler.hit_times import PHASES
    node_hit, own = result["phase_s"]["node_b_hit_on_a"], result["phase_s"]["node_b_own_host_hit"]
    assert list(node_hit) == list(own) == list(PHASES)
    assert node_hit["read"] > 0 and node_hit["forward"] > 0 and own["forward"] > 0
    assert own["read"] == own["report"] == own["resume"] == 0
