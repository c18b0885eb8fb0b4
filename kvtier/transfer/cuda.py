"""CUDA device: pooled streams and events, pinned host memory, coalesced DMA.

Each job gets streams from a pool, so a long queue of jobs never fills one
stream's queue (vLLM #29013), and ``start`` never waits on the host: block ids go
to the device from pinned memory, asynchronously. Before a job touches the KV
cache its streams wait for the compute stream: a store so that it copies the KV
the model wrote, not what was there before (vLLM #31341); a load so that it does
not overwrite blocks that queued compute still reads. After a load, the compute
stream reads the blocks only once the load's event says so
(``order_compute_after``), or the caller has seen the job finish in ``poll_done``.

A whole-slot job gathers its blocks on the device into a staging buffer laid out
like host slots (one launch for every segment, ``cuda_kernels``), in chunks of at
most ``staging_bytes / 2`` that alternate between two streams, so that one
chunk's gather overlaps the other's DMA. Each run of consecutive slot ids of a
chunk moves in one DMA, and a chunk's runs go to the driver in one batch. A
layer-wise job moves its layer's part of each run of slots in one 2-D DMA
(``cudaMemcpy2DAsync``). Streams, events and buffers go back to their pool
(``LanePool``) on every path, failures included.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from kvtier.common.layout import KVLayout
from kvtier.transfer.cuda_kernels import load_block_mover
from kvtier.transfer.cuda_runtime import load_cuda_runtime
from kvtier.transfer.engine import DeviceCopier, TransferJob, TransferResult

STAGING_BYTES = 64 << 20  # per job, both lanes' buffers: bounds the device memory a copy borrows


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
        # Strided over the tensor's storage, not a flattened copy: vLLM 0.33+ hands views of one
        # allocation (a layer's blocks a stride of all layers apart, or heads outside blocks), which
        # ``reshape`` would copy.
        data = tensors[seg.tensor_index].view(torch.uint8)
        views.append(data.as_strided((layout.num_blocks, seg.nbytes), (seg.stride, 1),
                                     data.storage_offset() + seg.offset))
    return views


def checked_ids(job: TransferJob, num_blocks: int, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """A job's block and slot ids as arrays, checked on the host before anything is queued: an id
    out of range on the device is a device-side assert, which poisons the whole CUDA context, the
    engine's too."""
    block_ids, slot_ids = np.array(job.block_ids, np.int64), np.asarray(job.slot_ids, np.int64)
    if block_ids.ndim != 1 or block_ids.shape != slot_ids.shape:
        raise ValueError("block_ids and slot_ids must be 1-D and of the same length")
    if block_ids.size and (block_ids.min() < 0 or block_ids.max() >= num_blocks):
        raise ValueError(f"block id out of range [0, {num_blocks})")
    if slot_ids.size and (slot_ids.min() < 0 or slot_ids.max() >= num_slots):
        raise ValueError(f"slot id out of range [0, {num_slots})")
    return block_ids, slot_ids


@dataclass
class _Lanes:
    """What one job borrows from the pools: per lane a stream, an event and a staging buffer."""

    streams: list[torch.cuda.Stream]
    events: list[torch.cuda.Event]  # events[0] completes when the whole job has
    buffers: list[torch.Tensor]  # flat uint8, ``lane_bytes`` each
    host_ids: torch.Tensor | None = None  # pinned int64: the job's block ids, uploaded asynchronously
    device_ids: torch.Tensor | None = None


