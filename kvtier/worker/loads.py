"""A worker's loads: tier -> host slots (in the I/O process) -> device blocks.

A load asks the I/O process to read its ``fill`` blocks into their reserved host
slots, in I/O jobs of about each tier's ``job_bytes`` (``kvtier.tiers.base``);
each answered chunk's usable blocks are copied host -> device at once, while the
I/O process reads the next chunks, and the job is reported when every chunk is
copied. A fill not answered within ``load_timeout_s`` abandons the load: it is
reported failed (the engine recomputes) once no copy of it is running, and its
slots are reported released only when the late reads have returned, so nothing
reuses a slot that a read may still write.

Where the copier takes checksums (``check_in_copy``: CPU, entries without a key, no
broadcast to other ranks), the I/O process checks every field of an entry but its
checksum, and answers the checksum; the copy to the device hashes each slot as it
reads it, and a block whose hash differs is a miss, its entry reported damaged
(``Load.check_copy``). The I/O process then never reads a loaded block's bytes.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Sequence

import numpy as np

from kvtier.common.plans import JobReport, LoadJob
from kvtier.common.outcomes import BAD, GONE, unavailable
from kvtier.transfer.engine import TransferResult
from kvtier.worker.jobs import JobBook, Load

logger = logging.getLogger("kvtier.worker")


class LoadPath:
    def __init__(self, book: JobBook, io, load_timeout_s: float, num_layers: int, job_blocks: dict[str, int],
                 advance, check_in_copy: bool = False):
        self.book = book
        self.advance = advance  # moves on every job whose copies have finished (the worker's)
        self.io = io  # IOProcess, or None where this worker reads no tier
        self.load_timeout_s = load_timeout_s
        self.num_layers = num_layers
        self.job_blocks = job_blocks  # tier name -> blocks per I/O job (``blocks_per_job``)
        self.check_in_copy = check_in_copy

    def submit(self, job: LoadJob) -> None:
        by_tier: dict[str, list[int]] = {}
        for i, tier in enumerate(job.fill_from):
            by_tier.setdefault(tier, []).append(i)
        chunks = [(tier, indices[at:at + size]) for tier, indices in by_tier.items()
                  for size in [self.job_blocks.get(tier, 1)] for at in range(0, len(indices), size)]
        # One copy per chunk, and one for the blocks already in host slots (or for none at all).
        load = self._new(job, fills=len(chunks), transfers=len(chunks) + bool(job.ready_block_ids or not chunks))
        self._began(load)
        if not chunks:
            load.fills_settled.set()
        if job.ready_block_ids or not chunks:
            self._submit_copy(load, job.ready_block_ids, job.ready_slot_ids)
        for tier, indices in chunks:
            blocks = [job.fill_block_ids[i] for i in indices]
            slots = [job.fill_slot_ids[i] for i in indices]
            keys = [job.fill_keys[i] for i in indices]
            locations = [job.fill_locations[i] for i in indices] if job.fill_locations else [-1] * len(keys)
            filled = partial(self._filled, load, blocks, slots, keys)
            if self.io is None:
                filled([unavailable("no I/O process")] * len(keys))
            else:
                self.io.submit(tier, False, keys, slots, locations, load.deadline, filled,
                               check_in_copy=self.check_in_copy)

    def submit_in_step(self, job: LoadJob, per_layer: bool) -> None:
        """A load of host-resident blocks within the engine's step, before their attention reads them:
        ``per_layer``, one copy per layer, each submitted now in layer order so that layer i is waited
        for alone (``wait_for_layer``); else one copy of every layer, on this thread where the device
        allows (CPU: the step waits for it anyway, and a handoff to another thread costs a GIL switch)."""
        if job.fill_keys:
            raise ValueError(f"load job {job.job_id}: a load within the step reads only host slots")
        layers = list(range(self.num_layers)) if per_layer else [None]
        load = self._new(job, fills=0, transfers=len(layers))
        with self.book.lock:
            load.copies_in_flight += len(layers)
        blocks, slots = np.array(job.ready_block_ids, np.int64), np.array(job.ready_slot_ids, np.int64)
        for layer in layers:
            transfer_id = self.book.submit_transfer(blocks, slots, False, (True, job.job_id),
                                                    None if layer is None else (layer,), inline=layer is None)
            # A whole copy stands for every layer: waiting for any layer waits for it.
            for each in ([layer] if layer is not None else range(self.num_layers)):
                load.layer_transfer_ids[each] = transfer_id

    def wait_for_layer(self, load_job_ids: Sequence[int], layer: int, timeout: float) -> bool:
        """Block until ``layer`` of these loads within the step is in the device cache."""
        with self.book.lock:
            wanted = {self.book.loads[j].layer_transfer_ids[layer] for j in load_job_ids
                      if j in self.book.loads and layer in self.book.loads[j].layer_transfer_ids}
        if self.book.transfers.order_compute_after(wanted):
            return True  # CUDA: the compute stream waits for the layer's copy; the host goes on
        return self.book.transfers.wait(wanted, timeout)

    def _new(self, job: LoadJob, fills: int, transfers: int) -> Load:
        now = time.monotonic()
        report = JobReport(job.job_id, is_load=True, success=True, failed_block_ids=list(job.missing_block_ids),
                           began_at=now, filled_at=now)  # a load that reads nothing is filled as it begins
        load = Load(job, report, now + self.load_timeout_s, fills,
                    list(zip(job.ready_block_ids, job.ready_slot_ids, job.ready_keys)), transfers_left=transfers)
        with self.book.lock:
            self.book.loads[job.job_id] = load
        return load

    def _began(self, load: Load) -> None:
        """A load is recorded and none of its reads or copies has started: what a wrapper around
        the path (``kvtier.worker.wrappers``) must do in job order, it queues here."""

    def _filled(self, load: Load, blocks: list[int], slots: list[int], keys: list[bytes], reasons: list,
                sums: list | None = None) -> None:
        """The I/O process answered one chunk of reads (on its receiver thread, or the engine's step);
        ``sums``: the checksums its entries hold, which the copy checks (``check_in_copy``)."""
        usable_blocks, usable_slots, usable_keys, expected = [], [], [], []
        misses: dict = {}  # Miss -> its entries: one line each (a pool's eviction misses many)
        with self.book.lock:
            for i, (block, slot, key, why) in enumerate(zip(blocks, slots, keys, reasons)):
                if why is None:
                    load.usable.append((block, slot, key))
                    usable_blocks.append(block)
                    usable_slots.append(slot)
                    usable_keys.append(key)
                    expected.append(None if sums is None else sums[i])
                    continue
                misses.setdefault(why, []).append(key)
                load.report.failed_block_ids.append(block)
                if why.kind == BAD:  # not a tier that could not be asked, nor an entry gone: the entry itself
                    load.report.bad_keys.append(key)
                elif why.kind == GONE:
                    load.report.gone_keys.append(key)
            for why, missed in misses.items():
                if len(missed) == 1:
                    logger.warning("kvtier: entry %s is a miss (%s); its block will be recomputed", missed[0].hex(), why)
                else:
                    logger.warning("kvtier: %d entries (the first %s) are misses (%s); their blocks will be recomputed",
                                   len(missed), missed[0].hex(), why)
            load.fills_left -= 1
            last, abandoned = load.fills_left == 0, load.abandoned
            if last:
                load.report.filled_at = time.monotonic()
                load.fills_settled.set()
            if last and abandoned:  # the late reads are over: the held slots may now be reused
                self.book.release(load.job.fill_slot_ids)
            if abandoned:
                return
            load.copies_in_flight += 1  # in the same hold of the lock: the load is not abandoned under the copy
        # This chunk has landed in its slots: copy it now, while later chunks are still being read.
        # On this thread, start to end where the device allows (CPU): each handoff to another thread
        # costs up to a GIL switch interval while the engine's thread is busy.
        checks = (usable_blocks, usable_keys, expected) if any(e is not None for e in expected) else None
        self._submit_copy(load, usable_blocks, usable_slots, inline=True, counted=True, checks=checks)
        self.advance()

    def _submit_copy(self, load: Load, blocks, slots, inline: bool = False, counted: bool = False,
                     checks: tuple | None = None) -> None:
        """``checks``: (blocks, keys, each one's entry checksum or None), compared as the copy ends."""
        transfer = self.book.registered_transfer(blocks, slots, False, (True, load.job.job_id), checked=bool(checks))
        with self.book.lock:
            if not counted:
                load.copies_in_flight += 1
            if checks:  # before the copy starts: an inline copy's result may be taken by another thread at once
                load.checks[transfer.job_id] = checks
        self.book.transfers.submit(transfer, inline)

    def copied(self, load: Load, result: TransferResult) -> None:
        """The load's last host -> device copy is over (on whichever thread saw it finish); report."""
        report = load.report
        report.num_bytes, report.seconds, report.finished_at = result.num_bytes, result.seconds, time.monotonic()
        if not result.success:
            logger.warning("kvtier: load job %d failed (%s); its blocks will be recomputed", load.job.job_id,
                           result.error)
            report.failed_block_ids += [block for block, _, _ in load.usable]
        report.success = not report.failed_block_ids
        # In one hold: a waiting idle step sees the load in flight or its report. (A load is never
        # abandoned with a copy in flight, ``abandon_overdue``: it is still here.)
        with self.book.lock:
            del self.book.loads[load.job.job_id]
            self.book.finish(report)

    def abandon_overdue(self, now: float) -> None:
        with self.book.lock:
            for job_id, load in list(self.book.loads.items()):
                if load.fills_left == 0 or now < load.deadline or load.copies_in_flight:
                    continue  # a copy to the device still running is waited for: it writes the load's blocks
                load.abandoned = True
                load.fills_settled.set()  # a broadcast waiting on these fills sends without them
                logger.warning("kvtier: load job %d not filled in %.1f s; its blocks will be recomputed", job_id,
                               self.load_timeout_s)
                del self.book.loads[job_id]
                job, report = load.job, load.report
                report.failed_block_ids = job.ready_block_ids + job.fill_block_ids + job.missing_block_ids
                report.held_slot_ids = list(job.fill_slot_ids)
                report.success = False
                self.book.finish(report)
