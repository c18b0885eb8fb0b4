"""The scheduler-side manager alone: what a lookup promises, its plan delivers.

vLLM asks how many tokens kvtier holds, allocates, then asks for the load plan.
Any block counted and then not loaded is recomputed after all, so lookups must
count only what the plans can pin and stage, whatever the host pool's state:
slots pinned by loads in flight, slots being written, other lookups' promises.
"""

import shutil
import tempfile
import time

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.config import KVTierConfig
from kvtier.entry import HEADER_BYTES
from kvtier.manager import TierManager
from kvtier.plans import JobReport, LoadJob

SLOT_BYTES = 64
FINGERPRINT = b"\x01" * 16


def chain(doc: int, length: int) -> list[bytes]:
    """The block keys of a prompt's first ``length`` blocks (prefix-chained, so unique)."""
    return [(doc * 100 + i).to_bytes(16, "little") for i in range(length)]


def manager(disk_dir: str, host_slots: int, disk_entries: int, **config) -> TierManager:
    config = KVTierConfig.from_sources({
        "host_bytes": host_slots * SLOT_BYTES, "disk_dir": disk_dir,
        "disk_bytes": disk_entries * (SLOT_BYTES + HEADER_BYTES), **config}, environ={})
    return TierManager(config, SLOT_BYTES, [FINGERPRINT])


def complete(mgr: TierManager, job, success: bool = True) -> None:
    failed = [] if success or not isinstance(job, LoadJob) else job.fill_block_ids
    mgr.on_reports([JobReport(job.job_id, isinstance(job, LoadJob), success, failed_block_ids=failed)])


def test_staging_a_disk_hit_never_evicts_a_later_host_hit_of_the_same_prompt(tmp_path):
    mgr = manager(str(tmp_path), host_slots=3, disk_entries=10)
    a, b, c = chain(0, 3)
    complete(mgr, mgr.plan_store("s", [a, b, c], [0, 1, 2]))  # host and disk: a, b, c
    complete(mgr, mgr.plan_store("s", chain(1, 1), [3]))  # evicts a (oldest): a is on disk only
    pinned = mgr.plan_load("other", chain(1, 1), [4])  # a load in flight pins the third slot
    # Staging a takes one of the two evictable slots, which hold b and c: a and b fit, c
    # does not. Counting all three would evict b for a and cost two recomputes.
    assert mgr.lookup([a, b, c], token="r") == 2
    job = mgr.plan_load("r", [a, b], [10, 11])
    assert not job.missing_block_ids and job.fill_keys == [a] and job.ready_keys == [b]
    complete(mgr, job)
    complete(mgr, pinned)
    assert mgr.lookup([a, b, c], token="r") == 3  # a, b in host; c (evicted to stage a) stages again
    job = mgr.plan_load("r", [a, b, c], [10, 11, 12])
    assert not job.missing_block_ids and job.ready_keys == [a, b] and job.fill_keys == [c]
    complete(mgr, job)
    assert mgr.host.num_pins == 0 and mgr.tier('disk').num_pins == 0


def test_a_lookup_waits_for_a_block_being_written_rather_than_recompute_it(tmp_path):
    mgr = manager(str(tmp_path), host_slots=8, disk_entries=10)
    keys = chain(0, 4)
    complete(mgr, mgr.plan_store("first", keys[:2], [0, 1]))
    writing = mgr.plan_store("first", keys[2:], [2, 3])  # the rest of the prompt is being stored
    assert mgr.lookup(keys, token="second") is None  # ask again: blocks 2 and 3 are about to be ready
    assert mgr.lookup(keys, token="second") is None
    complete(mgr, writing)
    assert mgr.lookup(keys, token="second") == 4
    assert mgr.lookup(keys) == 4  # without a token (nothing to ask again with), never None


def test_a_lookup_waits_at_most_load_timeout_s(tmp_path):
    mgr = manager(str(tmp_path), host_slots=8, disk_entries=10, load_timeout_s=0.2)
    keys = chain(0, 3)
    complete(mgr, mgr.plan_store("first", keys[:1], [0]))
    writing = mgr.plan_store("first", keys[1:], [1, 2])  # a write that does not finish in time
    began = time.monotonic()
    while (hits := mgr.lookup(keys, token="second")) is None:
        time.sleep(0.01)
    assert hits == 1 and 0.2 <= time.monotonic() - began < 5
    mgr.forget("second")
    assert mgr.lookup(keys, token="third") is None  # each request waits its own while
    complete(mgr, writing)
    assert mgr.host.num_pins == 0


class PromiseMachine(RuleBasedStateMachine):
    """Random stores, loads and their completions; each lookup is followed by its plan."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvtier-manager-")
        self.mgr = manager(self.dir, host_slots=5, disk_entries=12)
        self.in_flight: list = []
        self.blocks = iter(range(10**9))

    def _ids(self, n):
        return [next(self.blocks) for _ in range(n)]

    @rule(doc=st.integers(0, 3), length=st.integers(1, 5))
    def store(self, doc, length):
        keys = chain(doc, length)
        job = self.mgr.plan_store("s", keys, self._ids(length))
        if job is not None:
            self.in_flight.append(job)

    @rule(docs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=3))
    def schedule(self, docs):
        """One scheduler step: each request is looked up, then planned, before the next one."""
        for i, (doc, length) in enumerate(docs):
            keys = chain(doc, length)
            hits = self.mgr.lookup(keys, token=f"r{i}")
            if hits is None:  # waits for a block being written: asks again in a later step
                continue
            job = self.mgr.plan_load(f"r{i}", keys[:hits], self._ids(hits))
            assert not job.missing_block_ids, f"counted {hits} blocks, planned {hits - len(job.missing_block_ids)}"
            self.in_flight.append(job)

    @rule(doc=st.integers(0, 3), length=st.integers(1, 6))
    def lookup_of_a_request_that_is_not_allocated(self, doc, length):
        """Counted, but not allocated this step: its promise stands until it is forgotten."""
        self.mgr.lookup(chain(doc, length), token="waiting")

    @rule()
    def forget_the_waiting_request(self):
        self.mgr.forget("waiting")

    @precondition(lambda self: self.in_flight)
    @rule(index=st.integers(0, 100), success=st.booleans())
    def complete_one(self, index, success):
        complete(self.mgr, self.in_flight.pop(index % len(self.in_flight)), success)

    @invariant()
    def host_pool_within_capacity(self):
        assert self.mgr.host.num_used <= self.mgr.host.num_slots

    def teardown(self):
        for job in self.in_flight:
            complete(self.mgr, job)
        assert self.mgr.host.num_pins == 0 and self.mgr.tier('disk').num_pins == 0 and self.mgr.num_pending == 0
        shutil.rmtree(self.dir, ignore_errors=True)


TestPromiseMachine = PromiseMachine.TestCase
TestPromiseMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
