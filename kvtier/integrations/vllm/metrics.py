"""kvtier's figures in vLLM's connector stats and on its Prometheus ``/metrics``.

The scheduler side knows everything worth counting (hits per tier, bytes and time
per direction from the workers' reports, pool occupancy, evictions, failures), so
it alone produces ``KVTierStats``; vLLM logs them and feeds ``KVTierPromMetrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# Counters are sums over an interval; gauges are the latest value. Per-tier ones carry a
# ``tier`` label ("host", or the tier's name: "disk", "file", "redis", "mooncake"); in
# ``KVTierStats.data`` they are keyed "<name>|<tier>".
COUNTERS = {
    "miss_tokens": "Prompt tokens that no tier nor the engine's prefix cache held",
    "load_bytes": "Bytes loaded into the engine's KV cache",
    "load_seconds": "Seconds spent loading (slowest rank per job)",
    "store_bytes": "Bytes stored from the engine's KV cache",
    "store_seconds": "Seconds spent storing (slowest rank per job)",
    "failed_load_blocks": "Blocks that failed to load and were recomputed",
    "bad_entries": "Stored entries found corrupt, truncated, foreign or missing",
    "skipped_store_blocks": "Blocks a finished request left unstored for lack of free host slots",
    "failed_store_blocks": "Blocks whose store failed (the copy failed, or the engine reused them first)",
    "abandoned_loads": "Loads whose reads did not end within load_timeout_s (recomputed)",
    "abandoned_stores": "Stores whose tier writes went unanswered and were given up",
    "handoff_timeouts": "Requests that waited load_timeout_s for blocks a prefill instance said it stores "
                        "(they kept coming, too slowly), then computed the rest",
    "handoff_stalls": "Requests that waited for blocks a prefill instance said it stores until none had "
                      "arrived for handoff_stall_s (it died or is stuck), then computed the rest",
    "handoff_cut_short": "Requests handed over by a prefill instance that did not wait for its blocks: the "
                         "storage pool was down, or their load from it failed",
    "hit_requests": "Requests whose first token followed a load from kvtier (counted in hit_phase_seconds)",
    "hit_lookup_rounds": "Times those requests' lookups answered 'ask again' (a tier or a block on its way)",
    "hit_in_step_requests": "Of those requests, the ones whose hit was copied within the step of its forward "
                            "(held in the host pool; counted in hit_in_step_phase_seconds too)",
}
TIER_COUNTERS = {
    "hit_tokens": "Prompt tokens loaded, by the tier they came from",
    "written_blocks": "Blocks written through to a tier",
    "failed_writes": "Blocks that could not be written to a tier (down, slow, full or failing)",
    "evictions": "Blocks or entries evicted from a tier",
    "down": "Times a shared tier was marked down (a failed call, or one past remote_timeout_s)",
}
# Counters with a ``reason`` label: why prompt tokens were missed. At lookup, by the first block
# that no tier held ("never_stored", "evicted_<tier>", "damaged", "pool_down_or_slow",
# "no_free_host_slot", "partial_block", "producer_late", "engine_cannot_load", "request_skips_cache");
# at load, blocks planned and then recomputed ("load_abandoned", "damaged", "evicted_<tier>": gone since
# the lookup, "load_failed"). Keyed
# "<name>|<reason>" in ``KVTierStats.data``.
REASON_COUNTERS = {
    "miss_tokens_by_reason": "Prompt tokens that no tier held, by why the first of them was not found",
}
# Seconds of those requests' time to first token, by phase (``kvtier.scheduler.hit_times``: queue,
# lookup, plan, to_worker, read, copy, report, resume, forward). Keyed "<name>|<phase>".
PHASE_COUNTERS = {
    "hit_phase_seconds": "Seconds of kvtier hits' time to first token, by phase",
    "hit_in_step_phase_seconds": "Of those seconds, the ones of hits copied within the step of their forward",
}
GAUGES = {
    "host_used_slots": "Host pool slots in use",
    "host_pinned_slots": "Host pool slots pinned by transfers in flight",
    "host_slots": "Host pool slots in all",
    "handoff_waiting_requests": "Requests waiting for blocks that a prefill instance is still storing",
}
TIER_GAUGES = {
    "entries": "Entries a tier's index holds (tiers that keep a list)",
}


def _base(name: str) -> str:
    return name.split("|", 1)[0]


@dataclass
class KVTierStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            counter = any(_base(name) in kind for kind in (COUNTERS, TIER_COUNTERS, REASON_COUNTERS, PHASE_COUNTERS))
            merged[name] = merged.get(name, 0) + value if counter else value
        return KVTierStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        reduced = {name: round(value, 4) for name, value in self.data.items()}
        if self.data.get("load_seconds"):
            reduced["load_gbps"] = round(self.data["load_bytes"] / self.data["load_seconds"] / 1e9, 3)
        if self.data.get("store_seconds"):
            reduced["store_gbps"] = round(self.data["store_bytes"] / self.data["store_seconds"] / 1e9, 3)
        return reduced

    def is_empty(self) -> bool:
        # ``StatsTracker.collect`` makes one only when a counter or a gauge changed: then it carries news.
        return not self.data


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labelvalues = per_engine_labelvalues
        self._metrics = {}
        for docs, cls, label in ((COUNTERS, self._counter_cls, None), (TIER_COUNTERS, self._counter_cls, "tier"),
                                 (REASON_COUNTERS, self._counter_cls, "reason"),
                                 (PHASE_COUNTERS, self._counter_cls, "phase"), (GAUGES, self._gauge_cls, None),
                                 (TIER_GAUGES, self._gauge_cls, "tier")):
            for name, doc in docs.items():
                extra = {} if cls is self._counter_cls else {"multiprocess_mode": "mostrecent"}
                self._metrics[name] = (cls(name=f"vllm:kvtier_{name}", documentation=doc,
                                           labelnames=list(labelnames) + ([label] if label else []), **extra),
                                       cls is self._counter_cls)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, value in transfer_stats_data.items():
            name, _, tier = key.partition("|")
            if name not in self._metrics:
                continue
            metric, is_counter = self._metrics[name]
            child = metric.labels(*self._labelvalues[engine_idx], *([tier] if tier else []))
            if not is_counter:
                child.set(value)
            elif value:
                child.inc(value)


class StatsTracker:
    """Turns the manager's cumulative counters into per-interval ``KVTierStats``."""

    def __init__(self):
        self._last: dict[str, float] = {}
        self._last_gauges: dict[str, float] = {}

    def collect(self, manager, hit_tokens: dict[str, int], miss_tokens: int, handoffs, times) -> KVTierStats | None:
        stats = manager.stats
        tier_stats = {tier.name: tier.stats() for tier in manager.tiers}
        totals = {
            "miss_tokens": miss_tokens,
            "load_bytes": stats.load_bytes, "load_seconds": stats.load_seconds,
            "store_bytes": stats.store_bytes, "store_seconds": stats.store_seconds,
            "failed_load_blocks": stats.failed_load_blocks, "bad_entries": stats.bad_entries,
            "skipped_store_blocks": stats.skipped_store_blocks, "failed_store_blocks": stats.failed_store_blocks,
            "abandoned_loads": stats.abandoned_loads, "abandoned_stores": stats.abandoned_stores,
            "handoff_timeouts": handoffs.num_timeouts, "handoff_stalls": handoffs.num_stalls,
            "handoff_cut_short": handoffs.num_cut_short,
            "evictions|host": manager.host.num_evictions,
            **{f"hit_tokens|{tier}": tokens for tier, tokens in hit_tokens.items()},
            **{f"written_blocks|{tier}": n for tier, n in stats.written_blocks.items()},
            **{f"failed_writes|{tier}": n for tier, n in stats.failed_writes.items()},
            **{f"evictions|{name}": figures["evictions"] for name, figures in tier_stats.items()
               if "evictions" in figures},
            **{f"down|{name}": figures["down"] for name, figures in tier_stats.items() if "down" in figures},
            **{f"miss_tokens_by_reason|{reason}": n for reason, n in manager.ledger.misses.items()},
            "hit_requests": times.num_requests, "hit_lookup_rounds": times.num_rounds,
            **{f"hit_phase_seconds|{phase}": seconds for phase, seconds in times.seconds.items()},
            "hit_in_step_requests": times.num_in_step,
            **{f"hit_in_step_phase_seconds|{phase}": seconds for phase, seconds in times.in_step_seconds.items()},
        }
        deltas = {name: value - self._last.get(name, 0) for name, value in totals.items()}
        gauges = {"host_used_slots": manager.host.num_used, "host_pinned_slots": manager.host.num_pinned,
                  "host_slots": manager.host.num_slots, "handoff_waiting_requests": handoffs.num_waiting,
                  **{f"entries|{name}": figures["entries"] for name, figures in tier_stats.items()
                     if "entries" in figures}}
        if not any(deltas.values()) and gauges == self._last_gauges:
            return None
        self._last, self._last_gauges = totals, gauges
        return KVTierStats(data={**deltas, **gauges})
