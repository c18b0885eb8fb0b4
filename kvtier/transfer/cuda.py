"""CUDA device: pooled streams and events, pinned host memory, coalesced DMA.

Each job gets its own stream from a pool, so a long queue of jobs never fills one
stream's queue and ``start`` never blocks the model (vLLM #29013). A store first
makes its stream wait for the compute stream, so it never copies KV that the
model has not finished writing (vLLM #31341). Blocks are gathered on the device
into a staging buffer laid out like host slots; each run of consecutive slot ids
then moves in one DMA (the ``swap_cache_layout`` idea). Streams, events and
staging buffers go back to their pools on every path, failures included.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.transfer.engine import DeviceCopier, TransferJob, TransferResult


def consecutive_runs(slot_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(position, first slot, count) for each maximal run of consecutive slot ids."""
    if slot_ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(slot_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [slot_ids.size]))
    return [(int(s), int(slot_ids[s]), int(e - s)) for s, e in zip(starts, ends)]


def segment_views(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One ``[num_blocks, nbytes]`` uint8 view per segment of the layout."""
    views = []
    for seg in layout.segments:
        flat = tensors[seg.tensor_index].view(torch.uint8).reshape(-1)
        span = flat[seg.offset: seg.offset + layout.num_blocks * seg.stride]
        views.append(span.view(layout.num_blocks, seg.stride)[:, :seg.nbytes])
    return views


@dataclass
class _InFlight:
    job: TransferJob
    stream: torch.cuda.Stream
    event: torch.cuda.Event
    staging: torch.Tensor  # kept alive until the event says every copy reading it has finished
    began: float
    num_bytes: int


class CudaCopier(DeviceCopier):
    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], host_buffer: torch.Tensor):
        if not host_buffer.is_pinned():
            raise ValueError("the CUDA copier needs a pinned host buffer")
        self._layout = layout
        self._device = tensors[0].device
        self._views = segment_views(layout, tensors)
        self._host_slots = host_buffer.view(-1, layout.slot_bytes)
        self._stream_pool: list[torch.cuda.Stream] = []
        self._event_pool: list[torch.cuda.Event] = []
        self._in_flight: list[_InFlight] = []
        self._lock = threading.Lock()  # start() may run on I/O threads while poll_done() runs on the engine's

    def job_bytes(self, job: TransferJob) -> int:
        return len(job.block_ids) * sum(s.nbytes for s in self._layout.segments_of(job.tensor_indices))

    def start(self, job: TransferJob, on_done: Callable[[TransferResult], None]) -> None:
        with self._lock:
            stream = self._stream_pool.pop() if self._stream_pool else torch.cuda.Stream(self._device)
            event = self._event_pool.pop() if self._event_pool else torch.cuda.Event()
        try:
            if job.to_host:
                # The model writes KV on the compute stream: copy only after it is done.
                stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(stream):
                ids = torch.from_numpy(np.asarray(job.block_ids, dtype=np.int64)).to(self._device)
                staging = torch.empty((len(job.block_ids), self._layout.slot_bytes), dtype=torch.uint8,
                                      device=self._device)
                runs = consecutive_runs(np.asarray(job.slot_ids, dtype=np.int64))
                if job.tensor_indices is not None:  # one layer: only its segments of each slot move
                    self._copy_layer(job, ids, staging)
                elif job.to_host:
                    for seg, view in zip(self._layout.segments, self._views):
                        staging[:, seg.slot_offset: seg.slot_offset + seg.nbytes].copy_(view.index_select(0, ids))
                    for position, first_slot, count in runs:
                        self._host_slots[first_slot: first_slot + count].copy_(
                            staging[position: position + count], non_blocking=True)
                else:
                    for position, first_slot, count in runs:
                        staging[position: position + count].copy_(
                            self._host_slots[first_slot: first_slot + count], non_blocking=True)
                    for seg, view in zip(self._layout.segments, self._views):
                        view.index_copy_(0, ids, staging[:, seg.slot_offset: seg.slot_offset + seg.nbytes])
                # Completion marker: the job is done when every copy above is.
                event.record(stream)
        except BaseException:
            with self._lock:  # nothing of this job is in flight: return both now
                self._stream_pool.append(stream)
                self._event_pool.append(event)
            raise
        with self._lock:
            self._in_flight.append(_InFlight(job, stream, event, staging, time.perf_counter(), self.job_bytes(job)))

    def _copy_layer(self, job: TransferJob, ids: torch.Tensor, staging: torch.Tensor) -> None:
        segments = [(seg, view) for seg, view in zip(self._layout.segments, self._views)
                    if seg.tensor_index in set(job.tensor_indices)]
        slot_ids = [int(s) for s in job.slot_ids]
        for seg, view in segments:
            columns = slice(seg.slot_offset, seg.slot_offset + seg.nbytes)
            if job.to_host:
                staging[:, columns].copy_(view.index_select(0, ids))
                for position, slot in enumerate(slot_ids):  # a layer's part of a slot is one contiguous run
                    self._host_slots[slot, columns].copy_(staging[position, columns], non_blocking=True)
            else:
                for position, slot in enumerate(slot_ids):
                    staging[position, columns].copy_(self._host_slots[slot, columns], non_blocking=True)
                view.index_copy_(0, ids, staging[:, columns])

    def poll_done(self) -> list[TransferResult]:
        finished, still = [], []
        with self._lock:
            for record in self._in_flight:
                if record.event.query():
                    finished.append(TransferResult(record.job.job_id, True, record.num_bytes,
                                                   time.perf_counter() - record.began))
                    self._stream_pool.append(record.stream)  # the event says the stream's work is done
                    self._event_pool.append(record.event)
                else:
                    still.append(record)
            self._in_flight = still
        return finished

    def close(self) -> None:
        with self._lock:
            pending = list(self._in_flight)
        for record in pending:
            record.event.synchronize()
        self.poll_done()
