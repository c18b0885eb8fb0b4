"""Runs vLLM in this process on a JSON spec of phases and writes a JSON result.

``python -m kvtier.cli.demo.runner SPEC.json OUT.json``. The demo, the benchmarks and the
end-to-end tests each run their engines through this, one process per engine, so
that a "restart" is a real new process.

A spec: ``{"model", "connector": "kvtier"|"example"|null, "extra": {...},
"engine": {make_llm keyword arguments}, "phases": [{"name", "mode":
"sequential"|"concurrent", "prompts": [[token ids]], "max_tokens", "wait_for",
...}]}``. Sequential phases time each request's first token; concurrent phases
submit all requests at once and may abort some at random. A phase with
``wait_for`` starts once that file exists; a phase with ``"follow_up": {"phase": i,
"append": [token ids]}`` takes as its prompts phase i's, each followed by its completion
and ``append`` (a conversation's next turn); after phase i, ``OUT.json.phase<i>.done``
is created. ``"layout": "multiprocess"`` runs vLLM's engine core in a process of its own
(vLLM's default; kvtier's state cannot be read then); the default is vLLM's one-process
layout (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as vLLM runs one GPU). A phase with
``"prompt_logprobs": k`` asks for each prompt token's logprob, ``"samples": n`` for n
samples of each prompt (vLLM's parallel sampling, greedy each); a sequential phase's
``"lora": [name, id, path]`` runs its requests with that adapter (``make_llm``'s
``max_lora_rank`` set in ``engine``); a phase with
``"drain": false`` is not followed by extra engine steps; ``"kv_transfer_params"`` goes
with each of a phase's requests (as ``kvtier proxy`` hands a prefill answer's on); ``"idle_s"`` leaves the engine
idle (no step) that long after the phase's ``done`` file is written. Before the phases, a
warm-up prompt of ``"warmup_tokens"`` (160) runs twice, unless ``"warmup": false``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time



def _output_record(out) -> dict:
    completion = out.outputs[0]
    logprobs = completion.logprobs
    return {
        "tokens": list(completion.token_ids),
        # Each of a phase's ``samples``, where it asked for more than one.
        "samples": [list(sample.token_ids) for sample in out.outputs] if len(out.outputs) > 1 else None,
        "cached": out.num_cached_tokens,
        "first_logprob": next(iter(logprobs[0].values())).logprob if logprobs else None,
        # Each prompt token's logprob, where the phase asked for them: null for the first token (vLLM
        # gives none) and for any token whose entry lacks it.
        "prompt_logprobs": None if out.prompt_logprobs is None else
        [entry[token].logprob if entry and token in entry else None
         for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs)],
    }


def run_sequential(engine, prompts, params, on_request=None, lora_request=None) -> dict:
    outputs, ttfts = {}, []
    for i, prompt in enumerate(prompts):
        request_id = str(i)
        began = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora_request=lora_request)
        first_token = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first_token is None and out.outputs and out.outputs[0].token_ids:
                    first_token = time.perf_counter() - began
                if out.finished:
                    outputs[request_id] = _output_record(out)
        ttfts.append(first_token)
        if on_request:
            on_request()
    return {"outputs": outputs, "ttft_s": ttfts}


def run_concurrent(engine, prompts, params, abort_probability: float, seed: int) -> dict:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    rng = random.Random(seed)
    outputs, aborted = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                outputs[out.request_id] = _output_record(out)
        if abort_probability and rng.random() < abort_probability:
            running = [str(i) for i in range(len(prompts)) if str(i) not in outputs and str(i) not in aborted]
            if running:
                victim = rng.choice(running)
                engine.abort_request([victim])
                aborted.append(victim)
    return {"outputs": outputs, "aborted": aborted}


def kvtier_state(llm) -> dict:
    """Counters and resting-state figures of kvtier inside this engine."""
    from kvtier.cli.demo.engine import kvtier_sides

    scheduler, worker = kvtier_sides(llm)
    manager = scheduler.manager
    return {
        **{f"hit_tokens_{tier}": scheduler.hits.tokens[tier]
           for tier in ["host", *(t.name for t in manager.tiers)]},
        "miss_tokens": scheduler.miss_tokens,
        "misses": dict(manager.ledger.misses),
        "host_pins": manager.host.num_pins,
        "host_used": manager.host.num_used,
        "host_slots": manager.host.num_slots,
        "host_evictions": manager.host.num_evictions,
        "tier_pins": sum(getattr(t, "num_pins", 0) for t in manager.tiers),
        "tier_checks": sum(getattr(t, "num_checks", 0) for t in manager.tiers),  # existence asked of shared tiers
        "lookup_waits": sum(getattr(t, "num_waits", 0) for t in manager.tiers),  # idle steps that waited for those
        "lookups_overdue": sum(getattr(t, "num_overdue", 0) for t in manager.tiers),  # given up on at timeout_s
        "lookups_refused": sum(getattr(t, "num_refused", 0) for t in manager.tiers),  # too many checks pending
        "pending_jobs": manager.num_pending,
        "pending_waves": manager.waves.num_under_way,  # loads larger than the host pool, under way
        "finishing_requests": scheduler.num_finishing,  # finished, their blocks still to store
        "tracked_requests": len(scheduler.requests),
        "timed_requests": scheduler.times.num_followed,  # hits whose time to first token is being followed
        "hit_requests": scheduler.times.num_requests,
        "hit_phase_seconds": dict(scheduler.times.seconds),
        "hit_in_step_requests": scheduler.times.num_in_step,
        "preemptions": scheduler.requests.num_preempted,  # vLLM freed a running request's blocks
        "handoff_waiting": scheduler.handoffs.num_waiting,  # requests waiting for a producer's blocks
        "handoff_timeouts": scheduler.handoffs.num_timeouts,
        "handoff_stalls": scheduler.handoffs.num_stalls,  # its producer sent no new block for handoff_stall_s
        "handoff_cut_short": scheduler.handoffs.num_cut_short,  # handed over, but the blocks could not come
        # vLLM's own: a finished request whose blocks kvtier never released stays here.
        "engine_requests": len(llm.llm_engine.engine_core.engine_core.scheduler.requests),
        "stats": {name: dict(value) if isinstance(value, dict) else value for name, value in vars(manager.stats).items()},
        **({} if worker is None else {  # None: tensor parallel, the workers are other processes
            "worker_jobs_in_flight": worker.tier_worker.num_jobs_in_flight,
            "transfers_in_flight": worker.tier_worker.transfers.num_in_flight,
            "open_send_waits": worker.num_send_waits,
            "verify_failures": worker.tier_worker.num_verify_failures,
            "io_restarts": worker.tier_worker.io.num_exits if worker.tier_worker.io is not None else 0,
            "idle_waits": worker.tier_worker.num_idle_waits,
        }),
    }


def drain(llm, timeout: float = 60.0) -> None:
    """Step the engine until no connector work is in flight, as vLLM's busy loop does."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        return  # the engine core runs in a process of its own, which steps by itself
    deadline = time.monotonic() + timeout
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        core.step()


