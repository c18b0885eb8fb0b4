"""A worker's stores: device blocks -> host slots -> every tier (in the I/O process).

A store copies device -> host; from then on the device blocks may be reused. The
moment that copy is done (on the progress thread, whether or not the engine
steps) its writes go to the I/O process, in I/O jobs of about each tier's ``job_bytes``
(run side by side there), and when every one is answered the job is reported.
A layer-wise store makes one transfer per layer before the forward; each is sent
once, right after its layer's attention.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Sequence

import numpy as np

from kvtier.common.plans import JobReport, StoreJob
from kvtier.common.outcomes import FULL, unavailable
from kvtier.transfer.engine import TransferResult
from kvtier.worker.jobs import JobBook, Store

logger = logging.getLogger("kvtier.worker")


class FailedWritesLog:
    """One warning per tier per ``every_s`` about failed writes, with how many failed since the
    last one: a full or read-only disk is said once, not once per block."""

    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def failed(self, tier: str, count: int, why) -> None:
        now = time.monotonic()
        quiet = self._quiet.get(tier, 0) + count
        if now - self._last.get(tier, -self.every_s) < self.every_s:
            self._quiet[tier] = quiet
            return
        self._last[tier], self._quiet[tier] = now, 0
        logger.warning("kvtier: %d writes to tier %s failed (%s); the next warning in %.0f s at the earliest",
                       quiet, tier, why, self.every_s)


class StorePath:
    def __init__(self, book: JobBook, io, write_timeout_s: float, num_layers: int, job_blocks: dict[str, int],
                 abandon_s: float = 30.0):
        self.book = book
        self.job_blocks = job_blocks  # tier name -> blocks per I/O job (``blocks_per_job``)
        self.io = io  # IOProcess, or None where this worker writes no tier
        self.write_timeout_s = write_timeout_s
        self.abandon_s = abandon_s  # writes unanswered this long after they were sent are given up
        self.num_layers = num_layers
        self._failures_log = FailedWritesLog()
        # Layer-wise jobs prepared and not yet submitted whole: their layers may all finish (and
        # the job be reported, on kvtier's threads) before the engine's ``submit`` of the same job.
        self._layerwise: set[int] = set()

    def submit(self, job: StoreJob) -> None:
        with self.book.lock:
            prepared = self.book.stores.get(job.job_id)
            layerwise = job.job_id in self._layerwise
            self._layerwise.discard(job.job_id)
        if layerwise:  # the layers not sent yet, if any: a finished job is not stored twice
            if prepared is not None:
                for layer in range(self.num_layers):
                    self._send_layer(prepared, layer)
            return
        with self.book.lock:
            self.book.stores[job.job_id] = Store(job, JobReport(job.job_id, is_load=False, success=True))
        self.book.submit_transfer(job.block_ids, job.slot_ids, True, (False, job.job_id))

    def submit_layer(self, job: StoreJob, layer: int) -> None:
        """Copy one layer of the job's blocks, once that layer's KV is written (called right
        after the layer's attention). ``submit`` of the same job sends the layers not sent yet."""
        with self.book.lock:
            if job.job_id not in self._layerwise and job.job_id in self.book.stores:
                return  # submitted whole already
            store = self.book.stores.get(job.job_id)
        if store is None:
            store = self.prepare_layers(job)
            if store is None:
                return  # every layer sent and the job reported
        self._send_layer(store, layer)

    def _send_layer(self, store: Store, layer: int) -> None:
        with self.book.lock:
            transfer, store.layer_transfers[layer] = store.layer_transfers[layer], None
        if transfer is not None:  # each layer is sent once, however often it is asked for
            self.book.transfers.submit(transfer)

    def prepare_layers(self, job: StoreJob) -> Store | None:
        """Make every layer's transfer before the forward, so that ``submit_layer``, on the
        compute thread after each layer, only enqueues."""
        with self.book.lock:
            store = self.book.stores.get(job.job_id)
            if store is None and job.job_id in self._layerwise:
                return None  # prepared before, and every layer is done: nothing to make again
        if store is None:
            block_ids, slot_ids = np.asarray(job.block_ids, np.int64), np.asarray(job.slot_ids, np.int64)
            transfers = [self.book.registered_transfer(block_ids, slot_ids, True, (False, job.job_id), (layer,))
                         for layer in range(self.num_layers)]
            store = Store(job, JobReport(job.job_id, is_load=False, success=True), transfers_left=self.num_layers,
                          layer_transfers=transfers)
            with self.book.lock:
                self.book.stores[job.job_id] = store
                self._layerwise.add(job.job_id)
        return store

    def copied(self, store: Store, result: TransferResult) -> None:
        """On the progress thread: the device -> host copy is over; write through at once."""
        report, job = store.report, store.job
        report.num_bytes, report.seconds = result.num_bytes, result.seconds
        with self.book.lock:
            raced = store.raced
        writes = job.writes if result.success and not raced else {}
        if not result.success or raced:
            if not raced:
                logger.warning("kvtier: store job %d failed (%s)", job.job_id, result.error)
            report.success = False
            report.failed_writes = {tier: list(keys) for tier, keys in job.writes.items()}
        # Each slot's checksum, where the copy took it: every tier's write frames the slot without reading it.
        sums = None if result.checksums is None else dict(zip(job.slot_ids, result.checksums.tolist()))
        chunks = []  # (tier, keys, their slots, their locations), about the tier's job_bytes each
        for tier, keys in writes.items():
            slots, locations = job.slots_of(keys), job.write_locations.get(tier) or [-1] * len(keys)
            size = self.job_blocks.get(tier, 1)
            chunks += [(tier, keys[at:at + size], slots[at:at + size], locations[at:at + size])
                       for at in range(0, len(keys), size)]
        with self.book.lock:
            store.device_reads_done = True  # from here on the device blocks may be reused
            for tier, *_ in chunks:
                store.chunks_left[tier] = store.chunks_left.get(tier, 0) + 1
            store.abandon_at = time.monotonic() + self.abandon_s
            if not chunks:
                self._finish(store)
        deadline = time.monotonic() + self.write_timeout_s
        for tier, keys, slots, locations in chunks:
            written = partial(self._written, store, tier, keys)
            if self.io is None:
                written([unavailable("no I/O process")] * len(keys))
            else:
                self.io.submit(tier, True, keys, slots, locations, deadline, written,
                               None if sums is None else [sums[slot] for slot in slots])

    def _written(self, store: Store, tier: str, keys: list[bytes], reasons: list, deleted: list[bytes] = ()) -> None:
        """The I/O process answered one chunk of a tier's writes (on its receiver thread, or the engine's step);
        ``deleted``: entries the tier's store deleted meanwhile to stay within its bound."""
        failed = [key for key, why in zip(keys, reasons) if why is not None]
        if failed:
            self._failures_log.failed(tier, len(failed), next(why for why in reasons if why is not None))
        with self.book.lock:
            store.chunks_left[tier] -= 1
            if store.abandoned:  # reported already; the slots it held are free once no write reads them
                if store.writes_left == 0:
                    self.book.release(store.job.slot_ids)
                return  # its report is sent: the deletions this answer carries go untold
            if deleted:
                store.report.deleted.setdefault(tier, []).extend(deleted)
            if failed:
                store.report.failed_writes.setdefault(tier, []).extend(failed)
                if tier not in store.report.full_tiers and any(why is not None and why.kind == FULL for why in reasons):
                    store.report.full_tiers.append(tier)
            if store.writes_left == 0:
                self._finish(store)

    def abandon_overdue(self, now: float) -> None:
        """Report stores whose tier writes are unanswered ``abandon_s`` after they were sent (a
        pool that hangs): those writes count as failed, and the store's host slots are held, not
        reused, until the late writes have stopped reading them (``released_slots``)."""
        with self.book.lock:
            for job_id, store in list(self.book.stores.items()):
                if not store.device_reads_done or store.writes_left == 0 or now < store.abandon_at:
                    continue
                store.abandoned = True
                late = [tier for tier, left in store.chunks_left.items() if left]
                for tier in late:
                    store.report.failed_writes[tier] = list(store.job.writes[tier])
                store.report.held_slot_ids = list(store.job.slot_ids)
                logger.warning("kvtier: store job %d: writes to %s unanswered after %.0f s; given up, its host "
                               "slots held until they return", job_id, ", ".join(late), self.abandon_s)
                self._finish(store)

    def _finish(self, store: Store) -> None:  # under the lock
        del self.book.stores[store.job.job_id]
        self.book.finish(store.report)

    def device_reads_done(self, store_job_id: int) -> bool:
        with self.book.lock:
            store = self.book.stores.get(store_job_id)
            return store is None or store.device_reads_done

    def wait_for_device_reads(self, store_job_ids: Sequence[int], timeout: float) -> bool:
        """Block until the stores' device -> host copies are done (before their blocks are reused)."""
        wanted = self.book.store_transfers(store_job_ids)
        if self.book.transfers.order_compute_after(wanted):
            # CUDA: what the engine queues next (the writes that reuse these blocks, and loads,
            # whose streams wait for the compute stream) runs after the copies; no host wait.
            return True
        if self.book.transfers.wait(wanted, timeout):
            return True
        # The engine reuses the blocks now: a copy still reading them may read the new KV. Such a
        # store is never persisted, nor kept in the host pool (it is reported failed when it ends).
        with self.book.lock:
            raced = [j for j in store_job_ids if j in self.book.stores and not self.book.stores[j].device_reads_done]
            for job_id in raced:
                self.book.stores[job_id].raced = True
        if raced:
            logger.error("kvtier: stores %s still copying after %.1f s while the engine reuses their blocks; "
                         "they will not be stored", raced, timeout)
        return not raced

    def wait_for_stores(self, store_job_ids: Sequence[int], timeout: float) -> bool:
        """Block until the stores are complete everywhere (every tier written), or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.book.changed:
            while any(j in self.book.stores for j in store_job_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.book.changed.wait(left)
            return True

    def copies_pending(self) -> bool:
        """A store whose device -> host copy was sent and has not been handed to the tiers yet."""
        with self.book.lock:
            return any(s.transfers_left and not any(s.layer_transfers or ()) for s in self.book.stores.values())
