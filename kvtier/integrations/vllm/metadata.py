"""The two messages between vLLM's scheduler and its workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.common.plans import JobReport, LoadJob, StoreJob


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    load_jobs: list[LoadJob] = field(default_factory=list)
    store_jobs: list[StoreJob] = field(default_factory=list)
    # Requests preempted this step: their blocks are reused once stores reading them are done.
    preempted_store_job_ids: list[int] = field(default_factory=list)
    # Stores of finished requests' blocks, whose KV earlier steps wrote: submitted at once.
    finished_store_jobs: list[StoreJob] = field(default_factory=list)
    # Finished requests whose blocks vLLM keeps until these store jobs have read them.
    send_waits: dict[str, list[int]] = field(default_factory=dict)
    # The step computes nothing (every request waits, for its KV or otherwise).
    idle: bool = False
    # An idle step where requests wait for a producer's blocks (``handoffs``): the worker waits this long,
    # or until a job finishes, rather than have the engine spin on the cores the pool's writers need.
    idle_wait_s: float = 0.0
    # Where the scheduler side serves the workers' drain at their shutdown (``shutdown_drain``); "": nowhere.
    drain_address: str = ""
    # Rank -> the number of its last report (``RankReport``) that the scheduler side has taken.
    reports_taken: dict[int, int] = field(default_factory=dict)


@dataclass
class RankReport:
    """One rank's report of one step, numbered 1, 2, ... per rank. vLLM drops the report of a batch still
    in its queue when the engine in the caller's process stops stepping (seen with pipeline parallelism;
    asynchronous scheduling runs the same queue): a worker keeps each report until a step says it was taken, and
    sends again what was not at its shutdown (``shutdown_drain``); the scheduler side takes each once."""

    rank: int
    number: int
    reports: list[JobReport] = field(default_factory=list)
    released_slot_ids: list[int] = field(default_factory=list)  # held slots, one entry per rank


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step; vLLM concatenates the ranks' reports."""

    parts: list[RankReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        return KVTierWorkerMetadata(self.parts + other.parts)


@dataclass
class KVTierHandshake(KVConnectorHandshakeMetadata):
    """Each worker -> the scheduler, once at start-up, after the KV caches exist."""

    rank: int  # ``namespace.worker_rank``
    rank_fingerprint: bytes  # names this rank's entries: rank, device layout, model, ...
    slot_bytes: int
    layout: str


def check_handshakes(metadata: dict[int, KVTierHandshake], tp_rank_count: int, slot_bytes: int) -> list[bytes]:
    """Every rank's entry names, each once, once every rank's handshake agrees with vLLM's spec:
    one host slot and one entry size serve every rank."""
    ranks = sorted(metadata)
    if ranks != list(range(tp_rank_count)):
        raise ValueError(f"kvtier: expected a handshake from ranks 0..{tp_rank_count - 1} "
                         f"(tensor x pipeline parallel), got {ranks}")
    sizes = {metadata[r].slot_bytes for r in ranks}
    if len(sizes) > 1:
        raise ValueError(f"kvtier: the pipeline stages hold {sorted(sizes)} bytes per block, and kvtier needs "
                         f"every stage to hold the same: a pipeline_parallel_size that divides the model's "
                         f"layers, or VLLM_PP_LAYER_PARTITION giving each stage as many")
    if sizes != {slot_bytes}:
        raise ValueError(f"kvtier: workers hold {sizes} bytes per block, vLLM's spec says {slot_bytes}")
    # Replicated KV (save_only_first_rank): every rank names rank 0's entries; count them once.
    return list(dict.fromkeys(metadata[r].rank_fingerprint for r in ranks))
