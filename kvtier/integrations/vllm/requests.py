"""The requests the scheduler side follows: each one's block keys and the device blocks vLLM gave it.

Keys are extended as a request's tokens grow (each block's key chains its parent's),
so a long conversation is hashed once. Device block ids follow vLLM's scheduler
output: new requests, blocks added to running ones, resumed requests (all blocks
anew) and preempted ones (none, and their stores to wait for before the blocks are
reused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvtier.common.keys import block_keys
from kvtier.integrations.vllm.namespace import adapter_fingerprint


@dataclass
class RequestState:
    request: object  # vllm.v1.request.Request; read for its tokens
    extra_keys: tuple
    keys: list[bytes] = field(default_factory=list)  # full blocks keyed so far
    block_ids: list[int] = field(default_factory=list)
    num_stored_blocks: int = 0  # blocks [0, n) are stored, loaded, or were planned for storing
    partial_planned: bool = False
    store_job_ids: set[int] = field(default_factory=set)  # stores that read this request's current blocks


class Requests:
    def __init__(self, fingerprint: bytes, block_size: int):
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.on_keyed: Callable | None = None  # (request, new keys, first block, block size): KV events
        self._states: dict[str, RequestState] = {}
        self.num_preempted = 0  # preemptions of followed requests (each one's blocks freed by vLLM)

    def state(self, request) -> RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            extra = []
            if getattr(request, "lora_request", None) is not None:
                # The adapter's content, not only its name: one reloaded under the same name
                # with other weights must not be served the old adapter's KV.
                extra.append(f"lora:{request.lora_request.lora_name}:{adapter_fingerprint(request.lora_request)}")
            if getattr(request, "cache_salt", None):
                extra.append("salt:" + str(request.cache_salt))
            state = RequestState(request, tuple(extra))
            self._states[request.request_id] = state
        return state

    def get(self, req_id: str) -> RequestState | None:
        return self._states.get(req_id)

    def pop(self, req_id: str) -> RequestState | None:
        return self._states.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._states)

    def full_keys(self, state: RequestState, num_tokens: int) -> list[bytes]:
        """Keys of the full blocks among the first ``num_tokens`` tokens, extended incrementally."""
        num_full = num_tokens // self.block_size
        if len(state.keys) < num_full:
            tokens = state.request.all_token_ids[:num_full * self.block_size]
            first = len(state.keys)
            state.keys += block_keys(self.fingerprint, tokens, self.block_size, state.extra_keys,
                                     start_block=first, parent=state.keys[-1] if state.keys else None)
            if self.on_keyed is not None:
                self.on_keyed(state.request, state.keys[first:], first, self.block_size)
        return state.keys[:num_full]

    def partial_key(self, state: RequestState, num_tokens: int) -> bytes | None:
        """Key of the partial block that ends at ``num_tokens``, or None where it ends a block."""
        if num_tokens % self.block_size == 0:
            return None
        full = self.full_keys(state, num_tokens)
        tokens = state.request.all_token_ids[len(full) * self.block_size:num_tokens]
        return block_keys(self.fingerprint, tokens, self.block_size, state.extra_keys, include_partial=True,
                          parent=full[-1] if full else None)[-1]

    def follow_blocks(self, scheduler_output) -> list[int]:
        """Take this step's device block ids; returns the stores that preempted requests' blocks
        still feed (vLLM frees those blocks now: workers wait for the stores before reusing them)."""
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._states:
                self._states[new.req_id].block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())  # vLLM 0.34 sends resumed requests as new ones
        for i, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            new_block_ids = cached.new_block_ids[i]
            if state is None or new_block_ids is None:
                continue
            if req_id in resumed:
                state.block_ids = list(new_block_ids[0])  # a resumed request gets all its blocks anew
            else:
                state.block_ids += new_block_ids[0]
        waits = []
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self._states.get(req_id)
            if state is not None:
                self.num_preempted += 1
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
