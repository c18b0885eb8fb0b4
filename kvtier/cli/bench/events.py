"""``kvtier bench events``: what announcing kvtier's tiers in vLLM's KV events costs the
scheduler's thread, per block, against the time one block of prefill takes here.

Runs kvtier's event code (``KVEvents``: vLLM's metadata of each block taken when it is
keyed, then a ``BlockStored`` per tier it lands in and a ``BlockRemoved`` per eviction)
on requests shaped like vLLM's (``block_hashes``, ``all_token_ids``), with vLLM's own
event classes. The bound it is held to: at 1,000 blocks per second, the share of each
second of the scheduler's thread that this work takes (the goal: under 2 %). vLLM's
publisher encodes and sends the events on a thread of its own, outside the step.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace


def run(num_blocks: int = 20_000, block_size: int = 32, blocks_per_request: int = 16, repeats: int = 3) -> dict:
    from kvtier.integrations.vllm.events import KVEvents
    from kvtier.tiers.base import TierSpec

    specs = [TierSpec("disk", "kvtier.tiers.disk", "/tmp/x"),
             TierSpec("redis", "kvtier.tiers.redis", "redis://127.0.0.1:6379/0")]

    requests = []
    for r in range(num_blocks // blocks_per_request):
        tokens = list(range(r, r + blocks_per_request * block_size))
        requests.append(SimpleNamespace(block_hashes=[os.urandom(32) for _ in range(blocks_per_request)],
                                        all_token_ids=tokens, lora_request=None, mm_features=None,
                                        cache_salt=None, prompt_embeds=None))
    keys = [[os.urandom(16) for _ in range(blocks_per_request)] for _ in requests]
    best = float("inf")
    for _ in range(repeats):
        events = KVEvents(specs, max_unheld=num_blocks)
        began = time.perf_counter()
        out = 0
        for request, request_keys in zip(requests, keys):
            events.remember(request, request_keys, 0, block_size)
            holdings = [(kind, tier, key) for key in request_keys for kind, tier in
                        (("stored", "host"), ("stored", "disk"), ("stored", "redis"), ("removed", "host"))]
            out += len(events.events(holdings, block_size))
        best = min(best, time.perf_counter() - began)
    per_block_us = best / num_blocks * 1e6
    return {"blocks": num_blocks, "events": out, "us_per_block": per_block_us,
            "share_of_a_second_at_1000_blocks_per_s": per_block_us * 1000 / 1e6}


def main(args) -> dict:
    from kvtier.cli.bench.report import print_table

    result = run()
    if not args.json:
        print_table("kvtier bench events (scheduler thread, per block: keyed, stored in host, disk and a pool, "
                    "evicted from host)", [
                        ("blocks", str(result["blocks"])),
                        ("events built", str(result["events"])),
                        ("us per block", f"{result['us_per_block']:.1f}"),
                        ("share of the scheduler's time at 1,000 blocks/s",
                         f"{100 * result['share_of_a_second_at_1000_blocks_per_s']:.2f}%"),
                    ])
    return result
