"""``kvtier bench layerwise``: how much of the transfer time hides behind compute.

A synthetic model of ``num_layers`` layers runs on one thread; each layer's compute
(a matrix product, calibrated to at least 1.5 x the layer's transfer time) writes
that layer's KV for the step's blocks. The last layer's store has no compute after
it to hide behind (nor the first layer's load any before it), so at most
(layers - 1) / layers of a transfer can be hidden. Measured in the same run:
- compute alone, transfers alone (one layer at a time), and both together with
  layer-wise stores (layer i's store submitted as its compute ends) and layer-wise
  loads (all submitted first; layer i awaited just before its compute);
- ``overlap_fraction`` = (compute + transfer - together) / transfer, for stores
  (and ``load_overlap_fraction`` for loads), the median over rounds, each round
  taking kvtier's and the peer's stores and loads in a new random order, each
  against compute-alone runs just before and after it: 1.0 means the transfer is
  fully hidden;
- the same, with a plain thread copying the same bytes (runs planned beforehand,
  nothing around the memcpy): ``raw_overlap_fraction`` and
  ``raw_load_overlap_fraction``, what this machine allows, since a copy and the
  compute share memory bandwidth and caches;
- that stored and loaded bytes are exact (the blocks are zeroed before each load).
Then, on a generated model with a pool, a producer's time to first token with
layer-wise stores and with whole-request stores.
"""

from __future__ import annotations

import itertools
import json
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvtier._native import copy_runs
from kvtier.common.config import KVTierConfig
from kvtier.common.keys import Namespace
from kvtier.scheduler.manager import TierManager
from kvtier.worker import TierWorker


