"""The scheduler-side manager and the worker together, as an engine drives them."""

import dataclasses
import os
import random
import resource
import threading
import time

import pytest
import torch

from kvtier.common.config import KVTierConfig
from kvtier.common.entry import HEADER_BYTES
from kvtier.common.keys import Namespace
from kvtier.scheduler.manager import TierManager
from kvtier.tiers.disk import entries_file
from kvtier.worker import TierWorker

NB, BS = 48, 4
NAMESPACE = Namespace("test-model", "mixed", "kv", (1,), 3, BS)


def layouts():
    """(name, tensors) for every supported layout, with odd byte sizes."""
    return [
        ("blocks_first", [torch.zeros(NB, 4, BS, 2 * 24, dtype=torch.bfloat16) for _ in range(3)]),
        ("kv_first", [torch.zeros(2, NB, BS, 3, 5, dtype=torch.float16) for _ in range(2)]),
        ("mla", [torch.zeros(NB, BS, 9, dtype=torch.float32) for _ in range(2)]),
        ("cross_layer", [torch.zeros(NB, 3, 2, BS, 7, dtype=torch.bfloat16)]),  # named explicitly
    ] + [(f"vllm_{name}", vllm_layer_views(name, 3, heads=2, head_size=6)) for name in VLLM_LAYOUTS]


