"""The scheduler side's store planning, on a real ``TierManager`` whose host pool is too small for
every store of a step: which request gets the free slots."""

from types import SimpleNamespace

import pytest

from kvtier.scheduler.requests import Requests
from kvtier.scheduler.store_plans import StorePlans
from tests.test_manager import FINGERPRINT, manager

BLOCK = 32
WINDOW = 150


def skipped_blocks(num_computed: int) -> int:
    """vLLM's freed blocks under a sliding window of ``WINDOW`` tokens (``EngineGeometry.skipped_blocks``)."""
    return max(0, num_computed - WINDOW + 1) // BLOCK


def running(requests: Requests, req_id: str, num_computed: int, num_stored: int, seed: int):
    tokens = [seed * 1000 + i for i in range(num_computed + BLOCK)]
    request = SimpleNamespace(request_id=req_id, num_computed_tokens=num_computed, num_tokens=len(tokens),
                              num_prompt_tokens=len(tokens), all_token_ids=tokens)
    state = requests.state(request)
    state.block_ids = list(range(seed * 100, seed * 100 + len(tokens) // BLOCK))
    state.num_stored_blocks = num_stored
    return state


@pytest.mark.parametrize("window", [True, False])
def test_under_a_sliding_window_the_request_nearest_to_losing_a_block_gets_the_free_slots(tmp_path, window):
    """Two running requests, 2 free host slots, 7 blocks to store between them. Under a sliding window
    vLLM frees each request's oldest blocks as its tokens move on: the request whose first unstored block
    is furthest behind its tokens (``behind``, next to leave the window) gets both slots, whichever
    order vLLM scheduled them in. Without a window, vLLM's order stands."""
    mgr = manager(str(tmp_path), host_slots=2, disk_entries=100)
    requests = Requests(FINGERPRINT, BLOCK)
    plans = StorePlans(mgr, requests, partial_blocks=False, timeout_s=10,
                       skipped_blocks=skipped_blocks if window else None)
    ahead = running(requests, "ahead", num_computed=190, num_stored=4, seed=1)  # blocks 4, 5 to store
    behind = running(requests, "behind", num_computed=190, num_stored=1, seed=2)  # blocks 1 to 5: 1 leaves first
    assert skipped_blocks(190 + 32) == 2  # the next block makes vLLM free block 1 of "behind"
    jobs = plans.plan_step([(ahead, 192), (behind, 192)])
    planned = {state.request.request_id: state.num_stored_blocks for state in (ahead, behind)}
    assert planned == ({"ahead": 4, "behind": 3} if window else {"ahead": 6, "behind": 1})
    assert sum(len(job.keys) for job in jobs) == 2
    assert mgr.stats.skipped_store_blocks == 0
