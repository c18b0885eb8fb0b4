"""Which of a request's blocks are stored, and when: the scheduler side's store planning.

A block is stored in the step that completes it (the prompt's partial block once the
prompt is computed). Where the host pool has no free slot for it, it is tried again at
the request's next steps, as the pool's writes end, and after the request has finished:
vLLM then keeps the request's blocks (``request_finished`` answers that it still
sends) until every block is planned, or until no slot has freed for ``timeout_s``
(the rest counted in ``skipped_store_blocks``), and frees them once those stores have
read them.

A model of sliding-window layers alone has vLLM free a request's blocks as they leave
the window: a block before the window of the tokens computed so far is never read (vLLM
may have given it to another request), so the stores of such blocks not yet planned are
skipped. The blocks each step stores are copied before the next step may free them
(``worker_side.wait_for_save``).
"""

from __future__ import annotations

import time
from typing import Callable

from kvtier.scheduler.requests import Requests, RequestState
from kvtier.scheduler.manager import TierManager


class StorePlans:
    def __init__(self, manager: TierManager, requests: Requests, partial_blocks: bool, timeout_s: float,
                 skipped_blocks: Callable[[int], int] | None = None):
        self.manager = manager
        self.frees_blocks = skipped_blocks is not None
        # Leading blocks vLLM may have freed, at so many tokens computed.
        self.skipped_blocks = skipped_blocks or (lambda num_computed: 0)
        self.requests = requests
        self.block_size = requests.block_size
        self.partial_blocks = partial_blocks  # the prompt's last, partial block is stored too
        self.timeout_s = timeout_s
        self._owner: dict[int, str] = {}  # store job -> its request
        self._finishing: dict[str, tuple] = {}  # finished request -> (state, full blocks, tokens computed, progress)

    def plan(self, state: RequestState, num_computed: int) -> list:
        """Stores of the blocks complete once ``num_computed`` tokens are (and the prompt's partial block)."""
        request = state.request
        # Speculative decoding schedules draft tokens past the request's own: their KV may be
        # rejected, and a block is whole only once its tokens are the request's.
        num_full = min(min(num_computed, request.num_tokens) // self.block_size, len(state.block_ids))
        # Blocks vLLM may have freed by now (a sliding window left them; ``request.num_computed_tokens``
        # counts the tokens before this step, at least those it freed on): skipped, never read.
        gone = min(self.skipped_blocks(request.num_computed_tokens), num_full)
        if gone > state.num_stored_blocks:
            self.manager.stats.skipped_store_blocks += gone - state.num_stored_blocks
            state.num_stored_blocks = gone
        jobs = []
        if num_full > state.num_stored_blocks:
            keys = self.requests.full_keys(state, num_full * self.block_size)[state.num_stored_blocks:num_full]
            jobs.append(self.manager.plan_store(request.request_id, keys,
                                                state.block_ids[state.num_stored_blocks:num_full], count_skipped=False))
            # Blocks past the host pool's free slots are tried again next step, while the request still
            # holds them (its slots free as its writes end): a prompt larger than the host pool is stored whole.
            state.num_stored_blocks += self.manager.num_held_prefix(keys)
        if self._partial_unstored(state, num_computed):
            num_prompt = request.num_prompt_tokens
            key = self.requests.partial_key(state, num_prompt)
            jobs.append(self.manager.plan_store(request.request_id, [key], [state.block_ids[num_prompt // self.block_size]],
                                                count_skipped=False))
            state.partial_planned = self.manager.num_held_prefix([key]) == 1  # else tried again, as full blocks are
        jobs = [job for job in jobs if job is not None]
        for job in jobs:
            state.store_job_ids.add(job.job_id)
            self._owner[job.job_id] = request.request_id
        return jobs

    def plan_step(self, scheduled: list[tuple[RequestState, int]]) -> list:
        """The stores of a step's requests, given as (state, tokens computed once the step ends)."""
        if self.frees_blocks:
            # A sliding window frees a request's oldest blocks as its tokens move on: the request whose
            # first unstored block is furthest behind its tokens (the nearest to being freed) gets the
            # free host slots first. Without one, vLLM's own order.
            scheduled = sorted(scheduled, key=lambda item: item[0].num_stored_blocks * self.block_size - item[1])
        return [job for state, num_computed in scheduled for job in self.plan(state, num_computed)]

    def _partial_unstored(self, state: RequestState, num_computed: int) -> bool:
        """Whether the prompt's partial block is computed and not yet stored (nor planned), and still held."""
        num_prompt = state.request.num_prompt_tokens
        return (self.partial_blocks and not state.partial_planned and num_computed >= num_prompt
                and num_prompt % self.block_size != 0 and num_prompt // self.block_size < len(state.block_ids)
                and num_prompt // self.block_size >= self.skipped_blocks(state.request.num_computed_tokens))

    def _num_unstored(self, state: RequestState, num_full: int, num_computed: int) -> int:
        return max(0, num_full - state.num_stored_blocks) + self._partial_unstored(state, num_computed)

    def keep_finishing(self, request, state: RequestState) -> bool:
        """A finished request: True if some of its computed blocks are still to store (vLLM keeps them)."""
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_computed // self.block_size, len(state.block_ids))
        if not self._num_unstored(state, num_full, num_computed):
            return False
        self._finishing[request.request_id] = (state, num_full, num_computed, time.monotonic())
        return True

    def finish(self, send_waits: dict[str, list[int]]) -> list:
        """Stores of finished requests' blocks, as host slots free; a request done with (every block
        planned, or no slot freed for ``timeout_s``) gets its wait in ``send_waits``."""
        jobs, now = [], time.monotonic()
        for req_id, (state, num_full, num_computed, since) in list(self._finishing.items()):
            before = self._num_unstored(state, num_full, num_computed)
            jobs += self.plan(state, num_computed)
            left = self._num_unstored(state, num_full, num_computed)
            if left < before:
                since = now
                self._finishing[req_id] = (state, num_full, num_computed, now)
            if left and now - since < self.timeout_s:
                continue
            del self._finishing[req_id]
            self.manager.stats.skipped_store_blocks += left
            send_waits[req_id] = self.pending(state)
        return jobs

    def pending(self, state: RequestState) -> list[int]:
        """The request's stores that have not yet been reported (they may still read its blocks)."""
        return [job_id for job_id in state.store_job_ids if self.manager.is_pending(job_id)]

    def on_completed(self, job_ids) -> None:
        for job_id in job_ids:
            req_id = self._owner.pop(job_id, None)
            state = self.requests.get(req_id) if req_id is not None else None
            if state is not None:
                state.store_job_ids.discard(job_id)

    @property
    def num_finishing(self) -> int:
        return len(self._finishing)

    @property
    def num_unstored(self) -> int:
        """Finished requests' blocks still to store."""
        return sum(self._num_unstored(state, num_full, num_computed)
                   for state, num_full, num_computed, _ in self._finishing.values())