# vLLM 0.33+'s KV cache layouts: where each of [layer, block, head, token, content] lies in memory.
VLLM_LAYOUTS = {"LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4), "BLHNC": (1, 0, 2, 3, 4),
                "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def vllm_layer_views(layout: str, num_layers: int, heads: int, head_size: int, num_blocks: int = NB,
                     dtype=torch.bfloat16, device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer ``[num_blocks, heads, block_size, 2 * head_size]`` views of one allocation in
    ``layout``'s physical order, as vLLM 0.33+'s ``allocate_kv_cache`` hands them to a connector."""
    logical = (num_layers, num_blocks, heads, BS, 2 * head_size)
    order = VLLM_LAYOUTS[layout]
    physical = torch.zeros([logical[d] for d in order], dtype=dtype, device=device)
    views = physical.permute([order.index(d) for d in range(5)])
    return [views[layer] for layer in range(num_layers)]


class Engine:
    """Drives a TierManager and a TierWorker the way the vLLM connector does."""

    def __init__(self, tensors, disk_dir, host_blocks=16, disk_blocks=64, kind=None, track_holdings=False, **config):
        # The probe's pool is the size of the KV cache's storage: at least a block, and far from 1 GiB.
        whole_cache = sum(t.untyped_storage().nbytes() for t in tensors)
        probe = TierWorker(KVTierConfig.from_sources({"disk_dir": None, "host_bytes": whole_cache}, environ={}),
                           tensors, NB, BS, NAMESPACE, layout_kind=kind)
        slot_bytes, rank_fingerprint = probe.layout.slot_bytes, probe.rank_fingerprint
        probe.close()
        self.config = KVTierConfig.from_sources({
            "host_bytes": host_blocks * slot_bytes, **({} if "tiers" in config else {"disk_dir": disk_dir}),
            "disk_bytes": disk_blocks * (slot_bytes + HEADER_BYTES), **config}, environ={})
        self.tensors = tensors
        self.manager = TierManager(self.config, slot_bytes, [rank_fingerprint], track_holdings=track_holdings)
        self.worker = TierWorker(self.config, tensors, NB, BS, NAMESPACE, layout_kind=kind)

    def run(self, jobs, submit, expect=None):
        """Submit ``jobs``, then step until ``expect`` (default: that many) reports came back."""
        for job in jobs:
            submit(job)
        reports = []
        deadline = time.monotonic() + 30
        while len(reports) < (len(jobs) if expect is None else expect):
            assert time.monotonic() < deadline, "jobs did not finish"
            reports += self.worker.poll()
            self.manager.on_released(self.worker.released_slots())
            time.sleep(0.0005)
        self.manager.on_reports(reports)
        return reports

    def store(self, keys, block_ids):
        job = self.manager.plan_store("r", keys, block_ids)
        return self.run([job], self.worker.submit_store) if job else []

    def load(self, keys, block_ids):
        job = self.manager.plan_load("r", keys, block_ids)
        return job, self.run([job], self.worker.submit_load)[0]

    def close(self):
        self.worker.close()
        self.manager.close()


def keys_of(ids):
    return [i.to_bytes(16, "little") for i in ids]


def randomize(tensors):
    for t in tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))


@pytest.fixture(params=["4MiB", "one block"])
def chunks(request, monkeypatch):
    """A load's reads in chunks of the default size, or of one block each (many chunks per load,
    each copied to the device as it arrives)."""
    if request.param == "one block":
        monkeypatch.setattr("kvtier.tiers.base.JOB_BYTES", 1)
    return request.param


@pytest.mark.parametrize("name, tensors", layouts())
def test_cache_host_disk_host_cache_round_trip_is_byte_exact(name, tensors, disk_dir, chunks):
    engine = Engine(tensors, disk_dir, host_blocks=6, kind="cross_layer" if name == "cross_layer" else None)
    randomize(tensors)
    blocks = [1, 2, 3, 17, 30, 31]
    original = [t.clone() for t in tensors]
    engine.store(keys_of(range(6)), blocks)  # written through to disk
    engine.store(keys_of(range(100, 106)), [40, 41, 42, 43, 44, 45])  # evicts all of the first store from host
    assert engine.manager.host.lookup(keys_of([0])) == 0 and all(engine.manager.tier('disk').lookup(keys_of(range(6))))
    for t in tensors:
        t.zero_()
    job, report = engine.load(keys_of(range(6)), [5, 6, 7, 8, 9, 10])  # disk -> host -> other device blocks
    assert report.success and len(job.fill_block_ids) == 6
    for source, target in zip(blocks, [5, 6, 7, 8, 9, 10]):
        for t, o in zip(tensors, original):
            assert torch.equal(_block(t, target, name).view(torch.uint8), _block(o, source, name).view(torch.uint8))
    assert engine.manager.host.num_pins == 0
    engine.close()


def _block(tensor, block_id, name):
    return tensor[:, block_id] if name == "kv_first" else tensor[block_id]


def test_corrupt_disk_entry_fails_only_its_block_and_is_forgotten(disk_dir):
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=3)
    randomize(tensors)
    engine.store(keys_of(range(2)), [1, 2])
    engine.store(keys_of(range(2, 3)), [3])
    engine.store(keys_of(range(10, 12)), [4, 5])  # push the first blocks out of host
    path = entries_file(disk_dir, engine.worker.rank_fingerprint)
    offset = engine.manager.tier("disk")._location(keys_of([1])[0]) * (HEADER_BYTES + engine.worker.layout.slot_bytes)
    data = bytearray(path.read_bytes())
    data[offset + HEADER_BYTES + 3] ^= 1
    path.write_bytes(bytes(data))
    job, report = engine.load(keys_of(range(3)), [20, 21, 22])
    assert report.failed_block_ids == [21] and report.bad_keys == keys_of([1])
    assert engine.manager.stats.bad_entries == 1
    assert engine.manager.tier('disk').lookup(keys_of([1])) == [False]
    assert engine.manager.miss_reason(keys_of([1])[0]) == "damaged"  # why a later lookup misses it
    assert engine.manager.host.num_pins == 0
    engine.close()


def test_verify_mode_checks_loaded_bytes(disk_dir):
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, verify_loads=True)
    randomize(tensors)
    engine.store(keys_of(range(4)), [1, 2, 3, 4])
    _, report = engine.load(keys_of(range(4)), [10, 11, 12, 13])
    assert report.success and engine.worker.num_verify_failures == 0
    engine.close()


def test_a_restart_serves_from_disk(disk_dir):
    tensors = layouts()[0][1]
    randomize(tensors)
    first = Engine(tensors, disk_dir)
    first.store(keys_of(range(5)), [1, 2, 3, 4, 5])
    first.close()
    expected = [t[1:6].clone() for t in tensors]
    fresh = [torch.zeros_like(t) for t in tensors]
    second = Engine(fresh, disk_dir)
    assert second.manager.lookup(keys_of(range(6))) == 5
    _, report = second.load(keys_of(range(5)), [30, 31, 32, 33, 34])
    assert report.success
    assert all(torch.equal(f[30:35].view(torch.int16), e.view(torch.int16)) for f, e in zip(fresh, expected))
    second.close()


def reopened_with_eight_blocks_on_disk(disk_dir) -> Engine:
    """A new engine over empty tensors, whose disk tier holds the 8 blocks that another stored (keys 0..7)."""
    tensors = layouts()[0][1]
    randomize(tensors)
    first = Engine(tensors, disk_dir)
    first.store(keys_of(range(8)), list(range(1, 9)))
    first.close()
    return Engine([torch.zeros_like(t) for t in tensors], disk_dir)


def test_an_idle_engine_step_waits_for_a_load_instead_of_stepping_again(disk_dir):
    """``wait_for_a_load`` (a vLLM step that computes nothing) returns when a load finishes, not at its
    bound, and at once when no load is in flight or one has finished but is not taken yet."""
    second = reopened_with_eight_blocks_on_disk(disk_dir)
    began = time.monotonic()
    second.worker.wait_for_a_load(10.0)
    assert time.monotonic() - began < 5.0, "waited with no load in flight"
    job = second.manager.plan_load("r", keys_of(range(8)), list(range(20, 28)))
    assert job is not None and job.fill_keys, "the load reads disk"
    second.worker.submit_load(job)
    began = time.monotonic()
    reports = []
    while not reports:
        second.worker.wait_for_a_load(10.0)
        reports = second.worker.poll()
    assert time.monotonic() - began < 5.0, "waited for the bound, not for the load"
    assert second.worker.num_idle_waits >= 1
    assert reports[0].success and not reports[0].failed_block_ids
    second.manager.on_reports(reports)
    job = second.manager.plan_load("r", keys_of(range(8)), list(range(30, 38)))  # from host slots now
    second.worker.submit_load(job)
    while not second.worker.book.has_finished:
        time.sleep(0.001)
    began = time.monotonic()
    second.worker.wait_for_a_load(10.0)
    assert time.monotonic() - began < 5.0, "waited although a job had finished"
    assert second.worker.poll()[0].success
    second.close()


def test_an_idle_step_waits_for_a_load_whose_copy_is_over_until_its_report_is_in(disk_dir):
    """Between a load's last copy and its report (on the thread that saw the copy end), the load is
    still in flight for ``wait_for_a_load``: an idle step that returned there would step again at
    once, a busy loop holding the GIL that the reporting thread needs to finish the report."""
    second = reopened_with_eight_blocks_on_disk(disk_dir)
    reporting, go_on = threading.Event(), threading.Event()
    report_load = second.worker.loads.copied

    def paused_report(load, result):  # the copy is over; the report waits for the test
        reporting.set()
        go_on.wait(10)
        report_load(load, result)

    second.worker.loads.copied = paused_report
    second.worker.submit_load(second.manager.plan_load("r", keys_of(range(8)), list(range(20, 28))))
    assert reporting.wait(10), "the load's copy never ended"
    ended = []
    idle_step = threading.Thread(target=lambda: (second.worker.wait_for_a_load(30.0), ended.append(time.monotonic())))
    idle_step.start()
    idle_step.join(0.3)
    assert idle_step.is_alive(), "an idle step returned while the load's report was still to come"
    released = time.monotonic()
    go_on.set()
    idle_step.join(30)
    assert ended and ended[0] - released < 5.0, "the report did not end the idle step's wait (its bound did)"
    reports = second.worker.poll()
    assert len(reports) == 1 and reports[0].success
    second.manager.on_reports(reports)
    del second.worker.loads.copied  # the stand-in holds the load path that holds it
    second.close()


def test_concurrent_jobs_with_random_aborts_release_every_pin(disk_dir, chunks):
    """Many requests store and load at once; some are abandoned midway by the engine.

    An abort never cancels a job in flight (its blocks stay held until it reports),
    so afterwards every pin must be back to zero and the counters at rest.
    """
    tensors = layouts()[0][1]
    randomize(tensors)
    run_with_random_aborts(Engine(tensors, disk_dir, host_blocks=12, disk_blocks=40))


def run_with_random_aborts(engine, rounds=30, seed=0):
    """Rounds of stores and loads; in some the engine takes no reports (the requests were aborted);
    then every pin and counter must come back to rest. Closes ``engine``."""
    rng = random.Random(seed)
    pending_reports = 0
    for round_ in range(rounds):
        for _ in range(rng.randint(1, 6)):
            prefix = rng.randint(0, 6)
            keys = keys_of(range(prefix * 10, prefix * 10 + rng.randint(1, 4)))
            blocks = rng.sample(range(NB), len(keys))
            if rng.random() < 0.5 and engine.manager.lookup(keys) == len(keys):
                engine.worker.submit_load(engine.manager.plan_load("r", keys, blocks))
            else:
                job = engine.manager.plan_store("r", keys, blocks)
                if job is None:
                    continue
                engine.worker.submit_store(job)
            pending_reports += 1
        if rng.random() < 0.3:
            continue  # "aborted" round: its jobs complete in a later poll
        for report in engine.worker.poll():
            pending_reports -= 1
            engine.manager.on_reports([report])
    deadline = time.monotonic() + 30
    while pending_reports:
        assert time.monotonic() < deadline
        for report in engine.worker.poll():
            pending_reports -= 1
            engine.manager.on_reports([report])
    assert engine.manager.num_pending == 0 and engine.worker.num_jobs_in_flight == 0
    assert engine.manager.host.num_pins == 0 and engine.manager.tier('disk').num_pins == 0
    assert engine.manager.host.num_used <= engine.manager.host.num_slots
    engine.close()


def test_a_disk_hit_being_rewritten_to_host_is_not_loaded_twice(disk_dir):
    """A key on disk that another request is storing into host again is no hit:
    it cannot take a second host slot, and its slot is not readable yet."""
    tensors = layouts()[0][1]
    randomize(tensors)
    engine = Engine(tensors, disk_dir, host_blocks=2)
    engine.store(keys_of([1]), [1])
    engine.store(keys_of([2, 3]), [2, 3])  # key 1 is now on disk only
    in_flight = engine.manager.plan_store("other", keys_of([1]), [9])  # being written to host again
    assert engine.manager.lookup(keys_of([1])) == 0
    job = engine.manager.plan_load("r", keys_of([1]), [20])
    assert job.missing_block_ids == [20] and not job.fill_block_ids
    engine.run([in_flight], engine.worker.submit_store)
    _, report = engine.load(keys_of([1]), [21])
    assert report.success
    engine.run([job], engine.worker.submit_load)  # the all-missing job still reports, and releases nothing it lacks
    assert engine.manager.host.num_pins == 0 and engine.manager.num_pending == 0
    engine.close()


@pytest.mark.parametrize("planned_first", [True, False])
def test_layerwise_loads_and_stores_are_exact_layer_by_layer(disk_dir, planned_first):
    tensors = layouts()[0][1]
    randomize(tensors)
    engine = Engine(tensors, disk_dir, host_blocks=8)
    original = [t.clone() for t in tensors]
    job = engine.manager.plan_store("r", keys_of(range(4)), [1, 2, 3, 4])
    if planned_first:  # as the connector does when the step begins; else the first layer plans
        engine.worker.prepare_store_layers(job)
    for layer in reversed(range(engine.worker.num_layers)):  # layers may be stored in any order
        engine.worker.submit_store_layer(job, layer)
    reports = []
    while not reports:
        reports = engine.worker.poll()
    engine.manager.on_reports(reports)
    assert reports[0].success and engine.manager.host.lookup(keys_of(range(4))) == 4
    for t in tensors:
        t.zero_()
    load = engine.manager.plan_load("r", keys_of(range(4)), [10, 11, 12, 13], in_step=True)
    engine.worker.submit_load_in_step(load, per_layer=True)
    for layer, tensor in enumerate(tensors):
        assert engine.worker.wait_for_layer([load.job_id], layer, timeout=10)
        # This layer is in place now, whatever the others are doing.
        assert torch.equal(tensor[10:14].view(torch.int16), original[layer][1:5].view(torch.int16))
    reports = []
    while not reports:
        reports = engine.worker.poll()
    engine.manager.on_reports(reports)
    assert reports[0].success and engine.manager.host.num_pins == 0
    engine.close()


@pytest.mark.parametrize("name, tensors", layouts())
def test_a_host_hit_copied_within_the_step_in_one_copy_is_exact_in_every_layout(disk_dir, name, tensors):
    """Without layer hooks, a load within the step copies every layer at once, on the engine's thread
    where the device allows: waiting for any layer waits for it."""
    randomize(tensors)
    engine = Engine(tensors, disk_dir, host_blocks=8, kind="cross_layer" if name == "cross_layer" else None)
    original = [t.clone() for t in tensors]
    engine.run([engine.manager.plan_store("r", keys_of(range(3)), [1, 2, 3])], engine.worker.submit_store)
    for t in tensors:
        t.zero_()
    load = engine.manager.plan_load("r", keys_of(range(3)), [10, 11, 12], in_step=True)
    engine.worker.submit_load_in_step(load, per_layer=False)
    assert engine.worker.wait_for_layer([load.job_id], 0, timeout=10)
    for tensor, before in zip(tensors, original):
        for source, target in zip([1, 2, 3], [10, 11, 12]):
            assert torch.equal(_block(tensor, target, name).view(torch.uint8), _block(before, source, name).view(torch.uint8))
    reports = engine.run([], None, expect=1)
    assert reports[0].success and engine.manager.host.num_pins == 0
    engine.close()


def test_only_a_small_hit_held_whole_in_the_host_pool_loads_within_the_step(disk_dir):
    tensors = layouts()[0][1]
    probe = Engine(tensors, disk_dir, host_blocks=2)
    slot_bytes = probe.manager.slot_bytes
    probe.close()
    engine = Engine(tensors, disk_dir, host_blocks=2, in_step_load_bytes=2 * slot_bytes)
    engine.run([engine.manager.plan_store("r", keys_of([1, 2]), [1, 2])], engine.worker.submit_store)
    assert engine.manager.can_load_in_step(keys_of([1, 2]), None)
    engine.run([engine.manager.plan_store("r", keys_of([3]), [3])], engine.worker.submit_store)  # evicts key 1 to disk
    assert engine.manager.host.lookup(keys_of([1])) == 0 and engine.manager.lookup(keys_of([1])) == 1
    assert not engine.manager.can_load_in_step(keys_of([1]), None)  # a disk hit: the step would wait for its read
    assert engine.manager.can_load_in_step(keys_of([2, 3]), None)
    engine.config = dataclasses.replace(engine.config, in_step_load_bytes=slot_bytes)
    engine.manager.config = engine.config
    assert not engine.manager.can_load_in_step(keys_of([2, 3]), None)  # larger than in_step_load_bytes
    assert engine.manager.can_load_in_step(keys_of([2]), None)
    engine.close()


def test_a_host_hit_whose_pins_need_more_than_one_wave_is_not_loaded_within_the_step(disk_dir):
    """Slots that other lookups were promised leave a hit's pins for waves: beside the steps it loads
    whole, within a step its blocks past the first wave would be recomputed."""
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=3)
    engine.run([engine.manager.plan_store("r", keys_of([1, 2]), [1, 2])], engine.worker.submit_store)
    assert engine.manager.lookup(keys_of([1, 2]), token="other") == 2  # promised 2 of the 3 slots
    assert engine.manager.lookup(keys_of([1, 2]), token="t") == 2
    assert not engine.manager.can_load_in_step(keys_of([1, 2]), "t")  # one slot left: two waves
    engine.manager.drop_lookup("other")
    assert engine.manager.lookup(keys_of([1, 2]), token="t") == 2
    assert engine.manager.can_load_in_step(keys_of([1, 2]), "t")
    engine.close()


def test_a_layerwise_store_sends_each_layer_once_and_the_rest_at_the_end(disk_dir):
    """As the connector does: the layers whose attention ran are sent one by one (a repeat
    is ignored), then wait_for_save's submit_store sends only the layers still missing."""
    tensors = layouts()[0][1]
    randomize(tensors)
    engine = Engine(tensors, disk_dir, host_blocks=8)
    original = [t[5:8].clone() for t in tensors]
    job = engine.manager.plan_store("r", keys_of(range(3)), [5, 6, 7])
    engine.worker.prepare_store_layers(job)
    engine.worker.submit_store_layer(job, 0)
    engine.worker.submit_store_layer(job, 0)
    engine.worker.submit_store(job)
    assert engine.worker.wait_for_device_reads([job.job_id], timeout=10)
    reports = []
    while not reports:
        reports = engine.worker.poll()
    engine.manager.on_reports(reports)
    assert len(reports) == 1 and reports[0].success
    assert reports[0].num_bytes == 3 * engine.worker.layout.slot_bytes  # every layer once, no layer twice
    assert engine.worker.poll() == [] and engine.worker.num_jobs_in_flight == 0
    assert not engine.worker.book.store_transfers([job.job_id])  # no transfer made and never sent
    for t in tensors:
        t.zero_()
    _, report = engine.load(keys_of(range(3)), [1, 2, 3])
    assert report.success and all(torch.equal(t[1:4].view(torch.int16), o.view(torch.int16))
                                  for t, o in zip(tensors, original))
    engine.close()