def main(spec_path: str, out_path: str) -> None:
    from kvtier.integrations.vllm.cpu_features import allow_amx_tiles

    allow_amx_tiles()  # every engine of this harness, the ones without kvtier included
    from vllm import SamplingParams

    from kvtier.cli.demo.engine import make_llm

    spec = json.load(open(spec_path))
    in_process = spec.get("layout", "in_process") == "in_process"
    # In process, the engine runs here and kvtier's state can be read.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    began = time.perf_counter()
    llm = make_llm(spec["model"], spec.get("connector"), spec.get("extra"), **spec.get("engine", {}))
    result = {"startup_s": time.perf_counter() - began, "phases": []}
    engine = llm.llm_engine
    if spec.get("warmup", True):
        # First uses are slow: the first forward, the first over a cached prefix (another
        # attention path), the first over a context of a new length and the first sampling
        # with logprobs. The same prompt
        # twice, as long as ``warmup_tokens`` and sampled as the phases sample, keeps them out of
        # every measurement.
        warmup = random.Random(12345)
        prompt = [warmup.randrange(3, 1000) for _ in range(spec.get("warmup_tokens", 160))]
        run_sequential(engine, [prompt, prompt], _sampling(SamplingParams, 2))
        drain(llm)
    for index, phase in enumerate(spec["phases"]):
        if phase.get("wait_for"):  # another process (a test) prepares something between phases
            _wait_for_file(phase["wait_for"])
        params = _sampling(SamplingParams, phase.get("max_tokens", 6), phase.get("prompt_logprobs"),
                           phase.get("samples", 1))
        if phase.get("kv_transfer_params"):  # what a prefill instance's answer carries, as the proxy hands it on
            params.extra_args = {"kv_transfer_params": phase["kv_transfer_params"]}
        if phase.get("follow_up"):
            earlier = phase["follow_up"]["phase"]
            completions = result["phases"][earlier]["outputs"]
            phase["prompts"] = [prompt + completions[str(i)]["tokens"] + phase["follow_up"]["append"]
                                for i, prompt in enumerate(spec["phases"][earlier]["prompts"])]
        if phase.get("reset_prefix_cache"):
            llm.reset_prefix_cache()  # so that hits come from the connector, not vLLM's own cache
        inspect = spec.get("connector") == "kvtier" and in_process
        before = kvtier_state(llm) if inspect else None
        began = time.perf_counter()
        if phase.get("mode", "sequential") == "sequential":
            record = run_sequential(engine, phase["prompts"], params, on_request=_progress_printer(phase),
                                    lora_request=_lora_request(phase.get("lora")))
        else:
            record = run_concurrent(engine, phase["prompts"], params, phase.get("abort_probability", 0.0),
                                    phase.get("seed", 0))
        record["seconds"] = time.perf_counter() - began
        if in_process and phase.get("drain", True):
            drain(llm)
        record["name"] = phase.get("name", "")
        if before is not None:
            after = kvtier_state(llm)
            record["kvtier_delta"] = {
                key: after[key] - before[key] for key in after if key.startswith("hit_tokens_") or key == "miss_tokens"}
            record["kvtier_delta"].update({f"{key}": after["stats"][key] - before["stats"][key]
                                           for key in ("load_bytes", "store_bytes", "loaded_blocks", "stored_blocks")})
            record["kvtier_delta"]["hit_phase_seconds"] = {
                phase: seconds - before["hit_phase_seconds"][phase] for phase, seconds in after["hit_phase_seconds"].items()}
            record["kvtier_delta"]["misses"] = {reason: n - before["misses"].get(reason, 0)
                                                for reason, n in after["misses"].items()
                                                if n != before["misses"].get(reason, 0)}
        result["phases"].append(record)
        open(f"{out_path}.phase{index}.done", "w").close()
        time.sleep(phase.get("idle_s", 0))
    if spec.get("connector") == "kvtier" and in_process:
        result["kvtier"] = kvtier_state(llm)
    json.dump(result, open(out_path, "w"))


