"""``kvtier bench transfer``: host pool and disk tier throughput against plain copies.

Offload and load move scattered blocks of a vLLM-CPU-layout KV cache through the
transfer engine, as a CPU worker's: an offload takes each slot's checksum as it
copies, and so does a load, to compare with the checksums the slots' entries hold
(compared after the clock); the peer is one plain ``copy_`` of the same number of
bytes between two preallocated buffers. Disk write/read go through the disk tier's
real path: jobs of ``BLOCKS_PER_JOB`` blocks to kvtier's I/O process (two in flight,
as a worker with several requests has), which frames each entry with its offload's
checksum and writes it atomically, and checks each entry it reads but its checksum,
which it answers for the load's copy to compare (compared here after the clock); the
peer is one plain sequential file written and read in 4 MiB chunks.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np
import torch

from kvtier.cli.bench.io_path import IOPath
from kvtier.common.entry import HEADER_BYTES
from kvtier.common.host_slots import HostSlots
from kvtier.common.keys import block_keys
from kvtier.common.layout import detect_layout
from kvtier.tiers.base import TierSpec
from kvtier.tiers.disk import entries_file
from kvtier.transfer.cpu import CpuCopier
from kvtier.transfer.engine import TransferEngine, TransferJob
from kvtier.transfer.host_buffer import allocate_host_buffer
from kvtier.worker import tensor_info


BLOCKS_PER_JOB = 64  # a store or load job of a 2,048-token prompt in 32-token blocks


def _best(times: list[float]) -> float:
    return min(times)


def run(gib: float = 1.0, num_layers: int = 12, block_size: int = 32, kv_width: int = 512, repeats: int = 3,
        copy_threads: int = 2, disk_dir: str | None = None, io_threads: int = 2, progress=None) -> dict:
    layer_block_bytes = 2 * block_size * kv_width * 2
    slot_bytes = layer_block_bytes * num_layers
    num_moved = max(1, int(gib * (1 << 30)) // slot_bytes)
    num_device_blocks = int(num_moved * 1.5)
    rng = np.random.default_rng(0)
    tensors = [torch.empty((num_device_blocks, 2, block_size, kv_width), dtype=torch.bfloat16)
               for _ in range(num_layers)]
    for tensor in tensors:
        tensor.view(torch.int16).random_()  # random bytes, every page touched
    layout = detect_layout([tensor_info(t) for t in tensors], num_device_blocks, block_size)
    slots = HostSlots(num_moved, slot_bytes, HEADER_BYTES)  # laid out as a CPU worker's host pool
    host = allocate_host_buffer(1, slots.num_bytes, pin=False)
    # As a CPU worker's: an offload takes each slot's checksum as it copies (``CpuCopier``).
    engine = TransferEngine(CpuCopier(layout, tensors, host, copy_threads, slots.head_bytes, checksums=True))
    block_ids = rng.choice(num_device_blocks, size=num_moved, replace=False)  # scattered
    slot_ids = rng.permutation(num_moved)
    moved_bytes = num_moved * slot_bytes

    sums = np.zeros(num_moved, np.uint64)  # by slot: what the offload's checksums say of each

    def timed(to_host: bool) -> float:
        began = time.perf_counter()
        job_id = engine.submit(TransferJob(block_ids, slot_ids, to_host, checked=not to_host))
        engine.wait([job_id])
        elapsed = time.perf_counter() - began
        (result,) = engine.poll()
        assert result.success and result.job_id == job_id, result
        if to_host:
            sums[slot_ids] = result.checksums
        else:  # what a load compares with its entries' checksums
            assert np.array_equal(result.checksums, sums[slot_ids]), "a load hashed other bytes than were offloaded"
        return elapsed

    source = torch.empty(moved_bytes, dtype=torch.uint8)
    source.random_()
    target = torch.zeros(moved_bytes, dtype=torch.uint8)

    def memcpy(target: torch.Tensor, source: torch.Tensor) -> float:
        began = time.perf_counter()
        target.copy_(source)
        return time.perf_counter() - began

    offload, load, plain = [], [], []
    for _ in range(repeats):
        plain.append(memcpy(target, source))
        offload.append(timed(True))
        load.append(timed(False))
        if progress:
            progress()
    # The round trip must be exact: load what was offloaded into other blocks and compare.
    check_ids = block_ids[:8]
    expected = [t.view(torch.int16)[check_ids].clone() for t in tensors]  # raw bits: random bf16 holds NaNs
    for t in tensors:
        t[check_ids] = 0
    engine.wait([engine.submit(TransferJob(check_ids, slot_ids[:8], False))])
    engine.poll()
    assert all(torch.equal(t.view(torch.int16)[check_ids], e) for t, e in zip(tensors, expected)), "round trip differs"
    engine.close()

    results = {
        "bytes": moved_bytes,
        "blocks": num_moved,
        "slot_bytes": slot_bytes,
        "offload_gbps": moved_bytes / _best(offload) / 1e9,
        "load_gbps": moved_bytes / _best(load) / 1e9,
        "memcpy_gbps": moved_bytes / _best(plain) / 1e9,
    }
    results["offload_vs_memcpy"] = results["offload_gbps"] / results["memcpy_gbps"]
    results["load_vs_memcpy"] = results["load_gbps"] / results["memcpy_gbps"]
    del source, target

    offloaded = allocate_host_buffer(num_moved, slot_bytes, pin=False).numpy().reshape(num_moved, slot_bytes)
    offloaded[:] = slots.views(host.numpy())[0]  # back to back, as the plain file's bytes lie
    results.update(_disk(offloaded, sums.tolist(), disk_dir, io_threads, repeats, progress))
    results["hash_tokens_per_s"] = _hash_rate(block_size)
    return results


def _disk(slots: np.ndarray, checksums: list[int], disk_dir: str | None, io_threads: int, repeats: int,
          progress) -> dict:
    """kvtier's disk tier on its real path (jobs to its I/O process, which frames each entry with
    the checksum its offload took and writes it atomically) beside one plain file of the same bytes."""
    total = slots.nbytes
    keys = [i.to_bytes(16, "little") for i in range(len(slots))]
    with tempfile.TemporaryDirectory(dir=disk_dir, prefix="kvtier-bench-") as root:
        path = IOPath(TierSpec("disk", "kvtier.tiers.disk", os.path.join(root, "tier"), threads=io_threads),
                      len(slots), slots.shape[1])
        path.slots[:] = slots
        plain_path = os.path.join(root, "plain.bin")
        chunk = 4 << 20
        flat = slots.reshape(-1)

        def plain_write() -> float:
            began = time.perf_counter()
            with open(plain_path, "wb") as file:
                for offset in range(0, total, chunk):
                    file.write(memoryview(flat[offset: offset + chunk]))
            return time.perf_counter() - began

        def plain_read() -> float:
            began = time.perf_counter()
            with open(plain_path, "rb") as file:
                view = memoryview(flat)
                for offset in range(0, total, chunk):
                    file.readinto(view[offset: offset + chunk])
            return time.perf_counter() - began

        writes, reads, file_writes, file_reads = [], [], [], []
        tier_root = os.path.join(root, "tier")
        for round_ in range(repeats + 2):  # page-cache writeback makes single runs noisy: best of more
            # Both sides start each write with no dirty pages and into no allocated blocks, and drop
            # what they wrote after reading it: neither pays for the other's or earlier rounds' writeback.
            os.sync()
            file_writes.append(plain_write())
            file_reads.append(plain_read())
            os.unlink(plain_path)
            round_keys = [key[:-1] + bytes([round_]) for key in keys]  # new entries each round
            os.sync()
            writes.append(path.run(True, round_keys, BLOCKS_PER_JOB, checksums=checksums))
            path.slots[:] = 0
            reads.append(path.run(False, round_keys, BLOCKS_PER_JOB, check_in_copy=True))
            assert path.answered_sums == checksums, "the disk tier answered other checksums than it wrote"
            os.truncate(entries_file(tier_root, path.fingerprint), 0)  # as the plain file is deleted
            if progress:
                progress()
        assert np.array_equal(path.slots, slots), "the disk tier read back other bytes than it wrote"
        path.close()
    out = {
        "disk_write_gbps": total / _best(writes) / 1e9,
        "disk_read_gbps": total / _best(reads) / 1e9,
        "file_write_gbps": total / _best(file_writes) / 1e9,
        "file_read_gbps": total / _best(file_reads) / 1e9,
    }
    out["disk_write_vs_file"] = out["disk_write_gbps"] / out["file_write_gbps"]
    out["disk_read_vs_file"] = out["disk_read_gbps"] / out["file_read_gbps"]
    return out


def _hash_rate(block_size: int, num_tokens: int = 1 << 20) -> float:
    tokens = np.random.default_rng(1).integers(0, 128_000, size=num_tokens)
    fingerprint = b"\x01" * 16
    times = []
    for _ in range(3):
        began = time.perf_counter()
        block_keys(fingerprint, tokens, block_size)
        times.append(time.perf_counter() - began)
    return num_tokens / statistics.median(times)
