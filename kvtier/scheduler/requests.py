"""The requests the scheduler side follows: each one's block keys and the device blocks the engine
gave it. Engine-neutral: a request is read for ``request_id``, ``all_token_ids``, ``num_tokens``,
``num_prompt_tokens`` and ``num_computed_tokens`` (vLLM's ``Request`` has them); what else keys
its blocks (an adapter, a cache salt) is the engine adapter's ``extra_keys(request)``.

Keys are extended as a request's tokens grow (each block's key chains its parent's),
so a long conversation is hashed once. The engine's adapter keeps each one's device
block ids (``RequestState.block_ids``) as the engine's steps give and take them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvtier.common.keys import block_keys


@dataclass
class RequestState:
    request: object  # the engine's request (vLLM's ``Request``); read for its tokens
    extra_keys: tuple
    keys: list[bytes] = field(default_factory=list)  # full blocks keyed so far
    block_ids: list[int] = field(default_factory=list)
    num_stored_blocks: int = 0  # blocks [0, n) are stored, loaded, or were planned for storing
    partial_planned: bool = False
    store_job_ids: set[int] = field(default_factory=set)  # stores that read this request's current blocks


class Requests:
    def __init__(self, fingerprint: bytes, block_size: int, extra_keys: Callable[[object], tuple] = lambda r: ()):
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.extra_keys = extra_keys  # what else keys a request's blocks (the engine adapter's)
        self.on_keyed: Callable | None = None  # (request, new keys, first block, block size): KV events
        self._states: dict[str, RequestState] = {}
        self.num_preempted = 0  # preemptions of followed requests (each one's blocks freed by the engine)

    def state(self, request) -> RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = RequestState(request, tuple(self.extra_keys(request)))
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