def _compute(weight: torch.Tensor, x: torch.Tensor, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """One synthetic layer: a matrix product, then this layer's KV written from its result."""
    y = torch.tanh(x @ weight)
    kv.index_fill_(0, block_ids, float(y[0, 0]))
    return y


def _drain(worker: TierWorker, manager: TierManager, count: int) -> list:
    reports = []
    while len(reports) < count:
        reports += worker.poll()
    manager.on_reports(reports)
    return reports


class _RawCopier:
    """The peer: one plain thread that copies precomputed runs, layer by layer, as told.

    The same bytes as kvtier's transfers, with nothing around the memcpy: what this
    machine allows when a copy runs beside the compute (memory bandwidth and caches
    are shared, so even this is not fully hidden).
    """

    def __init__(self, runs_of_layer: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
        self.runs = runs_of_layer
        self.todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.done = [threading.Event() for _ in runs_of_layer]
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (layer := self.todo.get()) is not None:
            copy_runs.copy(*self.runs[layer])
            self.done[layer].set()

    def reset(self) -> None:
        for event in self.done:
            event.clear()

    def close(self) -> None:
        self.todo.put(None)
        self.thread.join()


class _Rounds:
    """kvtier's layer-wise stores and loads and the peer's copies, each alone and beside the
    synthetic model's compute, one round at a time."""

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_size: int):
        self.num_layers, self.num_blocks = num_layers, num_blocks
        device_blocks = num_blocks * 2
        self.tensors = [torch.zeros((device_blocks, kv_heads, block_size, 2 * head_size), dtype=torch.bfloat16)
                        for _ in range(num_layers)]
        config = KVTierConfig.from_sources({"host_bytes": num_blocks * 4 * self.tensors[0][0].nbytes * num_layers,
                                            "disk_dir": None, "copy_threads": 1}, environ={})
        namespace = Namespace("bench-layerwise", "bfloat16", "kv", (kv_heads, head_size), num_layers, block_size)
        self.worker = TierWorker(config, self.tensors, device_blocks, block_size, namespace)
        self.manager = TierManager(config, self.worker.layout.slot_bytes, [self.worker.rank_fingerprint])
        self.block_ids = torch.arange(0, device_blocks, 2)[:num_blocks]  # scattered: every other block
        self.layer_bytes = num_blocks * self.tensors[0][0].nbytes
        self.x, self.weights = self._calibrate()
        self.results: dict[str, list[float]] = {
            name: [] for name in ("compute", "store", "store_overlapped", "load", "load_overlapped", "raw_store",
                                  "raw_store_overlapped", "raw_load", "raw_load_overlapped")}
        self.baselines: dict[str, list[float]] = {}  # compute alone, around each measurement with compute
        self.exact = True
        self.stored_keys: list[bytes] = []  # the last kvtier store's keys, and the bytes it read
        self.stored_bytes: list[torch.Tensor] = []
        self.store_count = itertools.count()
        # The peer's own slots, alive as long as its copier.
        self.peer_buffer = peer_buffer = torch.empty(num_blocks * self.worker.layout.slot_bytes, dtype=torch.uint8)

        def runs(to_host: bool) -> list:
            addresses = [t.data_ptr() for t in self.tensors]
            return [self.worker.layout.copy_runs(addresses, peer_buffer.data_ptr(), self.block_ids.numpy(),
                                                 np.arange(num_blocks, dtype=np.int64), to_host, (layer,))
                    for layer in range(num_layers)]

        self.raw_store, self.raw_load = _RawCopier(runs(True)), _RawCopier(runs(False))

    def _calibrate(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One layer's transfer time (warm: the first round pays one-time costs), then a compute of
        about 1.5 x that per layer: the input and each layer's weights."""
        per_layer_transfer = float("inf")
        for probe_round in range(3):
            probe = self.manager.plan_store("probe", [b"probe" + bytes([probe_round]) + i.to_bytes(10, "little")
                                                      for i in range(self.num_blocks)], self.block_ids.tolist())
            began = time.perf_counter()
            for layer in range(self.num_layers):
                self.worker.submit_store_layer(probe, layer)
            self.worker.wait_for_device_reads([probe.job_id])
            per_layer_transfer = min(per_layer_transfer, (time.perf_counter() - began) / self.num_layers)
            _drain(self.worker, self.manager, 1)
        x = torch.randn(64, 64)
        for size in range(64, 4097, 32):
            weight, x = torch.randn(size, size), torch.randn(size, size)
            _compute(weight, x, self.tensors[0], self.block_ids)  # warm-up
            began = time.perf_counter()
            for _ in range(3):
                _compute(weight, x, self.tensors[0], self.block_ids)
            if (time.perf_counter() - began) / 3 >= 1.5 * per_layer_transfer:
                break
        return x, [torch.randn(size, size) / size ** 0.5 for _ in range(self.num_layers)]

    def compute_all(self, after_layer=None, before_layer=None) -> None:
        h = self.x
        for layer in range(self.num_layers):
            if before_layer:
                before_layer(layer)
            h = _compute(self.weights[layer], h, self.tensors[layer], self.block_ids)
            if after_layer:
                after_layer(layer)

    def compute_alone(self) -> float:
        began = time.perf_counter()
        self.compute_all()
        return time.perf_counter() - began

    def around(self, name: str, measure) -> None:
        """Time ``measure`` with compute-alone runs just before and after it: this shared
        machine's speed drifts, and the overlap is only as good as its compute baseline."""
        before = self.compute_alone()
        self.results[name].append(measure())
        self.results["compute"].append(before)
        self.baselines.setdefault(name, []).append((before + self.compute_alone()) / 2)

    def raw(self, copier: _RawCopier, overlapped: bool, load: bool) -> float:
        copier.reset()
        began = time.perf_counter()
        if load:  # every layer asked for first; each awaited just before its compute
            for layer in range(self.num_layers):
                copier.todo.put(layer)
            if overlapped:
                self.compute_all(before_layer=lambda layer: copier.done[layer].wait())
        elif overlapped:
            self.compute_all(after_layer=copier.todo.put)
        else:
            for layer in range(self.num_layers):
                copier.todo.put(layer)
        copier.done[-1].wait()
        return time.perf_counter() - began

    def kvtier_store(self) -> None:
        worker, manager, blocks = self.worker, self.manager, self.block_ids.tolist()
        first = next(self.store_count) * 10_000  # new keys each time: a load may store first, in any round
        keys = [(first + i).to_bytes(16, "little") for i in range(self.num_blocks)]
        job = manager.plan_store("s", keys, blocks)
        began = time.perf_counter()
        for layer in range(self.num_layers):
            worker.submit_store_layer(job, layer)
        worker.wait_for_device_reads([job.job_id])
        self.results["store"].append(time.perf_counter() - began)
        _drain(worker, manager, 1)

        overlapped = manager.plan_store("s", [k + b"o" for k in keys], blocks)

        def store_overlapped() -> float:
            began = time.perf_counter()
            worker.prepare_store_layers(overlapped)  # as the connector does when the step begins
            self.compute_all(after_layer=lambda layer: worker.submit_store_layer(overlapped, layer))
            worker.wait_for_device_reads([overlapped.job_id])
            return time.perf_counter() - began

        self.around("store_overlapped", store_overlapped)
        _drain(worker, manager, 1)
        self.stored_keys[:] = [k + b"o" for k in keys]
        self.stored_bytes[:] = [t[self.block_ids].clone() for t in self.tensors]

    def kvtier_load(self) -> None:
        if not self.stored_keys:
            self.kvtier_store()
        worker, manager, blocks = self.worker, self.manager, self.block_ids.tolist()
        for tensor in self.tensors:  # so that only the load can put these bytes back
            tensor[self.block_ids] = 0
        load = manager.plan_load("l", self.stored_keys, blocks, in_step=True)
        began = time.perf_counter()
        worker.submit_load_in_step(load, per_layer=True)
        for layer in range(self.num_layers):
            worker.wait_for_layer([load.job_id], layer)
        self.results["load"].append(time.perf_counter() - began)
        _drain(worker, manager, 1)
        self.exact &= all(torch.equal(t[self.block_ids].view(torch.int16), e.view(torch.int16))
                          for t, e in zip(self.tensors, self.stored_bytes))

        load = manager.plan_load("l", self.stored_keys, blocks, in_step=True)

        def load_overlapped() -> float:
            began = time.perf_counter()
            worker.submit_load_in_step(load, per_layer=True)
            self.compute_all(before_layer=lambda layer: worker.wait_for_layer([load.job_id], layer))
            return time.perf_counter() - began

        self.around("load_overlapped", load_overlapped)
        _drain(worker, manager, 1)
        self.stored_keys.clear()  # the compute wrote over the loaded blocks: the next load stores first

    def raw_store_round(self) -> None:
        self.results["raw_store"].append(self.raw(self.raw_store, False, False))
        self.around("raw_store_overlapped", lambda: self.raw(self.raw_store, True, False))

    def raw_load_round(self) -> None:
        self.results["raw_load"].append(self.raw(self.raw_load, False, True))
        self.around("raw_load_overlapped", lambda: self.raw(self.raw_load, True, True))

    def close(self) -> None:
        self.raw_store.close()
        self.raw_load.close()
        self.worker.close()

    def overlap(self, transfer: str, together: str) -> float:
        per_round = [(c + t - both) / t for c, t, both in
                     zip(self.baselines[together], self.results[transfer], self.results[together])]
        return float(np.clip(np.median(per_round), 0.0, 1.0))


def run(num_layers: int = 16, num_blocks: int = 128, kv_heads: int = 4, block_size: int = 32, head_size: int = 128,
        repeats: int = 45) -> dict:
    torch.set_num_threads(1)  # compute on one core, copies on the other
    rounds = _Rounds(num_layers, num_blocks, kv_heads, block_size, head_size)
    # Each round takes the four measurements in a new order: what runs just before one
    # (caches, the machine's drift) must not favour kvtier or its peer.
    order = random.Random(0)
    steps = [rounds.kvtier_store, rounds.kvtier_load, rounds.raw_store_round, rounds.raw_load_round]
    for _ in range(repeats):
        for step in order.sample(steps, len(steps)):
            step()
    rounds.close()
    best = {name: float(np.median(times)) for name, times in rounds.results.items()}
    return {
        "num_layers": num_layers, "layer_bytes": rounds.layer_bytes,
        "per_layer_compute_ms": best["compute"] / num_layers * 1000,
        "per_layer_store_ms": best["store"] / num_layers * 1000,
        "per_layer_load_ms": best["load"] / num_layers * 1000,
        "compute_s": best["compute"], "store_s": best["store"], "store_overlapped_s": best["store_overlapped"],
        "load_s": best["load"], "load_overlapped_s": best["load_overlapped"],
        "overlap_fraction": rounds.overlap("store", "store_overlapped"),
        "load_overlap_fraction": rounds.overlap("load", "load_overlapped"),
        "raw_store_s": best["raw_store"], "raw_load_s": best["raw_load"],
        "raw_overlap_fraction": rounds.overlap("raw_store", "raw_store_overlapped"),
        "raw_load_overlap_fraction": rounds.overlap("raw_load", "raw_load_overlapped"),
        "exact": bool(rounds.exact),
    }


def producer_ttft(workdir: Path, quick: bool) -> dict:
    from kvtier.cli.demo.model import make_model
    from kvtier.cli.servers import local_mooncake

    size = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2) if quick else \
        dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4)
    model = str(make_model(workdir / f"model-{size['num_layers']}x{size['hidden_size']}", **size))
    rng = random.Random(5)
    result = {}
    with local_mooncake(storage="4GB") as server:
        for mode in ("layerwise", "whole"):
            tokens = [rng.randrange(3, 2000) for _ in range(1000 if quick else 4000)]
            spec = {"model": model, "connector": "kvtier", "engine": {"max_model_len": 8192, "role": "kv_producer"},
                    "extra": {"remote_url": server.url, "disk_dir": None, "host_bytes": "1GiB",
                              "layerwise": mode == "layerwise"},
                    "phases": [{"prompts": [tokens], "max_tokens": 1}]}
            spec_path, out_path = workdir / f"producer-{mode}.spec.json", workdir / f"producer-{mode}.out.json"
            spec_path.write_text(json.dumps(spec))
            with open(workdir / f"producer-{mode}.log", "w") as log:
                subprocess.run([sys.executable, "-m", "kvtier.cli.demo.runner", str(spec_path), str(out_path)],
                               stdout=log, stderr=subprocess.STDOUT, check=True)
            result[f"producer_ttft_{mode}_s"] = json.loads(out_path.read_text())["phases"][0]["ttft_s"][0]
    return result


