"""Why a request's prompt tokens were not loaded, counted once it is allocated (``kvtier.scheduler.ledger``)."""

from __future__ import annotations

from kvtier.integrations.vllm.requests import loads_nothing
from kvtier.scheduler.requests import RequestState, Requests


def count_misses(manager, requests: Requests, geometry, request, state: RequestState, hit_tokens: int,
                 handed_tokens: int) -> int:
    """Count ``request``'s tokens from ``hit_tokens`` on under their reason; returns how many.
    ``manager``: the ``TierManager``; ``handed_tokens``: those a producer said it stores."""
    missed = request.num_tokens - hit_tokens
    # A lookup after a failed load: the failed blocks that no other tier delivers now count under the
    # failure's reason, and only once.
    counted = manager.ledger.settle(request.request_id, missed)
    if no_kv := loads_nothing(request, geometry):
        manager.ledger.count(no_kv, missed - counted)
    elif missed > counted:  # counted under the reason of the first block not found: the rest follow it
        full = requests.full_keys(state, request.num_tokens)
        first_missed = hit_tokens // geometry.block_size
        reason = (manager.miss_reason(full[first_missed], request.request_id)
                  if first_missed < len(full) else "partial_block")  # only the last, partial block
        if reason in ("never_stored", "partial_block") and hit_tokens < handed_tokens:
            reason = "producer_late"  # a producer said it stores them; it had not, when the wait ended
        manager.ledger.count(reason, missed - counted, request.all_token_ids, hit_tokens, state.extra_keys)
    return missed
