"""``TierWorker``: one per worker (tensor-parallel rank); the engine's side of kvtier's I/O.

It owns the host pool's memory (shared with its I/O process, which does every
storage read and write) and the transfer engine (device <-> host slots), and it
builds the two job paths on one book. Completions advance on kvtier's own
threads: the I/O process's answers on its receiver thread, finished copies and
overdue loads on a progress thread here, so a write-through starts the moment
its copy is done, step or no step. ``close`` (also run at interpreter exit)
drains the writes under way, bounded by ``shutdown_flush_s``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Sequence

import torch

from kvtier.common.config import KVTierConfig
from kvtier.common.entry import HEADER_BYTES
from kvtier.common.host_slots import HostSlots, num_host_slots
from kvtier.common.keys import Namespace
from kvtier.common.layout import KVLayout, TensorInfo, detect_layout
from kvtier.common.plans import JobReport, LoadJob, StoreJob
from kvtier.io.client import IOProcess
from kvtier.tiers.registry import tier_specs
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.host_buffer import SharedHostMemory
from kvtier.worker.jobs import JobBook, Load, blocks_per_job
from kvtier.worker.wrappers import Wrapping

logger = logging.getLogger("kvtier.worker")

# The progress thread's waits. CUDA copies in flight are polled (their events tell no thread);
# with nothing in flight it sleeps longer, and a completion wakes it. (The engine's step polls
# CUDA copies too: ``poll``.)
CUDA_POLL_S = 0.001
IDLE_WAIT_S = 0.05


def tensor_info(tensor: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(), tensor.data_ptr())


class TierWorker:
    def __init__(self, config: KVTierConfig, tensors: Sequence[torch.Tensor], num_blocks: int, block_size: int,
                 namespace: Namespace, rank: int = 0, layout_kind: str | None = None, broadcast_group=None):
        self.config = config
        self.tensors = list(tensors)  # kept alive: copies use their addresses
        self.layout: KVLayout = detect_layout([tensor_info(t) for t in self.tensors], num_blocks, block_size,
                                              layout_kind)
        device_layout = f"{self.layout.describe()}{self.tensors[0].dtype}"
        wrapping = self.wrapping = Wrapping.of(config, rank, broadcast_group)  # the optional features
        self.rank_fingerprint = namespace.for_rank(wrapping.key_rank, device_layout).fingerprint()
        self.num_slots = num_host_slots(config.host_bytes, self.layout.slot_bytes)
        if self.num_slots == 0:
            raise ValueError(f"host_bytes={config.host_bytes} is smaller than one block ({self.layout.slot_bytes} bytes)")
        self.device_is_cuda = self.tensors[0].is_cuda
        # Entry headers beside the slots on CPU, apart on CUDA (``kvtier.common.host_slots``).
        self.slots = HostSlots(self.num_slots, self.layout.slot_bytes, 0 if self.device_is_cuda else HEADER_BYTES)
        self.memory = SharedHostMemory(self.slots.num_bytes, pin=self.device_is_cuda)
        logger.info("kvtier: host pool of %d MiB, %d MiB of it on 2 MiB pages", self.slots.num_bytes >> 20,
                    self.memory.huge_bytes >> 20)
        self.host_buffer = self.memory.tensor
        host_slots, _ = self.slots.views(self.host_buffer.numpy())
        self._wake = threading.Event()
        self.transfers = TransferEngine(self._make_copier(), on_complete=self._wake.set)
        self.book = JobBook(self.transfers)
        specs = tier_specs(config) if wrapping.reads_tiers else []
        self.io = IOProcess(self.memory.fd, specs, self.rank_fingerprint, self.slots,
                            config.shutdown_flush_s) if specs else None
        wrapping.build_parts(self.layout, self.tensors, host_slots)
        job_blocks = blocks_per_job(specs, self.layout.slot_bytes)
        # A weak method: a worker held only by its own load path would wait for the cyclic garbage
        # collector, and with it the host pool's memory (one engine after another in one process).
        self.loads = wrapping.load_path(self.book, self.io, config.load_timeout_s, self.num_layers, job_blocks,
                                        _weakly(self._advance), check_in_copy=self.transfers.takes_checksums)
        self.stores = wrapping.store_path(self.book, self.io, config.remote_timeout_s, self.num_layers, job_blocks,
                                          abandon_s=config.load_timeout_s + config.remote_timeout_s)
        wrapping.attach(self.loads, self.stores)  # before any job: the paths call their parts from the first
        self.num_idle_waits = 0  # engine steps that waited for a load (wait_for_a_load)
        self._closed = False
        self._progress = threading.Thread(target=self._run_progress, daemon=True, name="kvtier-progress")
        self._progress.start()
        # An engine that is never shut down (an offline job that just ends) still flushes its writes.
        at_exit(self, "close")

    def _make_copier(self, first: bool = True):
        """The device half, bound to the KV cache's addresses as they are now. Only the
        first one warms up through host slot 0: later, the slot may hold a stored block."""
        if self.device_is_cuda:
            from kvtier.transfer.cuda import CudaCopier
            return CudaCopier(self.layout, self.tensors, self.host_buffer, warm_up=first)
        from kvtier.transfer.cpu import CpuCopier
        # Checksums taken in the copy are plain xxh3: with an entry key the I/O process makes and checks
        # its keyed tags.
        return CpuCopier(self.layout, self.tensors, self.host_buffer, self.config.copy_threads, self.slots.head_bytes,
                         checksums=self.config.entry_key_file is None)

    @property
    def num_layers(self) -> int:
        """Layers that can move separately: one per KV tensor (a cross-layer cache has one)."""
        return len(self.tensors)

    @property
    def num_verify_failures(self) -> int:
        return self.wrapping.counters().get("verify_failures", 0)

    @property
    def num_jobs_in_flight(self) -> int:
        return self.book.num_jobs

    # --- jobs: what the engine calls -------------------------------------------
    def submit_load(self, job: LoadJob) -> None:
        self.loads.submit(job)

    def submit_load_in_step(self, job: LoadJob, per_layer: bool) -> None:
        self.loads.submit_in_step(job, per_layer)

    def wait_for_layer(self, load_job_ids: Sequence[int], layer: int, timeout: float = 60.0) -> bool:
        return self.loads.wait_for_layer(load_job_ids, layer, timeout)

    def submit_store(self, job: StoreJob) -> None:
        self.stores.submit(job)

    def submit_store_layer(self, job: StoreJob, layer: int) -> None:
        self.stores.submit_layer(job, layer)

    def prepare_store_layers(self, job: StoreJob):
        return self.stores.prepare_layers(job)

    def device_reads_done(self, store_job_id: int) -> bool:
        return self.stores.device_reads_done(store_job_id)

    def wait_for_device_reads(self, store_job_ids: Sequence[int], timeout: float = 60.0) -> bool:
        return self.stores.wait_for_device_reads(store_job_ids, timeout)

    def wait_for_stores(self, store_job_ids: Sequence[int], timeout: float) -> bool:
        return self.stores.wait_for_stores(store_job_ids, timeout)

    def poll(self) -> list[JobReport]:
        """Jobs finished since the last call, each exactly once."""
        if self.io is not None:
            self.io.pump()  # answers that arrived since the last step, taken (and copied) on this thread
        if self.device_is_cuda and self.transfers.num_in_flight:
            # A CUDA copy's end is seen only by asking its event: each step asks, on this thread, as
            # vLLM's own offloading does in get_finished. Left to the progress thread, a copy submitted
            # while it sleeps out IDLE_WAIT_S waits for that, and waking it at each submit makes it
            # contend for the GIL with this thread while the copies run.
            self._advance()
        finished = self.book.take_finished()
        return finished + [report for part in self.wrapping.parts for report in part.poll()]

    def wait_for_a_load(self, timeout_s: float) -> None:
        """Wait until a job finishes, at most ``timeout_s``, if a load is in flight and nothing has
        finished yet (an engine step with nothing to compute). The I/O process's answers are taken by
        the receiver thread meanwhile, each chunk copied as it lands."""
        self._wait_for_a_report(timeout_s, loads_only=True)

    def wait_for_a_job(self, timeout_s: float) -> None:
        """Wait until a job finishes, at most ``timeout_s``, unless one has finished since the last
        ``poll`` (a shutdown's drain, waiting for writes to free host slots; an idle step)."""
        self._wait_for_a_report(timeout_s, loads_only=False)

    def _wait_for_a_report(self, timeout_s: float, loads_only: bool) -> None:
        with self.book.lock:
            if timeout_s <= 0 or (loads_only and not self.book.loads) or self.book.has_finished:
                return
            self.num_idle_waits += loads_only
            if self.io is not None:
                self.io.engine_waits(True)
            try:
                self.book.changed.wait(timeout_s)
            finally:
                if self.io is not None:
                    self.io.engine_waits(False)

    def released_slots(self) -> list[int]:
        """Held slots whose late reads have returned since the last call."""
        return self.book.take_released()

    # --- progress, on kvtier's own thread -------------------------------------
    def _run_progress(self) -> None:
        while not self._closed:
            # CUDA completions are found by polling events; CPU copies wake this thread themselves.
            self._wake.wait(CUDA_POLL_S if self.device_is_cuda and self.transfers.num_in_flight else IDLE_WAIT_S)
            self._wake.clear()
            try:
                self._advance()
                now = time.monotonic()
                self.loads.abandon_overdue(now)
                self.stores.abandon_overdue(now)
            except Exception:  # a bug here must not stop every later job from being reported
                logger.exception("kvtier: progress thread error")

    def _advance(self) -> None:
        """Move on every job whose copies have finished (each result is taken by one thread)."""
        for job, result in self.book.copied():
            (self.loads if isinstance(job, Load) else self.stores).copied(job, result)

    # --- sleep mode: the engine releases the KV cache and maps it again --------
    def suspend_device(self, timeout: float) -> None:
        """Before the KV cache is released: no copy runs or starts until ``resume_device``.
        The tiers keep every block (host slots, disk, storage pool); jobs submitted meanwhile fail
        and their blocks are recomputed. Idempotent."""
        self.transfers.suspend(timeout)

    def resume_device(self) -> None:
        """After the KV cache is mapped again, perhaps elsewhere: every address-bound part
        (the copier's tables, the broadcaster's addresses) is rebuilt from the tensors."""
        if not self.transfers.suspended:
            return
        layout = detect_layout([tensor_info(t) for t in self.tensors], self.layout.num_blocks,
                               self.layout.block_size, self.layout.kind)
        if (layout.slot_bytes, layout.describe()) != (self.layout.slot_bytes, self.layout.describe()):
            raise RuntimeError(f"kvtier: the KV cache came back as {layout.describe()}, not {self.layout.describe()}")
        self.layout = layout
        for part in self.wrapping.parts:
            part.rebind(self.tensors)
        self.transfers.resume(self._make_copier(first=False))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, flush_s: float | None = None) -> None:
        """Finish what is under way: the device copies, then the writes queued in the I/O
        process, for up to ``flush_s`` (``shutdown_flush_s``); what is left then is dropped and logged."""
        if self._closed:
            return
        deadline = time.monotonic() + (self.config.shutdown_flush_s if flush_s is None else flush_s)
        self.transfers.close()  # waits for the copies; the progress thread hands their writes on
        while self.stores.copies_pending() and time.monotonic() < deadline:
            time.sleep(0.005)
        self._closed = True
        self._wake.set()
        self._progress.join(timeout=5.0)
        if self.io is not None:
            finished, dropped = self.io.close(max(0.0, deadline - time.monotonic()))
            if dropped:
                logger.warning("kvtier: shutdown: %d queued I/O jobs (tier writes) dropped after shutdown_flush_s="
                               "%.1f s; %d finished", dropped, self.config.shutdown_flush_s, finished)
            elif finished:
                logger.info("kvtier: shutdown: %d queued I/O jobs finished", finished)
        for part in self.wrapping.parts:
            part.close(max(0.0, deadline - time.monotonic()))
        self.memory.close()


def _weakly(method):
    """``method``, called while its object lives; nothing once it is gone."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()
    return call


def at_exit(obj, method: str) -> None:
    """Call ``obj.<method>()`` when the interpreter exits, if ``obj`` is still alive then; a failure
    is logged, never raised. Hooks run in the reverse order of registration."""
    atexit.register(_call_at_exit, weakref.ref(obj), method)


def _call_at_exit(ref, method: str) -> None:
    obj = ref()
    if obj is not None:
        try:
            getattr(obj, method)()
        except Exception:  # at exit, a failure to flush is logged, never raised
            logger.exception("kvtier: flushing at exit failed")
