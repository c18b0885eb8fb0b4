"""The connector's worker half: runs the scheduler's jobs against vLLM's KV cache.

This runs in every vLLM worker. Jobs are submitted once each, by id, however often
vLLM calls in a step; the job -> request map lives across steps; completions come
from ``TierWorker.poll``, which is thread-safe. Nothing here waits on storage,
except ``handle_preemptions``, which waits for the device -> host copies that
still read blocks vLLM is about to reuse, a step that computes nothing (a short,
bounded wait for a job to finish rather than a busy loop), and ``shutdown``.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch

from kvtier.common.config import KVTierConfig
from kvtier.integrations.vllm.metadata import KVTierHandshake, KVTierMetadata, KVTierWorkerMetadata, RankReport
from kvtier.integrations.vllm.namespace import EngineGeometry
from kvtier.integrations.vllm.shutdown_drain import drain_finished_requests
from kvtier.worker import TierWorker
from kvtier.worker.tier_worker import at_exit

logger = logging.getLogger("kvtier.vllm")


class WorkerSide:
    def __init__(self, config: KVTierConfig, geometry: EngineGeometry, rank: int, role: str = "kv_both"):
        self.config = config
        self.geometry = geometry
        self.rank = rank  # ``namespace.worker_rank``: the tensor-parallel rank without pipeline parallelism
        self.is_producer = role == "kv_producer"
        self._released_slot_ids: list[int] = []
        self._num_reports = 0
        self._untaken: list[RankReport] = []  # reports sent that no step has said were taken (``RankReport``)
        self._layer_index = {name: i for i, name in enumerate(geometry.layer_names)}
        self._step_loads: list[int] = []  # this step's loads within the step (``LoadJob.in_step``)
        self._step_blocks: set[int] = set()  # their device blocks
        self._in_step_load_ids: set[int] = set()  # synchronous: vLLM expects no finished_recving for them
        self._waves: set[int] = set()  # loads that a later job of their request ends (``LoadJob.final``)
        self.tier_worker: TierWorker | None = None
        self._submitted_job_ids: set[int] = set()
        self._load_owner: dict[int, str] = {}  # load job id -> request id, across steps
        self._send_waits: dict[str, list[int]] = {}
        self._idle_step = False  # this step computes nothing
        self._idle_wait_s = 0.0  # ... and requests wait for a producer's blocks: wait this long
        self._reports = []
        self._load_error_block_ids: set[int] = set()
        self._drain_address = ""  # the scheduler side's, for the last stores at shutdown (``shutdown_drain``)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.geometry.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvtier: vLLM gave no KV cache for layers {missing[:4]}")
        tensors = [kv_caches[name] for name in self.geometry.layer_names]
        broadcast_group = None
        if self.config.save_only_first_rank and self.geometry.tp_size > 1:
            import torch.distributed as dist
            from vllm.distributed.parallel_state import get_tp_group

            if self.geometry.tp_rank_count != self.geometry.tp_size:
                raise ValueError("kvtier config: key 'save_only_first_rank' supports tensor parallelism without "
                                 "pipeline parallelism")
            # kvtier's own group: its collectives run on kvtier's thread, never interleaved with vLLM's.
            # Bounded: rank 0 enters a load's collectives after its reads (up to load_timeout_s);
            # past that and a margin, a rank that waits gives up and recomputes (gloo's own default
            # would hold it for 30 minutes).
            broadcast_group = dist.new_group(get_tp_group().ranks, backend="gloo",
                                             timeout=timedelta(seconds=self.config.load_timeout_s + 30))
        self.tier_worker = TierWorker(self.config, tensors, self.geometry.num_blocks, self.geometry.block_size,
                                      self.geometry.namespace, self.rank, broadcast_group=broadcast_group)
        if self.tier_worker.layout.slot_bytes != self.geometry.slot_bytes:
            raise ValueError(f"kvtier: KV cache layout {self.tier_worker.layout.kind} holds "
                             f"{self.tier_worker.layout.slot_bytes} bytes per block, vLLM's spec says "
                             f"{self.geometry.slot_bytes}")
        logger.info("kvtier: %s layout, %d layers, %d host slots of %d bytes", self.tier_worker.layout.kind,
                    len(tensors), self.tier_worker.num_slots, self.tier_worker.layout.slot_bytes)
        if self.rank == 0 and tensors[0].device.type == "cpu":  # vLLM's CPU build: the cores it left the model
            from kvtier.integrations.vllm.cpu_reservation import advice
            logger.info("kvtier: %s", advice(self.geometry.tp_rank_count, len(os.sched_getaffinity(0))))
        # An offline job's engine may never be shut down: its last stores run at exit all the same
        # (registered after the tier worker's own flush at exit, so run before it).
        at_exit(self, "shutdown")

    def unregister_kv_caches(self) -> None:
        """Sleep mode: the KV cache is about to be released. Copies in flight get up to
        ``load_timeout_s``; none starts until ``restore_kv_caches``."""
        if self.tier_worker is not None:
            self.tier_worker.suspend_device(self.config.load_timeout_s)

    def restore_kv_caches(self) -> None:
        """Sleep mode: the KV cache is mapped again; kvtier rebinds to its addresses."""
        if self.tier_worker is not None:
            self.tier_worker.resume_device()

    def handshake(self) -> KVTierHandshake:
        layout = self.tier_worker.layout
        return KVTierHandshake(self.rank, self.tier_worker.rank_fingerprint, layout.slot_bytes,
                               layout.describe())

    def _new_jobs(self, jobs):
        for job in jobs:
            if job.job_id not in self._submitted_job_ids:  # a job is submitted once, however often we are called
                self._submitted_job_ids.add(job.job_id)
                yield job

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        # Send waits are taken here, the one hook every step calls (vLLM 0.30 skips wait_for_save
        # in a step without a forward, and a finished request's wait often comes in one). Their
        # stores were submitted in earlier steps' wait_for_save; get_finished reports them.
        self._send_waits.update(meta.send_waits)
        taken = meta.reports_taken.get(self.rank, 0)
        self._untaken = [part for part in self._untaken if part.number > taken]  # a few: the steps in flight
        self._drain_address = meta.drain_address or self._drain_address
        self._idle_step = meta.idle
        self._idle_wait_s = meta.idle_wait_s
        for job in self._new_jobs(meta.finished_store_jobs):  # their KV is in place: no forward to wait for
            self.tier_worker.submit_store(job)
        self._step_loads, self._step_blocks = [], set()
        for job in self._new_jobs(meta.load_jobs):
            self._load_owner[job.job_id] = job.req_id
            if not job.final:
                self._waves.add(job.job_id)
            if job.in_step:
                # Layer-wise, every layer's copy starts now, in layer order, and each layer's attention
                # waits for its own; else one copy of every layer, waited for below.
                self.tier_worker.submit_load_in_step(job, per_layer=self._per_layer)
                self._step_loads.append(job.job_id)
                self._step_blocks.update(job.ready_block_ids)
                self._in_step_load_ids.add(job.job_id)
            else:
                self.tier_worker.submit_load(job)
        if self._step_loads and not self._per_layer:
            self._wait_for_in_step_loads(0)  # before the forward: attention reads these blocks
        if self.config.layerwise and self.tier_worker.num_layers == len(self._layer_index):
            for job in meta.store_jobs:  # every layer's transfer made now, so that save_kv_layer only enqueues
                if job.job_id not in self._submitted_job_ids:
                    self.tier_worker.prepare_store_layers(job)

    @property
    def _per_layer(self) -> bool:
        """Loads within the step go layer by layer: ``layerwise``, and vLLM calls the layer hooks with a
        KV tensor per layer (a cross-layer cache has one for all)."""
        return self.config.layerwise and self.tier_worker.num_layers == len(self._layer_index)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._step_loads and self._per_layer:
            # Only this layer: layers after it keep arriving while it computes.
            self._wait_for_in_step_loads(self._layer_index[layer_name])

    def _wait_for_in_step_loads(self, layer: int) -> None:
        if not self.tier_worker.wait_for_layer(self._step_loads, layer, self.config.load_timeout_s):
            # The KV is not in the device cache in time: this step's in-step blocks are reported
            # failed, so vLLM recomputes them (and drops what this step computed on them).
            # A late copy still lands the same bytes, into blocks pinned until it does.
            logger.error("kvtier: layer %d of loads %s not copied within load_timeout_s=%.1f s; their "
                         "blocks will be recomputed", layer, self._step_loads, self.config.load_timeout_s)
            self._load_error_block_ids.update(self._step_blocks)
            self._step_loads = []

    def save_kv_layer(self, layer_name: str, meta: KVTierMetadata) -> None:
        if not self.config.layerwise or not meta.store_jobs or self.tier_worker.num_layers != len(self._layer_index):
            return
        layer = self._layer_index[layer_name]
        # Called right after this layer's attention wrote its KV (on CUDA the copy stream
        # waits for the compute stream at this point: this layer's compute, not the next).
        for job in meta.store_jobs:
            self.tier_worker.submit_store_layer(job, layer)  # once per layer: the worker ignores a repeat

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        # Called after the step's forward: the KV that these stores read has been written.
        submitted = []
        for job in self._new_jobs(meta.store_jobs):
            self.tier_worker.submit_store(job)  # layer-wise: the layers whose attention did not run
            submitted.append(job.job_id)
        if (self.config.layerwise or self.geometry.sliding_window) and submitted:
            # Every layer of this step is copied before the next step may overwrite anything: the
            # next step's own KV (layer-wise), or another request's in blocks that vLLM frees as they
            # leave a sliding window, at the next step's scheduling.
            self.tier_worker.wait_for_device_reads(submitted, self.config.load_timeout_s)
        if self.is_producer and submitted:
            # Prefill/decode hand-off: this step's output (the first token) leaves only once
            # its blocks are durable in the pool, so the decode instance finds them. Bounded.
            if not self.tier_worker.wait_for_stores(submitted, timeout=2 * self.config.remote_timeout_s + 1):
                logger.warning("kvtier: pool writes of jobs %s not durable in time; the decode instance "
                               "will recompute what it does not find", submitted)

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        if meta.preempted_store_job_ids and self.tier_worker is not None:
            # vLLM reuses a preempted request's blocks in this step: finish reading them first.
            self.tier_worker.wait_for_device_reads(meta.preempted_store_job_ids, self.config.load_timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        finished_recving: set[str] = set()
        if self._idle_step and self.tier_worker is not None:
            # Nothing to compute: the engine would step again at once, a busy loop on a core that
            # kvtier's I/O process needs for the loads it waits for (or a producer, for the blocks that
            # requests wait for here). It waits for one instead, bounded.
            if self._idle_wait_s:
                self.tier_worker.wait_for_a_job(self._idle_wait_s)
            else:
                self.tier_worker.wait_for_a_load(self.config.idle_step_wait_s)
        for report in self.tier_worker.poll() if self.tier_worker is not None else ():
            self._reports.append(report)
            self._submitted_job_ids.discard(report.job_id)
            if report.is_load:
                req_id = self._load_owner.pop(report.job_id)
                if report.job_id in self._in_step_load_ids:
                    self._in_step_load_ids.discard(report.job_id)  # synchronous: done within its step
                elif report.job_id in self._waves:
                    self._waves.discard(report.job_id)  # a wave: the request's load ends with a later job
                else:
                    finished_recving.add(req_id)
                self._load_error_block_ids.update(report.failed_block_ids)
        self._released_slot_ids += self.tier_worker.released_slots() if self.tier_worker is not None else []
        finished_sending = {req_id for req_id, job_ids in self._send_waits.items()
                            if all(self.tier_worker.device_reads_done(j) for j in job_ids)}
        for req_id in finished_sending:
            del self._send_waits[req_id]
        return finished_sending, finished_recving

    @property
    def num_send_waits(self) -> int:
        return len(self._send_waits)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_error_block_ids = self._load_error_block_ids, set()
        return errors

    def build_worker_meta(self) -> KVTierWorkerMetadata | None:
        if not self._reports and not self._released_slot_ids:
            return None
        self._num_reports += 1
        part = RankReport(self.rank, self._num_reports, self._reports, self._released_slot_ids)
        self._reports, self._released_slot_ids = [], []
        self._untaken.append(part)
        return KVTierWorkerMetadata([part])

    def untaken_meta(self) -> KVTierWorkerMetadata | None:
        """At shutdown, once vLLM steps no more: this step's report and every earlier one not yet taken."""
        self.build_worker_meta()
        return KVTierWorkerMetadata(list(self._untaken)) if self._untaken else None

    def shutdown(self) -> None:
        """Stores of finished requests still unstored (planned by the scheduler side, ``shutdown_drain``),
        then the writes under way: together within ``shutdown_flush_s``."""
        if self.tier_worker is None or self.tier_worker.closed:
            return
        deadline = time.monotonic() + self.config.shutdown_flush_s
        if self._drain_address:  # every rank, those without tiers too (``save_only_first_rank``): each reports each job
            try:
                drain_finished_requests(self, self._drain_address, deadline)
            except Exception:  # what is queued is still flushed below
                logger.exception("kvtier: storing finished requests' blocks at shutdown failed")
        self.tier_worker.close(max(0.0, deadline - time.monotonic()))

