"""Runs vLLM (in-process engine) on a JSON spec and prints a JSON result.

Used by the end-to-end tests as a subprocess, so that every scenario is a real,
separate process: ``python -m tests.e2e.vllm_app SPEC.json OUT.json``.
"""

import json
import os
import random
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs here, so kvtier's state can be inspected


def generate(llm, prompts, max_tokens, abort_probability, seed):
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    rng = random.Random(seed)
    outputs, aborted = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                completion = out.outputs[0]
                outputs[out.request_id] = {
                    "tokens": list(completion.token_ids),
                    "cached": out.num_cached_tokens,
                    "first_logprob": next(iter(completion.logprobs[0].values())).logprob if completion.logprobs else None,
                }
        if abort_probability and rng.random() < abort_probability:
            running = [str(i) for i in range(len(prompts)) if str(i) not in outputs and str(i) not in aborted]
            if running:
                victim = rng.choice(running)
                engine.abort_request([victim])
                aborted.append(victim)
    return {"outputs": outputs, "aborted": aborted}


def main():
    spec = json.load(open(sys.argv[1]))
    from kvtier.demo.engine import kvtier_sides, make_llm

    llm = make_llm(spec["model"], spec.get("connector"), spec.get("extra"), dtype="float32",
                   kv_cache_gib=spec.get("kv_cache_gib", 1), max_model_len=4096, max_num_seqs=spec.get("max_num_seqs", 16),
                   prefix_caching=spec.get("prefix_caching", False))
    result = {"phases": []}
    for phase in spec["phases"]:
        result["phases"].append(generate(llm, phase["prompts"], phase.get("max_tokens", 6),
                                         phase.get("abort_probability", 0.0), phase.get("seed", 0)))
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + 60
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        core.step()  # what vLLM's busy loop does while a connector still has work in flight
    if spec.get("connector") == "kvtier":
        scheduler, worker = kvtier_sides(llm)
        manager = scheduler.manager
        result["kvtier"] = {
            "host_pins": manager.host.num_pins,
            "host_used": manager.host.num_used,
            "host_slots": manager.host.num_slots,
            "host_evictions": manager.host.num_evictions,
            "disk_pins": len(manager.disk._pins) if manager.disk else 0,
            "pending_jobs": manager.num_pending,
            "worker_jobs_in_flight": worker.tier_worker.num_jobs_in_flight,
            "transfers_in_flight": worker.tier_worker.transfers.num_in_flight,
            "open_send_waits": len(worker._send_waits),
            "tracked_requests": len(scheduler._requests),
            "verify_failures": worker.tier_worker.num_verify_failures,
            "stats": vars(manager.stats),
        }
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
