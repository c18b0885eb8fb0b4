"""Prefill/decode: the decode instance waits for the blocks the prefill instance is still storing.

A producer (``kv_role`` ``kv_producer``) answers a prompt's first token once the step's
stores are durable in the pool, but blocks that its host pool had no free slot for are
stored at its next steps (``store_plans``), after that answer. For such a request its
answer carries ``kv_transfer_params: {"kvtier_tokens": N}``, the prompt tokens it stores;
``kvtier proxy`` hands it on with the request to the decode instance. There, while the
tiers hold fewer of that request's tokens, its lookup answers "ask again" (vLLM keeps it
waiting) and asks the tiers anew every ``ASK_EVERY_S``. It waits while the blocks keep
arriving: once no new one has been found for ``handoff_stall_s`` (the producer died, or is
stuck), or at ``load_timeout_s`` in any case, it loads what is there and vLLM computes the
rest (the tokens that no tier holds are counted under the miss reason ``producer_late``).
Nothing else tells a decode instance that its producer is gone: the pool is all the two
share. Where the blocks cannot come (the storage pool is down, or the request's load from
it failed), it does not wait at all.
"""

from __future__ import annotations

import time

PARAM = "kvtier_tokens"
ASK_EVERY_S = 0.05  # how often a waiting request's blocks are asked of the tiers again
# An engine step that computes nothing while requests wait here is followed at once by the next; each
# such step waits this long in the worker instead (the producer may share the machine's cores).
IDLE_WAIT_S = 0.01


def handed_tokens(request, block_size: int | None = None) -> int:
    """The prompt tokens a producer said it stores for this request (0: none said); with
    ``block_size``, those of its full blocks only (for an instance that loads no partial block)."""
    params = getattr(request, "kv_transfer_params", None)
    value = params.get(PARAM) if isinstance(params, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return 0
    tokens = min(value, request.num_tokens)
    return tokens - tokens % block_size if block_size else tokens


class _Wait:
    __slots__ = ("since", "asked", "found", "found_at")

    def __init__(self, now: float, found: int):
        self.since = self.asked = self.found_at = now  # first short lookup, last ask, last new block
        self.found = found  # the most tokens a lookup found so far


class HandOffs:
    def __init__(self, timeout_s: float, stall_s: float | None = None):
        self.timeout_s = timeout_s
        self.stall_s = timeout_s if stall_s is None else stall_s
        self._waiting: dict[str, _Wait] = {}
        self._given_up: set[str] = set()  # they wait no more
        self._waited = False
        self.num_timeouts = 0  # requests that waited ``timeout_s`` and then computed what was missing
        self.num_stalls = 0  # requests whose producer sent no new block for ``stall_s``
        self.num_cut_short = 0  # requests that stopped waiting because their blocks could not come

    def wait(self, req_id: str, found: int) -> tuple[bool, bool]:
        """A lookup found ``found`` tokens, fewer than were handed over: (wait for them, ask the tiers
        anew). After ``stall_s`` without more found, or ``timeout_s`` in all, the request waits no
        more, however often it is looked up again."""
        if req_id in self._given_up:
            return False, False
        now = time.monotonic()
        wait = self._waiting.get(req_id)
        # Progress first, then the bounds: an answer that took long to come and finds more is progress.
        if wait is None:
            wait = self._waiting[req_id] = _Wait(now, found)
        elif found > wait.found:  # the producer is still storing: its stall clock starts again
            wait.found, wait.found_at = found, now
        timed_out = now - wait.since >= self.timeout_s
        if timed_out or now - wait.found_at >= self.stall_s:
            del self._waiting[req_id]
            self._given_up.add(req_id)
            if timed_out:
                self.num_timeouts += 1
            else:
                self.num_stalls += 1
            return False, False
        self._waited = True
        if now - wait.asked < ASK_EVERY_S:
            return True, False
        wait.asked = now
        return True, True

    def check(self, req_id: str, found: int, handed: int, can_arrive) -> tuple[bool, bool]:
        """A lookup found ``found`` of the ``handed`` tokens a producer said it stores: (wait for the
        rest, ask the tiers anew). No wait where they cannot come (``can_arrive(req_id)`` false: the
        storage pool is down, or this request's load from it failed)."""
        if found >= handed:
            self.arrived(req_id)
            return False, False
        return self.wait(req_id, found) if can_arrive(req_id) else self.cut_short(req_id)

    def cut_short(self, req_id: str) -> tuple[bool, bool]:
        """The handed blocks cannot come now (the storage pool is down, or the request's load from it
        failed): the request waits no more."""
        if req_id not in self._given_up:
            self._waiting.pop(req_id, None)
            self._given_up.add(req_id)
            self.num_cut_short += 1
        return False, False

    def arrived(self, req_id: str) -> None:
        """A lookup found every token handed over: the request waits no more."""
        self._waiting.pop(req_id, None)

    @property
    def num_waiting(self) -> int:
        """Requests waiting now for a producer's blocks."""
        return len(self._waiting)

    def waited_this_step(self) -> bool:
        """Whether a request was told to wait since the last call."""
        waited, self._waited = self._waited, False
        return waited

    def forget(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
        self._given_up.discard(req_id)
