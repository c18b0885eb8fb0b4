"""``kvtier bench broadcast``: sharded, pipelined broadcast vs one unsharded broadcast.

Two processes on torch.distributed (gloo), as two tensor-parallel ranks with
replicated KV (an MLA-sized cache: 61 layers of 32 x 576 bf16 per block). Rank 0
holds one prompt's blocks in host slots; both modes deliver them into rank 1's
KV cache, checked byte for byte. Reported: the bytes of one shard, the peak bytes
of receive buffers alive at once on rank 1 in each mode, and the seconds of each
(best of ``repeats``).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvtier.common.layout import detect_layout
from kvtier.transfer.broadcast import ShardedBroadcaster
from kvtier.worker import tensor_info


def _rank(rank: int, init_file: str, num_blocks: int, layers: int, shard_blocks: int, repeats: int, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    tensors = [torch.zeros((num_blocks, 32, 576), dtype=torch.bfloat16) for _ in range(layers)]
    layout = detect_layout([tensor_info(t) for t in tensors], num_blocks, 32)
    block_ids = list(range(num_blocks))
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, (num_blocks, layout.slot_bytes), dtype=np.uint8) if rank == 0 else None
    available = np.ones(num_blocks, dtype=bool) if rank == 0 else None
    group = dist.new_group([0, 1], backend="gloo")
    out = {}
    for mode, shard in (("sharded", shard_blocks), ("unsharded", num_blocks)):
        broadcaster = ShardedBroadcaster(layout, tensors, group, shard)
        times, peaks = [], []
        for _ in range(repeats):
            dist.barrier(group)
            result = broadcaster.load(block_ids, source, block_ids if rank == 0 else None, available)
            assert result.ok
            times.append(result.seconds)
            peaks.append(result.peak_buffer_bytes)
        if rank == 1:  # what arrived is exactly what rank 0 holds
            expected = np.random.default_rng(0).integers(0, 256, (num_blocks, layout.slot_bytes), dtype=np.uint8)
            got = np.concatenate([t.view(torch.uint8).reshape(num_blocks, -1).numpy() for t in tensors], axis=1)
            out[f"exact_{mode}"] = bool(np.array_equal(got, expected))
            for t in tensors:
                t.zero_()
        out[f"seconds_{mode}"] = min(times)
        out[f"peak_bytes_{mode}"] = max(peaks)
    out["shard_bytes"] = shard_blocks * layout.slot_bytes
    results[rank] = out
    dist.destroy_process_group()


def run(num_blocks: int = 125, layers: int = 61, shard_blocks: int = 16, repeats: int = 3) -> dict:
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "init"), num_blocks, layers, shard_blocks, repeats, results),
                 nprocs=2, join=True)
    receiver = dict(results[1])
    receiver["blocks"] = num_blocks
    receiver["peak_vs_shard"] = receiver["peak_bytes_sharded"] / receiver["shard_bytes"]
    receiver["time_vs_unsharded"] = receiver["seconds_sharded"] / receiver["seconds_unsharded"]
    return receiver


def main(args) -> dict:
    result = run(num_blocks=32 if args.quick else 125, layers=8 if args.quick else 61,
                 shard_blocks=args.shard_blocks)
    if not args.json:
        from kvtier.cli.bench.report import print_table
        print_table(f"kvtier bench broadcast ({result['blocks']} blocks, 2 ranks, gloo)", [
            ("shard bytes", f"{result['shard_bytes'] / 2**20:.1f} MiB"),
            ("peak receive bytes, sharded (x shard)",
             f"{result['peak_bytes_sharded'] / 2**20:.1f} MiB ({result['peak_vs_shard']:.2f}x)"),
            ("peak receive bytes, unsharded", f"{result['peak_bytes_unsharded'] / 2**20:.1f} MiB"),
            ("seconds, sharded / unsharded (ratio)",
             f"{result['seconds_sharded']:.3f} / {result['seconds_unsharded']:.3f} ({result['time_vs_unsharded']:.2f}x)"),
            ("bytes exact, sharded / unsharded", f"{result['exact_sharded']} / {result['exact_unsharded']}"),
        ])
    return result