def test_a_layerwise_load_never_reads_disk(disk_dir):
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=1)
    engine.store(keys_of([1]), [1])
    engine.store(keys_of([2]), [2])  # key 1 now only on disk
    job = engine.manager.plan_load("r", keys_of([1]), [5], in_step=True)
    assert job.missing_block_ids == [5] and not job.fill_keys
    engine.run([job], lambda job: engine.worker.submit_load_in_step(job, per_layer=True))
    engine.close()


def test_two_lookups_do_not_count_on_the_same_staging_slots(disk_dir):
    """Disk hits need host slots to stage through; a lookup's slots are not promised twice."""
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=2)
    for ids in ([1, 2], [3, 4], [5, 6]):  # 1-4 end up on disk only; 5, 6 fill the host pool
        engine.store(keys_of(ids), ids)
    assert engine.manager.lookup(keys_of([1, 2]), token="a") == 2  # counts on both evictable slots
    assert engine.manager.lookup(keys_of([3, 4]), token="b") is None  # nothing left to stage through: ask again
    job = engine.manager.plan_load("a", keys_of([1, 2]), [10, 11])
    assert not job.missing_block_ids  # what "a" was promised, it got
    engine.run([job], engine.worker.submit_load)
    engine.manager.forget("b")
    assert engine.manager.lookup(keys_of([3, 4]), token="b") == 2  # a's load is done: slots are evictable again
    engine.close()