def main(args) -> dict:
    result = run(num_layers=4 if args.quick else 16, num_blocks=32 if args.quick else 128)
    if not args.no_engine:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        result.update(producer_ttft(workdir, args.quick))
    if not args.json:
        from kvtier.cli.bench.report import print_table
        rows = [("per-layer compute / store / load", f"{result['per_layer_compute_ms']:.2f} / "
                 f"{result['per_layer_store_ms']:.2f} / {result['per_layer_load_ms']:.2f} ms"),
                ("stores: compute + transfer, separately vs together",
                 f"{result['compute_s'] + result['store_s']:.3f} s vs {result['store_overlapped_s']:.3f} s"),
                ("store overlap_fraction (plain copy thread)",
                 f"{result['overlap_fraction']:.2f} ({result['raw_overlap_fraction']:.2f})"),
                ("loads: compute + transfer, separately vs together",
                 f"{result['compute_s'] + result['load_s']:.3f} s vs {result['load_overlapped_s']:.3f} s"),
                ("load overlap_fraction (plain copy thread)",
                 f"{result['load_overlap_fraction']:.2f} ({result['raw_load_overlap_fraction']:.2f})"),
                ("stored and loaded bytes exact", str(result["exact"]))]
        if "producer_ttft_layerwise_s" in result:
            rows += [("producer TTFT, layer-wise stores", f"{result['producer_ttft_layerwise_s']:.3f} s"),
                     ("producer TTFT, whole-request stores", f"{result['producer_ttft_whole_s']:.3f} s")]
        print_table(f"kvtier bench layerwise ({result['num_layers']} layers, "
                     f"{result['layer_bytes'] / 2**20:.0f} MiB per layer)", rows)
    return result
