"""vLLM 0.34's ``may_load_async``: with ``--max-num-inflight-kv-loads``, a request the connector
may load asynchronously starts its load while the running batch is full, so that its KV is
there when a running slot frees. kvtier's loads from the host pool, disk and storage pools are
asynchronous (all but layer-wise ones).

vLLM asks whenever a request enters a waiting queue, so the answer is a guess that costs a few
dict lookups: yes where a producer's hand-off is awaited, or where the request's first block is
in the host pool or in a tier that answers from its own list (its key is hashed once; the lookup
reuses it). A block that only a storage pool holds is not asked for here: that request waits for
a running slot, as without the option. A wrong yes holds back other such loads until a slot
frees (the head of vLLM's queue waits): a hit that vLLM's own prefix cache covers whole.
"""

from __future__ import annotations

from kvtier.integrations.vllm.requests import loads_nothing, unsupported
from kvtier.scheduler.handoffs import handed_tokens


def may_load_async(side, request) -> bool:
    """``side``: the connector's ``SchedulerSide``."""
    if side.manager is None or unsupported(request) or loads_nothing(request, side.geometry):
        return False
    if handed_tokens(request, side.handed_block_size) > 0:
        return True
    first = side.requests.full_keys(side.requests.state(request), min(request.num_tokens, side.block_size))
    if not first:
        return False
    config = side.config
    if config.layerwise and not config.save_only_first_rank and side.manager.host.contains(first[0]):
        return False  # a host hit loads layer by layer during the forward: a running slot's work
    return side.manager.may_hold(first[0])