def test_an_unexpected_error_on_an_io_thread_still_ends_the_job(disk_dir):
    """A fill or write that raises something unforeseen is a failed outcome: the job
    reports, its blocks are recomputed and its pins are released (never held forever)."""
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=2)
    engine.store(keys_of([1, 2]), [1, 2])
    engine.store(keys_of([3, 4]), [3, 4])  # 1 and 2 now only on disk

    # Real faults under the I/O process: its file cut to nothing (every read comes up short),
    # and a file-size limit of 0 bytes on the process (every write fails with EFBIG).
    os.truncate(entries_file(disk_dir, engine.worker.rank_fingerprint), 0)
    resource.prlimit(engine.worker.io.pid, resource.RLIMIT_FSIZE, (0, 0))
    job, report = engine.load(keys_of([1, 2]), [10, 11])
    assert sorted(report.failed_block_ids) == [10, 11]
    reports = engine.store(keys_of([5]), [5])
    assert reports and reports[0].failed_writes == {"disk": keys_of([5])}
    assert engine.manager.host.num_pins == 0 and engine.manager.tier('disk').num_pins == 0
    assert engine.manager.num_pending == 0
    engine.close()


def test_a_layerwise_store_done_before_wait_for_save_is_not_stored_again(disk_dir):
    """Every layer sent after its attention: the job may finish on kvtier's own threads before
    the engine's wait_for_save submits it whole; that submit must copy and report nothing."""
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=8)
    job = engine.manager.plan_store("r", keys_of(range(3)), [5, 6, 7])
    engine.worker.prepare_store_layers(job)
    for layer in range(engine.worker.num_layers):
        engine.worker.submit_store_layer(job, layer)
    reports = []
    deadline = time.monotonic() + 10
    while not reports and time.monotonic() < deadline:
        reports = engine.worker.poll()  # reported before wait_for_save
    engine.manager.on_reports(reports)
    assert len(reports) == 1 and reports[0].success
    engine.worker.prepare_store_layers(job)  # the next step's start_load_kv, as the connector calls it
    engine.worker.submit_store(job)  # wait_for_save
    time.sleep(0.3)
    assert engine.worker.poll() == [] and engine.worker.num_jobs_in_flight == 0
    assert engine.manager.num_pending == 0 and engine.manager.host.num_pins == 0
    engine.close()