class LanePool:
    """Streams, events, staging buffers and id buffers, lent to one job at a time.

    A job's lanes come back only when its completion event has been seen on the host
    (or, for a job that failed to launch, after its streams were synchronised), so
    whatever a later job does with them, on any stream, comes after every copy of
    the earlier one. Thread-safe: jobs start on I/O threads too.
    """

    def __init__(self, device: torch.device, lane_bytes: int):
        self._device, self._lane_bytes = device, lane_bytes
        self._streams: list[torch.cuda.Stream] = []
        self._events: list[torch.cuda.Event] = []
        self._buffers: list[torch.Tensor] = []
        self._ids: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pinned, device) id buffers
        self.num_streams_made = self.num_events_made = self.num_buffers_made = 0
        self._lock = threading.Lock()

    def take(self, num_lanes: int) -> _Lanes:
        lanes = _Lanes([], [], [])
        with self._lock:
            for _ in range(num_lanes):
                lanes.streams.append(self._streams.pop() if self._streams else None)
                lanes.events.append(self._events.pop() if self._events else None)
                lanes.buffers.append(self._buffers.pop() if self._buffers else None)
            if self._ids:  # one pair a job: only lane 0 uploads
                lanes.host_ids, lanes.device_ids = self._ids.pop()
        made = [0, 0, 0]
        for lane in range(num_lanes):  # made outside the lock
            if lanes.streams[lane] is None:
                lanes.streams[lane], made[0] = torch.cuda.Stream(self._device), made[0] + 1
            if lanes.events[lane] is None:
                lanes.events[lane], made[1] = torch.cuda.Event(), made[1] + 1
            if lanes.buffers[lane] is None:
                lanes.buffers[lane] = torch.empty(self._lane_bytes, dtype=torch.uint8, device=self._device)
                made[2] += 1
        if any(made):
            with self._lock:
                self.num_streams_made += made[0]
                self.num_events_made += made[1]
                self.num_buffers_made += made[2]
        return lanes

    def give_back(self, lanes: _Lanes) -> None:
        with self._lock:
            self._streams.extend(lanes.streams)
            self._events.extend(lanes.events)
            self._buffers.extend(lanes.buffers)
            if lanes.host_ids is not None:
                self._ids.append((lanes.host_ids, lanes.device_ids))

    def idle(self) -> tuple[int, int, int]:
        """(streams, events, buffers) in the pool now."""
        with self._lock:
            return len(self._streams), len(self._events), len(self._buffers)

    def made(self) -> tuple[int, int, int]:
        return self.num_streams_made, self.num_events_made, self.num_buffers_made


@dataclass
class _InFlight:
    job: TransferJob
    lanes: _Lanes  # back to the pools when events[0] says no copy uses them any more
    keep_alive: tuple  # ids (and a layer job's own staging): alive until then too
    began: float
    num_bytes: int


