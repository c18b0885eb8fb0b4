"""kvtier's figures in vLLM's connector stats and on its Prometheus ``/metrics``.

The scheduler side knows everything worth counting (hits per tier, bytes and time
per direction from the workers' reports, pool occupancy, evictions, failures), so
it alone produces ``KVTierStats``; vLLM logs them and feeds ``KVTierPromMetrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# Counters are sums over an interval; gauges are the latest value.
COUNTERS = {
    "hit_tokens_host": "Prompt tokens loaded from the host pool",
    "hit_tokens_disk": "Prompt tokens loaded from the disk tier",
    "hit_tokens_remote": "Prompt tokens loaded from the shared storage pool",
    "miss_tokens": "Prompt tokens that no tier nor the engine's prefix cache held",
    "load_bytes": "Bytes loaded into the engine's KV cache",
    "load_seconds": "Seconds spent loading (slowest rank per job)",
    "store_bytes": "Bytes stored from the engine's KV cache",
    "store_seconds": "Seconds spent storing (slowest rank per job)",
    "evictions_host": "Blocks evicted from the host pool",
    "evictions_disk": "Entries evicted from the disk tier",
    "failed_load_blocks": "Blocks that failed to load and were recomputed",
    "failed_remote_writes": "Blocks that could not be written to the pool (down, slow or full)",
    "bad_entries": "Stored entries found corrupt, truncated, foreign or missing",
    "skipped_store_blocks": "Blocks not stored for lack of free host slots",
}
GAUGES = {
    "host_used_slots": "Host pool slots in use",
    "host_pinned_slots": "Host pool slots pinned by transfers in flight",
    "host_slots": "Host pool slots in all",
    "disk_entries": "Entries in the disk tier",
}


@dataclass
class KVTierStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value if name in COUNTERS else value
        return KVTierStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        reduced = {name: round(self.data.get(name, 0), 4) for name in (*COUNTERS, *GAUGES) if name in self.data}
        if self.data.get("load_seconds"):
            reduced["load_gbps"] = round(self.data["load_bytes"] / self.data["load_seconds"] / 1e9, 3)
        if self.data.get("store_seconds"):
            reduced["store_gbps"] = round(self.data["store_bytes"] / self.data["store_seconds"] / 1e9, 3)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvtier_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for name, doc in COUNTERS.items()}
        self._gauges = {
            name: create_metric_per_engine(
                self._gauge_cls(name=f"vllm:kvtier_{name}", documentation=doc, labelnames=labelnames,
                                multiprocess_mode="mostrecent"),
                per_engine_labelvalues)
            for name, doc in GAUGES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)


class StatsTracker:
    """Turns the manager's cumulative counters into per-interval ``KVTierStats``."""

    def __init__(self):
        self._last: dict[str, float] = {}

    def collect(self, manager, hit_tokens: dict[str, int], miss_tokens: int) -> KVTierStats | None:
        stats = manager.stats
        totals = {
            "hit_tokens_host": hit_tokens["host"], "hit_tokens_disk": hit_tokens["disk"],
            "hit_tokens_remote": hit_tokens["remote"], "miss_tokens": miss_tokens,
            "load_bytes": stats.load_bytes, "load_seconds": stats.load_seconds,
            "store_bytes": stats.store_bytes, "store_seconds": stats.store_seconds,
            "evictions_host": manager.host.num_evictions,
            "evictions_disk": manager.disk.num_evictions if manager.disk else 0,
            "failed_load_blocks": stats.failed_load_blocks, "bad_entries": stats.bad_entries,
            "failed_remote_writes": stats.failed_remote_writes,
            "skipped_store_blocks": stats.skipped_store_blocks,
        }
        deltas = {name: value - self._last.get(name, 0) for name, value in totals.items()}
        if not any(deltas.values()):
            return None
        self._last = totals
        gauges = {"host_used_slots": manager.host.num_used, "host_pinned_slots": manager.host.num_pinned,
                  "host_slots": manager.host.num_slots,
                  "disk_entries": manager.disk.num_entries if manager.disk else 0}
        return KVTierStats(data={**deltas, **gauges})