def test_the_holdings_log_tells_what_each_tier_gained_and_lost(disk_dir):
    """What KV events are made of: a store is loadable from host and disk once reported; host
    evictions, a disk eviction and a corrupt entry dropped are removals, each once."""
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=4, disk_blocks=6, track_holdings=True)
    engine.store(keys_of([1, 2, 3, 4]), [1, 2, 3, 4])
    assert sorted(engine.manager.ledger.take_holdings()) == sorted(
        [("stored", "host", k) for k in keys_of([1, 2, 3, 4])] + [("stored", "disk", k) for k in keys_of([1, 2, 3, 4])])
    assert engine.manager.ledger.take_holdings() == []  # drained
    engine.store(keys_of([5, 6, 7]), [5, 6, 7])  # host: 1, 2, 3 evicted; disk: 1 evicted (6 places)
    taken = engine.manager.ledger.take_holdings()
    assert sorted(k for kind, tier, k in taken if (kind, tier) == ("evicted", "host")) == keys_of([1, 2, 3])
    assert [k for kind, tier, k in taken if (kind, tier) == ("evicted", "disk")] == keys_of([1])
    assert sorted(k for kind, tier, k in taken if kind == "stored") == sorted(keys_of([5, 6, 7]) * 2)
    # Without KV events the log is still drained at every report: it never grows.
    quiet = Engine(tensors, disk_dir + "-quiet", host_blocks=2, disk_blocks=4)
    for i in range(20):
        quiet.store(keys_of([100 + i]), [1])
    assert quiet.manager.ledger.holdings == [] and quiet.manager.ledger.take_holdings() == []
    quiet.close()
    # Why a later lookup misses them: 1 is on no tier any more (the disk evicted it last).
    assert engine.manager.miss_reason(keys_of([1])[0]) == "evicted_disk"
    assert engine.manager.miss_reason(keys_of([99])[0]) == "never_stored"
    engine.close()


