"""vLLM's side of the requests the scheduler side follows (``kvtier.scheduler.requests``): what
else keys a request's blocks, the device blocks each step gives and takes, and which requests
kvtier leaves alone.
"""

from __future__ import annotations

from kvtier.integrations.vllm.namespace import adapter_fingerprint
from kvtier.scheduler.requests import Requests


def extra_keys(request) -> tuple:
    """What keys a request's blocks besides its tokens: its LoRA adapter and its cache salt."""
    extra = []
    if getattr(request, "lora_request", None) is not None:
        # The adapter's content, not only its name: one reloaded under the same name
        # with other weights must not be served the old adapter's KV.
        extra.append(f"lora:{request.lora_request.lora_name}:{adapter_fingerprint(request.lora_request)}")
    if getattr(request, "cache_salt", None):
        extra.append("salt:" + str(request.cache_salt))
    return tuple(extra)


def follow_blocks(requests: Requests, scheduler_output) -> list[int]:
    """Take this step's device block ids from vLLM's scheduler output: new requests, blocks added
    to running ones, resumed requests (all blocks anew) and preempted ones (none, and their stores
    to wait for before the blocks are reused). Returns the stores that preempted requests' blocks
    still feed (vLLM frees those blocks now: workers wait for the stores before reusing them)."""
    for new in scheduler_output.scheduled_new_reqs:
        state = requests.get(new.req_id)
        if state is not None:
            state.block_ids = list(new.block_ids[0])
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", ())  # vLLM 0.34 sends resumed requests as new ones
    for i, req_id in enumerate(cached.req_ids):
        state = requests.get(req_id)
        new_block_ids = cached.new_block_ids[i]
        if state is None or new_block_ids is None:
            continue
        if req_id in resumed:
            state.block_ids = list(new_block_ids[0])  # a resumed request gets all its blocks anew
        else:
            state.block_ids += new_block_ids[0]
    waits = []
    for req_id in scheduler_output.preempted_req_ids or ():
        state = requests.get(req_id)
        if state is not None:
            requests.num_preempted += 1
            waits += state.store_job_ids
            state.store_job_ids = set()
            state.block_ids = []
    return waits


def unsupported(request) -> bool:
    """A request whose KV depends on more than its token ids (images, prompt embeddings): kvtier
    neither stores nor loads it."""
    return bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None


def loads_nothing(request, geometry) -> str | None:
    """Why this request loads nothing, whatever the tiers hold (its misses' reason), or None."""
    if not geometry.extends_loaded_kv:  # it would compute the prompt's rest wrongly over loaded KV
        return "engine_cannot_load"
    # Prompt logprobs (or the request's own wish): vLLM computes every prompt token, and before
    # 0.31 it did not override a connector's hit for it, so that the loaded tokens' logprobs were wrong.
    if getattr(request, "skip_reading_prefix_cache", False):
        return "request_skips_cache"
    return None