class CudaCopier(DeviceCopier):
    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], host_buffer: torch.Tensor,
                 staging_bytes: int = STAGING_BYTES, runtime="auto", block_mover="auto", warm_up: bool = True):
        if not host_buffer.is_pinned():
            raise ValueError("the CUDA copier needs a pinned host buffer")
        self._layout = layout
        self._device = tensors[0].device
        self._tensors = list(tensors)  # copies use their memory: keep it alive
        self._views = segment_views(layout, tensors)
        self._host_buffer = host_buffer
        self._host_slots = host_buffer.view(-1, layout.slot_bytes)
        self._num_slots = self._host_slots.shape[0]
        self._runtime = load_cuda_runtime() if runtime == "auto" else runtime
        self._block_mover = load_block_mover() if block_mover == "auto" else block_mover
        self._movers: dict = {}  # tensor_indices -> (segments with staging columns, mover)
        # The stream the model computes on: the current stream of the thread that builds
        # the copier (vLLM's, in register_kv_caches). Jobs also wait for their caller's.
        self._compute_stream = torch.cuda.current_stream(self._device)
        self._rows_per_chunk = max(1, staging_bytes // 2 // layout.slot_bytes)
        self._lane_bytes = self._rows_per_chunk * layout.slot_bytes
        self.lane_pool = LanePool(self._device, self._lane_bytes)  # no allocation in a step
        self._job_bytes: dict = {}
        self._in_flight: list[_InFlight] = []
        self._lock = threading.Lock()  # start() may run on I/O threads while poll_done() runs on the engine's
        if warm_up:  # only while the host pool is empty and idle: it writes slot 0
            self._warm_up()

    def _warm_up(self) -> None:
        """Pay every first-use cost now, at start-up, not in a step: the movers' compilation
        (block 0 gathered and written back unchanged, whole and per layer), and one store
        and one load of block 0 through slot 0 on each path, which sets up the pooled lanes
        and the runtime. The host pool must still be empty: slot 0 is overwritten."""
        if self._block_mover is not None:
            ids = torch.zeros(1, dtype=torch.int64, device=self._device)
            for tensor_indices in (None, *((i,) for i in range(len(self._tensors)))):
                members, mover = self._mover(tensor_indices)
                width = sum(seg.nbytes for seg, _, _ in members)
                scratch = torch.empty((1, width), dtype=torch.uint8, device=self._device)
                mover(ids, scratch, to_staging=True)
                mover(ids, scratch, to_staging=False)
        zero = np.zeros(1, np.int64)
        for tensor_indices in (None, (0,)):
            for to_host in (True, False):  # the load writes back what the store just read
                self.start(TransferJob(zero, zero, to_host, -1, tensor_indices), on_done=None)
                torch.cuda.synchronize(self._device)
                self.poll_done()

    def job_bytes(self, job: TransferJob) -> int:
        per_block = self._job_bytes.get(job.tensor_indices)
        if per_block is None:
            per_block = self._job_bytes.setdefault(
                job.tensor_indices, sum(s.nbytes for s in self._layout.segments_of(job.tensor_indices)))
        return len(job.block_ids) * per_block

    def _upload_ids(self, lanes: _Lanes, block_ids: np.ndarray) -> torch.Tensor:
        """The block ids on the device, from the lanes' pinned buffer: an asynchronous copy
        (a pageable one may hold the host), on the current stream (lane 0's)."""
        if lanes.host_ids is None or lanes.host_ids.numel() < block_ids.size:
            capacity = max(block_ids.size, 1024)
            lanes.host_ids = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            lanes.device_ids = torch.empty(capacity, dtype=torch.int64, device=self._device)
        host_ids = lanes.host_ids[:block_ids.size]
        host_ids.numpy()[:] = block_ids  # the pinned buffer is the job's alone until its event completes
        device_ids = lanes.device_ids[:block_ids.size]
        device_ids.copy_(host_ids, non_blocking=True)
        return device_ids

    def _mover(self, tensor_indices: tuple[int, ...] | None) -> tuple[list[tuple[object, torch.Tensor, int]], object]:
        """(segment, view, staging column) of a job's segments, and their one-launch mover
        (None without Triton). A whole-slot job's staging row is a slot; a layer job's is
        its segments one after the other, in slot order."""
        cached = self._movers.get(tensor_indices)
        if cached is None:
            members, column = [], 0
            for seg, view in zip(self._layout.segments, self._views):
                if tensor_indices is None or seg.tensor_index in tensor_indices:
                    members.append((seg, view, seg.slot_offset if tensor_indices is None else column))
                    column += seg.nbytes
            mover = None
            if self._block_mover is not None and members:
                rows = np.array([(self._tensors[seg.tensor_index].data_ptr() + seg.offset, seg.stride, at, seg.nbytes)
                                 for seg, _, at in members], dtype=np.int64)
                row_bytes = self._layout.slot_bytes if tensor_indices is None else column
                mover = self._block_mover(rows, row_bytes, self._device)
            cached = self._movers.setdefault(tensor_indices, (members, mover))
        return cached

    def _gather(self, tensor_indices, device_ids: torch.Tensor, staging: torch.Tensor, to_staging: bool) -> None:
        """KV cache blocks <-> staging rows: one launch with Triton, else one op per segment."""
        members, mover = self._mover(tensor_indices)
        if mover is not None:
            mover(device_ids, staging, to_staging)
            return
        for seg, view, at in members:
            if to_staging:
                staging[:, at: at + seg.nbytes].copy_(view.index_select(0, device_ids))
            else:
                view.index_copy_(0, device_ids, staging[:, at: at + seg.nbytes])

    def start(self, job: TransferJob, on_done: Callable[[TransferResult], None]) -> None:
        block_ids, slot_ids = checked_ids(job, self._layout.num_blocks, self._num_slots)
        num_lanes = 2 if job.tensor_indices is None and block_ids.size > self._rows_per_chunk else 1
        lanes = self.lane_pool.take(num_lanes)
        streams, events = lanes.streams, lanes.events
        try:
            with torch.cuda.device(self._device), torch.cuda.stream(streams[0]):
                # From pinned memory, before the wait below: the host never waits for compute.
                device_ids = self._upload_ids(lanes, block_ids)
                # The KV cache is written and read on the compute stream: copy only after the
                # work queued there so far (the store's KV written; the load's targets read).
                streams[0].wait_stream(self._compute_stream)
                caller = torch.cuda.current_stream(self._device)
                if caller != self._compute_stream:
                    streams[0].wait_stream(caller)
                for other in streams[1:]:
                    other.wait_stream(streams[0])  # after the compute stream and the id upload
                if job.tensor_indices is None:
                    own_staging = self._copy_slots(lanes, device_ids, slot_ids, job.to_host)  # None: lanes' own
                else:
                    own_staging = self._copy_layer(lanes, device_ids, slot_ids, job.to_host, job.tensor_indices)
                for other, event in zip(streams[1:], events[1:]):
                    event.record(other)
                    streams[0].wait_event(event)  # the job's end waits for the second lane's copies
                events[0].record(streams[0])  # completion marker: the job is done when every copy above is
        except BaseException:
            for stream in streams:
                stream.synchronize()  # nothing of a failed job may still write a slot once it is reported
            self.lane_pool.give_back(lanes)
            raise
        with self._lock:
            self._in_flight.append(_InFlight(job, lanes, (block_ids, device_ids, own_staging),
                                             time.perf_counter(), self.job_bytes(job)))

    def _copy_slots(self, lanes: _Lanes, device_ids: torch.Tensor, slot_ids: np.ndarray, to_host: bool) -> None:
        """Whole slots, chunk by chunk; chunk k on lane k % 2 with that lane's staging buffer,
        so that one lane's gather overlaps the other's DMA."""
        rows, num_lanes = self._rows_per_chunk, len(lanes.streams)
        for lane, (stream, buffer) in enumerate(zip(lanes.streams, lanes.buffers)):
            staging = buffer.view(rows, self._layout.slot_bytes)
            # A lane's chunks run in order on its stream, so reusing its buffer is safe; the
            # two lanes' streams run side by side.
            with torch.cuda.stream(stream):
                for first in range(lane * rows, slot_ids.size, num_lanes * rows):
                    last = min(first + rows, slot_ids.size)
                    ids, part = device_ids[first:last], staging[:last - first]
                    runs = consecutive_runs(slot_ids[first:last])
                    if to_host:
                        self._gather(None, ids, part, to_staging=True)
                        self._move_runs(part, runs, to_host, stream.cuda_stream)
                    else:
                        self._move_runs(part, runs, to_host, stream.cuda_stream)
                        self._gather(None, ids, part, to_staging=False)

    def _move_runs(self, part: torch.Tensor, runs: list[tuple[int, int, int]], to_host: bool, stream: int) -> None:
        """staging rows <-> host slots, one DMA per run of consecutive slots, on ``stream``
        (the current stream too)."""
        if self._runtime is None:
            for position, first_slot, count in runs:
                host, device = self._host_slots[first_slot: first_slot + count], part[position: position + count]
                (host.copy_(device, non_blocking=True) if to_host else device.copy_(host, non_blocking=True))
            return
        slot_bytes = self._layout.slot_bytes
        host_base, device_base = self._host_buffer.data_ptr(), part.data_ptr()
        if len(runs) > 1 and self._runtime.can_batch:  # scattered slots: one call for all runs
            positions, first_slots, counts = (np.array(column, np.int64) for column in zip(*runs))
            hosts, devices = host_base + first_slots * slot_bytes, device_base + positions * slot_bytes
            dsts, srcs = (hosts, devices) if to_host else (devices, hosts)
            self._runtime.memcpy_batch(dsts, srcs, counts * slot_bytes, stream)
            return
        for position, first_slot, count in runs:
            host, device = host_base + first_slot * slot_bytes, device_base + position * slot_bytes
            self._runtime.memcpy(host, device, count * slot_bytes, stream) if to_host else \
                self._runtime.memcpy(device, host, count * slot_bytes, stream)

    def _copy_layer(self, lanes: _Lanes, device_ids: torch.Tensor, slot_ids: np.ndarray, to_host: bool,
                    tensor_indices: tuple[int, ...]) -> torch.Tensor | None:
        """Some tensors (one layer): each tensor's part of a slot is one contiguous range of
        columns, so a run of consecutive slots is one strided (2-D) host region per tensor.
        Returns a staging buffer of its own where the lane's is too small (kept alive)."""
        members, _ = self._mover(tensor_indices)
        width = sum(seg.nbytes for seg, _, _ in members)
        own = None
        if slot_ids.size * width <= self._lane_bytes:
            staging = lanes.buffers[0][:slot_ids.size * width].view(slot_ids.size, width)
        else:
            staging = own = torch.empty((slot_ids.size, width), dtype=torch.uint8, device=self._device)
        runs = consecutive_runs(slot_ids)
        groups: dict[int, list[tuple[int, int, int]]] = {}  # tensor -> (staging column, slot offset, bytes)
        for seg, _, at in members:
            groups.setdefault(seg.tensor_index, []).append((at, seg.slot_offset, seg.nbytes))
        if to_host:
            self._gather(tensor_indices, device_ids, staging, to_staging=True)
        for parts in groups.values():
            self._move_columns(staging, parts[0][0], parts[0][1], sum(n for _, _, n in parts), runs, to_host)
        if not to_host:
            self._gather(tensor_indices, device_ids, staging, to_staging=False)
        return own

    def _move_columns(self, staging: torch.Tensor, column: int, host_column: int, nbytes: int,
                      runs: list[tuple[int, int, int]], to_host: bool) -> None:
        """staging[:, column:+nbytes] <-> host_slots[slot, host_column:+nbytes] for every run."""
        if self._runtime is None:  # no runtime found: one DMA per slot
            for position, first_slot, count in runs:
                for i in range(count):
                    host = self._host_slots[first_slot + i, host_column: host_column + nbytes]
                    device = staging[position + i, column: column + nbytes]
                    (host.copy_(device, non_blocking=True) if to_host else device.copy_(host, non_blocking=True))
            return
        slot_bytes, row_bytes = self._layout.slot_bytes, staging.shape[1]
        stream = torch.cuda.current_stream(self._device).cuda_stream  # the lane's: start made it current
        for position, first_slot, count in runs:
            host = self._host_buffer.data_ptr() + first_slot * slot_bytes + host_column
            device = staging.data_ptr() + position * row_bytes + column
            dst, dst_pitch, src, src_pitch = ((host, slot_bytes, device, row_bytes) if to_host
                                              else (device, row_bytes, host, slot_bytes))
            self._runtime.memcpy_2d(dst, dst_pitch, src, src_pitch, nbytes, count, stream)

    def order_compute_after(self, job_ids) -> bool:
        """Make the caller's current stream wait for these jobs' copies, without waiting on
        the host: what it queues next (the next layer's attention) reads the loaded blocks."""
        compute = torch.cuda.current_stream(self._device)
        wanted = set(job_ids)
        with self._lock:  # held: poll_done cannot hand an event back to the pool while we wait on it
            for record in self._in_flight:
                if record.job.job_id in wanted:
                    compute.wait_event(record.lanes.events[0])
        return True

    def poll_done(self) -> list[TransferResult]:
        finished, still = [], []
        with self._lock:
            for record in self._in_flight:
                if record.lanes.events[0].query():
                    finished.append(TransferResult(record.job.job_id, True, record.num_bytes,
                                                   time.perf_counter() - record.began))
                    self.lane_pool.give_back(record.lanes)  # the event says every lane's work is done
                else:
                    still.append(record)
            self._in_flight = still
        return finished

    def close(self) -> None:
        with self._lock:
            pending = list(self._in_flight)
        for record in pending:
            record.lanes.events[0].synchronize()
        self.poll_done()