def test_the_optional_features_wrap_the_paths_and_nothing_else():
    """Off: the worker runs the plain paths. verify_loads outermost, around the replicated paths of
    save_only_first_rank; ranks other than 0 key their blocks as rank 0's and read no tier."""
    from kvtier.worker.loads import LoadPath
    from kvtier.worker.stores import StorePath
    from kvtier.worker.wrappers import Wrapping

    plain = Wrapping.of(KVTierConfig.from_sources({"disk_dir": None}, environ={}), 3, object())
    assert (plain.load_path, plain.store_path, plain.key_rank, plain.reads_tiers) == (LoadPath, StorePath, 3, True)
    both = KVTierConfig.from_sources({"disk_dir": None, "verify_loads": True, "save_only_first_rank": True},
                                     environ={})
    first, other = Wrapping.of(both, 0, object()), Wrapping.of(both, 1, object())
    assert [c.__name__ for c in first.load_path.__mro__[:4]] == [
        "VerifiedLoadPath", "VerifiedLoads", "ReplicatedLoadPath", "LoadPath"]
    assert [c.__name__ for c in first.store_path.__mro__[:3]] == ["VerifiedStorePath", "VerifiedStores", "StorePath"]
    assert [c.__name__ for c in other.store_path.__mro__[:3]] == ["VerifiedStorePath", "VerifiedStores", "ReplicaStores"]
    assert (first.key_rank, first.reads_tiers, other.key_rank, other.reads_tiers) == (0, True, 0, False)
    alone = Wrapping.of(both, 1, None)  # no broadcast group (one rank): nothing is replicated
    assert alone.key_rank == 1 and alone.reads_tiers and alone.store_path.__mro__[1].__name__ == "VerifiedStores"
