from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tiers.host import HostPoolIndex


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_store_then_a_load():
    pool = HostPoolIndex(2)
    plan = pool.prepare_store([key(1), key(2)])
    assert pool.lookup([key(1)]) == 0  # being written: not readable yet
    pool.complete_store(plan.slot_ids, success=True)
    assert pool.lookup([key(1), key(2), key(3)]) == 2
    slots = pool.prepare_load([key(1)])
    pool.complete_load(slots)
    assert pool.num_pins == 0


def test_slots_evicted_together_come_back_as_one_ascending_run():
    pool = HostPoolIndex(8)
    first = pool.prepare_store([key(i) for i in range(8)])
    assert first.slot_ids == list(range(8))
    pool.complete_store(first.slot_ids, True)
    again = pool.prepare_store([key(i) for i in range(100, 104)])  # evicts keys 0..3 (LRU), slots 0..3
    assert again.slot_ids == [0, 1, 2, 3]  # one run: one copy, one DMA on CUDA


def test_full_pool_refuses_a_store_and_changes_nothing():
    pool = HostPoolIndex(2)
    plan = pool.prepare_store([key(1), key(2)])  # both pinned by their writer
    assert pool.prepare_store([key(3)]) is None
    assert pool.num_used == 2 and not pool.contains(key(3))
    pool.complete_store(plan.slot_ids, success=True)
    assert pool.prepare_store([key(3)]) is not None  # now an unpinned block can be evicted


def test_lru_evicts_the_least_recently_used_unpinned_block():
    pool = HostPoolIndex(2)
    pool.complete_store(pool.prepare_store([key(1), key(2)]).slot_ids, True)
    pool.lookup([key(1)])  # key 1 is now more recent than key 2
    pool.complete_store(pool.prepare_store([key(3)]).slot_ids, True)
    assert pool.contains(key(1)) and not pool.contains(key(2)) and pool.num_evictions == 1


def test_a_pinned_block_is_never_evicted():
    pool = HostPoolIndex(1)
    pool.complete_store(pool.prepare_store([key(1)]).slot_ids, True)
    slots = pool.prepare_load([key(1)])
    assert pool.prepare_store([key(2)]) is None and pool.contains(key(1))
    pool.complete_load(slots)
    assert pool.prepare_store([key(2)]) is not None


def test_failed_store_frees_its_slots():
    pool = HostPoolIndex(1)
    pool.complete_store(pool.prepare_store([key(1)]).slot_ids, False)
    assert pool.num_used == 0 and not pool.contains(key(1))


class HostPoolMachine(RuleBasedStateMachine):
    """Random stores, loads and completions against a model of what must hold."""

    def __init__(self):
        super().__init__()
        self.pool = HostPoolIndex(4)
        self.writes: list[list[int]] = []  # slot lists of stores in flight
        self.reads: list[list[int]] = []  # slot lists of loads in flight
        self.ready: dict[bytes, int] = {}  # key -> slot, as the pool reported on completion

    @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=3))
    def store(self, ids):
        keys = [key(i) for i in ids]
        used_before = self.pool.num_used
        pinned = {s for group in self.writes + self.reads for s in group}
        plan = self.pool.prepare_store(keys)
        if plan is None:
            assert self.pool.num_used == used_before
            return
        handed_out = {s for group in self.writes for s in group}
        assert not (set(plan.slot_ids) & handed_out), "a slot was handed out twice"
        assert not (set(plan.slot_ids) & pinned), "a pinned slot was reused"
        self.writes.append(plan.slot_ids)
        for k in plan.keys:
            self.ready.pop(k, None)

    @precondition(lambda self: self.writes)
    @rule(index=st.integers(0, 100), success=st.booleans())
    def complete_store(self, index, success):
        self.pool.complete_store(self.writes.pop(index % len(self.writes)), success)

    @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=3))
    def load(self, ids):
        keys = [key(i) for i in ids]
        if self.pool.lookup(keys) == len(keys):
            self.reads.append(self.pool.prepare_load(keys))

    @precondition(lambda self: self.reads)
    @rule(index=st.integers(0, 100))
    def complete_load(self, index):
        self.pool.complete_load(self.reads.pop(index % len(self.reads)))

    @invariant()
    def capacity_is_never_exceeded(self):
        assert 0 <= self.pool.num_used <= self.pool.num_slots

    @invariant()
    def pins_match_what_is_in_flight(self):
        assert self.pool.num_pins == sum(len(g) for g in self.writes + self.reads)
        assert self.pool.num_pinned == len({slot for g in self.writes + self.reads for slot in g})

    def teardown(self):
        for slots in self.writes:
            self.pool.complete_store(slots, True)
        for slots in self.reads:
            self.pool.complete_load(slots)
        assert self.pool.num_pins == 0  # every pin released


TestHostPoolMachine = HostPoolMachine.TestCase
TestHostPoolMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