def _sampling(sampling_params, max_tokens: int, prompt_logprobs: int | None = None, samples: int = 1):
    """Greedy, every token kept, with the first token's logprob (tests compare them). With
    ``prompt_logprobs`` vLLM reads no cached KV for the request (at construction it sets
    ``skip_reading_prefix_cache``). ``samples`` > 1: vLLM's parallel sampling (``n``), each sample
    greedy all the same (vLLM takes no ``n`` at temperature 0: top-k 1 keeps the likeliest token),
    answered once every sample has ended (so a phase's time to first token is its time to the last)."""
    if samples > 1:
        from vllm.sampling_params import RequestOutputKind
        return sampling_params(n=samples, max_tokens=max_tokens, temperature=1.0, top_k=1, ignore_eos=True,
                               logprobs=1, prompt_logprobs=prompt_logprobs, output_kind=RequestOutputKind.FINAL_ONLY)
    return sampling_params(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1,
                           prompt_logprobs=prompt_logprobs)


def _lora_request(lora):
    """A sequential phase's ``"lora": [name, id, path]``: its requests run with that adapter."""
    if not lora:
        return None
    from vllm.lora.request import LoRARequest
    return LoRARequest(*lora)


def _wait_for_file(path: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


def _progress_printer(phase):
    # One line per request on stdout, read by the demo's progress bar.
    def tick():
        print(f"kvtier-progress {phase.get('name', '')}", flush=True)
    return tick


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
