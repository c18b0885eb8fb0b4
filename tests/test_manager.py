"""The scheduler-side manager alone: what a lookup promises, its plan delivers.

vLLM asks how many tokens kvtier holds, allocates, then asks for the load plan.
Any block counted and then not loaded is recomputed after all, so lookups must
count only what the plans can pin and stage, whatever the host pool's state:
slots pinned by loads in flight, slots being written, other lookups' promises.
"""

import shutil
import tempfile
import time

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.common.config import KVTierConfig
from kvtier.common.entry import HEADER_BYTES
from kvtier.common.plans import JobReport, LoadJob
from kvtier.scheduler.ledger import Ledger
from kvtier.scheduler.manager import TierManager

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


def test_staging_a_disk_hit_never_evicts_a_host_hit_of_the_same_wave(tmp_path):
    mgr = manager(str(tmp_path), host_slots=3, disk_entries=10)
    a, b, c = chain(0, 3)
    complete(mgr, mgr.plan_store("s", [a, b, c], [0, 1, 2]))  # host and disk: a, b, c
    complete(mgr, mgr.plan_store("s", chain(1, 1), [3]))  # evicts a (oldest): a is on disk only
    pinned = mgr.plan_load("other", chain(1, 1), [4])  # a load in flight pins the third slot
    # Two slots can be freed (they hold b and c): staging a takes one, pinning b the other. The
    # first wave is a and b, b pinned before a is staged, so that staging evicts c, not b; c
    # follows in the next wave, from the disk.
    assert mgr.lookup([a, b, c], token="r") == 3
    job = mgr.plan_load("r", [a, b, c], [10, 11, 12])
    assert not job.final and not job.missing_block_ids and job.fill_keys == [a] and job.ready_keys == [b]
    assert mgr.waves.plan_next("r") is None  # every slot is pinned until the wave and the other load end
    complete(mgr, job)
    complete(mgr, pinned)
    job = mgr.waves.plan_next("r")
    assert job.final and not job.missing_block_ids and job.fill_keys == [c] and job.fill_block_ids == [12]
    complete(mgr, job)
    assert mgr.host.num_pins == 0 and mgr.tier('disk').num_pins == 0
    assert mgr.lookup([a, b, c], token="r") == 3
    job = mgr.plan_load("r", [a, b, c], [10, 11, 12])  # two in the host pool, one staged: one wave
    assert job.final and not job.missing_block_ids and len(job.ready_keys) == 2 and len(job.fill_keys) == 1
    complete(mgr, job)
    assert mgr.host.num_pins == 0


def test_a_request_whose_load_from_a_tier_failed_is_not_read_from_that_tier_again(tmp_path):
    """vLLM reschedules a request whose load failed and asks kvtier again: a tier that answers for
    its entries but cannot serve them (a pool too slow to read) must not have the request loaded
    and failed for ever. Its later lookups skip that tier (here the only one: host hits only); other
    requests still read it. ``test_shared_dir.py`` shows the next tier taking over."""
    mgr = manager(str(tmp_path), host_slots=2, disk_entries=10)
    keys = chain(0, 4)
    complete(mgr, mgr.plan_store("s", keys[:2], [0, 1]))
    complete(mgr, mgr.plan_store("s", keys[2:], [2, 3]))  # the first two are on disk only now
    assert mgr.lookup(keys, token="r") == 4
    job = mgr.plan_load("r", keys[:2], [10, 11])
    assert job.fill_keys == keys[:2]
    complete(mgr, job, success=False)  # the reads failed, the entries themselves are not damaged
    assert mgr.lookup(keys, token="r") == 0  # recomputed from here
    assert mgr.lookup(keys, token="other") == 4
    mgr.forget("other")  # its promise of host slots ends
    mgr.forget("r")  # the request went away: its id means nothing any more
    assert mgr.lookup(keys, token="r") == 4
    assert mgr.host.num_pins == 0


def test_a_wave_whose_blocks_left_the_disk_since_the_lookup_reports_them_missing(tmp_path):
    mgr = manager(str(tmp_path), host_slots=1, disk_entries=3)
    keys = chain(0, 3)
    for i, key in enumerate(keys):
        complete(mgr, mgr.plan_store("s", [key], [i]))  # the host pool keeps the last; the disk all three
    assert mgr.lookup(keys, token="r") == 3  # one slot: three waves
    job = mgr.plan_load("r", keys, [10, 11, 12])
    assert not job.final and job.ready_keys + job.fill_keys == [keys[0]] and not job.missing_block_ids
    complete(mgr, job)
    for i, key in enumerate(chain(1, 3)):  # three other blocks evict every entry of the first from the disk
        complete(mgr, mgr.plan_store("s", [key], [20 + i]))
    job = mgr.waves.plan_next("r")
    assert job.final and job.missing_block_ids == [11, 12] and not job.fill_keys and not job.ready_keys
    complete(mgr, job)
    assert mgr.host.num_pins == 0 and mgr.tier('disk').num_pins == 0 and mgr.num_pending == 0


def test_a_wave_waits_for_a_block_another_requests_wave_is_writing(tmp_path):
    """Two requests of one prefix, each larger than the host pool: neither recomputes what the other stages."""
    mgr = manager(str(tmp_path), host_slots=2, disk_entries=10)
    keys = chain(0, 3)
    for i, key in enumerate(keys + chain(1, 2)):  # all on disk; the host pool holds the last two, others
        complete(mgr, mgr.plan_store("s", [key], [i]))
    assert mgr.lookup(keys, token="a") == 3
    first_a = mgr.plan_load("a", keys, [10, 11, 12])
    assert not first_a.final and first_a.fill_keys == keys[:2]
    complete(mgr, first_a)
    assert mgr.lookup(keys, token="b") == 3
    first_b = mgr.plan_load("b", keys, [20, 21, 22])
    assert not first_b.final and first_b.ready_keys == keys[:2]
    assert mgr.waves.plan_next("a") is None  # both slots pinned by b's first wave
    complete(mgr, first_b)
    last_a = mgr.waves.plan_next("a")
    assert last_a.final and last_a.fill_keys == keys[2:]  # staged: being written to the host pool
    assert mgr.waves.plan_next("b") is None  # waits for a's write rather than count it missing
    complete(mgr, last_a)
    last_b = mgr.waves.plan_next("b")
    assert last_b.final and last_b.ready_keys == keys[2:] and not last_b.missing_block_ids
    complete(mgr, last_b)
    assert mgr.host.num_pins == 0 and mgr.tier('disk').num_pins == 0 and mgr.num_pending == 0


def test_a_first_wave_leaves_the_slots_another_lookup_was_promised(tmp_path):
    mgr = manager(str(tmp_path), host_slots=4, disk_entries=20)
    a, b = chain(0, 6), chain(1, 2)
    for i, key in enumerate(a + b + chain(2, 4)):  # all on disk; the host pool holds only chain 2
        complete(mgr, mgr.plan_store("s", [key], [i]))
    assert mgr.lookup(b, token="b") == 2  # promised two of the four slots
    assert mgr.lookup(a, token="a") == 6  # the other two now, the rest in later waves
    first = mgr.plan_load("a", a, list(range(10, 16)))
    assert not first.final and first.fill_keys == a[:2]
    job = mgr.plan_load("b", b, [20, 21])
    assert job.final and job.fill_keys == b and not job.missing_block_ids
    complete(mgr, job)
    complete(mgr, first)
    while not first.final:
        first = mgr.waves.plan_next("a")
        assert not first.missing_block_ids
        complete(mgr, first)
    assert mgr.host.num_pins == 0 and mgr.tier('disk').num_pins == 0 and mgr.num_pending == 0



def test_a_lookup_that_no_load_follows_gives_its_promised_slots_back(tmp_path):
    """vLLM's own prefix cache covered the hit (or the engine cannot load): the request runs on with no
    load, and the slots its lookup counted on are at once other lookups' again, not at its end."""
    mgr = manager(str(tmp_path), host_slots=4, disk_entries=20)
    covered, other = chain(0, 3), chain(1, 3)
    for i, key in enumerate(covered + other):  # on disk; the host pool keeps the last four
        complete(mgr, mgr.plan_store("s", [key], [i]))
    free = mgr.free_slots()
    assert mgr.lookup(covered, token="covered") == 3 and mgr.free_slots() == free - 3
    mgr.drop_lookup("covered")
    assert mgr.free_slots() == free
    assert mgr.lookup(other, token="other") == 3
    complete(mgr, mgr.plan_load("other", other, [10, 11, 12]))
    mgr.forget("other")
    assert mgr.host.num_pins == 0 and mgr.tier("disk").num_pins == 0 and mgr.num_pending == 0

def test_no_wave_is_counted_when_promises_exceed_the_free_slots(tmp_path):
    """A store takes a slot that a waiting request's lookup was promised: no slot is free for a first wave,
    not even for a block pinned already (it needs none), so nothing is counted that no plan could load."""
    mgr = manager(str(tmp_path), host_slots=3, disk_entries=20)
    pinned, on_disk = chain(0, 1), chain(1, 2)
    for i, key in enumerate(on_disk + pinned):
        complete(mgr, mgr.plan_store("s", [key], [i]))
    other = mgr.plan_load("other", pinned, [50])
    for i, key in enumerate(chain(2, 2)):  # on disk, and two of the host pool's three slots
        complete(mgr, mgr.plan_store("s", [key], [60 + i]))
    assert mgr.lookup(chain(2, 2), token="waiting") == 2  # promised the two slots
    store = mgr.plan_store("s", chain(3, 1), [70])  # takes one of them
    assert mgr.free_slots() < 0
    assert mgr.lookup(pinned + on_disk, token="r") is None  # nothing counted: it asks again, for a slot
    complete(mgr, store)
    complete(mgr, other)
    mgr.forget("waiting")
    assert mgr.lookup(pinned + on_disk, token="r") == 3  # slots free again: the whole prefix
    mgr.forget("r")
    assert mgr.host.num_pins == 0


@settings(max_examples=80, deadline=None)
@given(held=st.lists(st.booleans(), min_size=1, max_size=12), reach=st.integers(0, 5), host_slots=st.integers(2, 16))
def test_a_sliding_windows_hit_needs_only_the_blocks_within_the_window(held, reach, host_slots):
    """A sliding window's engine reads, of a hit of n blocks, only those from ``first_read(n)``: the blocks
    before it (never stored, skipped, evicted) do not cut the hit short, and the plan of the blocks read
    (vLLM gives the others its null block) loads every one of them, in waves through a small host pool."""
    with tempfile.TemporaryDirectory() as disk_dir:
        mgr = manager(disk_dir, host_slots=host_slots, disk_entries=len(held))
        keys = chain(0, len(held))
        for i, key in enumerate(keys):
            if held[i]:  # the host pool keeps the last ones, the disk all
                complete(mgr, mgr.plan_store("s", [key], [i]))

        def first_read(n):
            return max(0, n - reach)

        # The hit's last key is needed even where the engine reads none (a window of one token).
        longest = max(n for n in range(len(keys) + 1) if n == 0 or all(held[min(first_read(n), n - 1):n]))
        leading = held.index(False) if False in held else len(held)
        assert mgr.lookup(keys) == leading  # an engine that reads every block of a hit
        hits = mgr.lookup(keys, token="r", first_read=first_read)
        assert hits == longest
        loaded = []
        read = list(range(first_read(hits), hits))
        if read:
            job = mgr.plan_load("r", [keys[i] for i in read], [100 + i for i in read])
            while True:
                assert not job.missing_block_ids
                loaded += job.ready_keys + job.fill_keys
                complete(mgr, job)
                if job.final:
                    break
                job = mgr.waves.plan_next("r")
            assert sorted(loaded) == sorted(keys[i] for i in read)
        mgr.forget("r")
        assert mgr.host.num_pins == 0 and mgr.tier("disk").num_pins == 0 and mgr.num_pending == 0


def test_a_lookup_with_no_free_host_slot_waits_for_one_at_most_load_timeout_s(tmp_path):
    """A tier holds the prompt but every host slot is pinned: the lookup asks again rather than have vLLM
    recompute it, until a slot frees (a hit) or ``load_timeout_s`` passes (a miss, ``no_free_host_slot``)."""
    mgr = manager(str(tmp_path), host_slots=2, disk_entries=20, load_timeout_s=0.2)
    prompt = chain(0, 3)
    for i, key in enumerate(prompt):  # all on disk; the host pool keeps the last two
        complete(mgr, mgr.plan_store("s", [key], [i]))
    loading = mgr.plan_load("other", prompt[1:], [10, 11])  # pins both slots
    assert mgr.lookup(prompt, token="r") is None and mgr.lookup(prompt, token="r") is None
    complete(mgr, loading)
    assert mgr.lookup(prompt, token="r") == 3  # a slot freed: the prompt loads, in waves
    mgr.forget("r")
    loading = mgr.plan_load("other", prompt[1:], [10, 11])
    began = time.monotonic()
    while (hits := mgr.lookup(prompt, token="late")) is None:
        time.sleep(0.01)
    assert hits == 0 and 0.2 <= time.monotonic() - began < 5
    assert mgr.miss_reason(prompt[0], "late") == "no_free_host_slot"
    complete(mgr, loading)
    mgr.forget("late")
    assert mgr.host.num_pins == 0 and mgr.tier("disk").num_pins == 0


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
        self.requests = iter(range(10**9))
        self.due: list[str] = []  # requests whose last wave completed: their next is planned by next_waves

    def _ids(self, n):
        return [next(self.blocks) for _ in range(n)]

    @rule(doc=st.integers(0, 3), length=st.integers(1, 9))
    def store(self, doc, length):
        """Blocks the host pool holds already are skipped: stores again extend a prompt on disk."""
        keys = chain(doc, length)
        job = self.mgr.plan_store("s", keys, self._ids(length))
        if job is not None:
            self.in_flight.append(job)

    @rule(docs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 9)), min_size=1, max_size=3))
    def schedule(self, docs):
        """One scheduler step: each request is looked up, then planned, before the next one."""
        for doc, length in docs:
            keys, token = chain(doc, length), f"r{next(self.requests)}"
            hits = self.mgr.lookup(keys, token=token)
            if hits is None:  # waits for a block being written: asks again in a later step
                self.mgr.forget(token)
                continue
            job = self.mgr.plan_load(token, keys[:hits], self._ids(hits))
            # More hits than free slots load in waves; the first one misses nothing the lookup counted.
            assert not job.missing_block_ids, f"counted {hits} blocks, planned {hits - len(job.missing_block_ids)}"
            self.in_flight.append(job)

    @precondition(lambda self: self.due)
    @rule(give_up=st.booleans())
    def next_waves(self, give_up):
        for token in list(self.due):
            job = self.mgr.waves.plan_next(token, "no_free_host_slot" if give_up else None)
            if job is not None:
                self.due.remove(token)
                self.in_flight.append(job)
                assert not give_up or (job.final and not job.fill_block_ids and not job.ready_block_ids)

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
        job = self.in_flight.pop(index % len(self.in_flight))
        complete(self.mgr, job, success)
        if isinstance(job, LoadJob) and not job.final:  # the next wave, at once if the host pool has room
            next_wave = self.mgr.waves.plan_next(job.req_id)
            (self.due.append(job.req_id) if next_wave is None else self.in_flight.append(next_wave))

    @invariant()
    def host_pool_within_capacity(self):
        assert self.mgr.host.num_used <= self.mgr.host.num_slots

    def teardown(self):
        while self.in_flight or self.due:
            for token in self.due:
                self.in_flight.append(self.mgr.waves.plan_next(token, "gone"))
            self.due = []
            self.complete_one(0, True)
        assert self.mgr.host.num_pins == 0 and self.mgr.tier('disk').num_pins == 0 and self.mgr.num_pending == 0
        shutil.rmtree(self.dir, ignore_errors=True)


TestPromiseMachine = PromiseMachine.TestCase
TestPromiseMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_a_failed_load_counts_as_a_miss_only_what_no_other_tier_delivers():
    """The blocks a load failed to deliver are counted when the request is looked up again, up to
    what that lookup misses (another tier may hold them), or in full when the request goes away."""
    ledger = Ledger([], block_tokens=16)
    ledger.count_failed_load("a", "damaged", 3)
    assert not ledger.misses  # not yet: vLLM looks the request up again first
    assert ledger.settle("a", 16) == 16  # another tier delivered two of the three blocks
    assert ledger.misses == {"damaged": 16}
    assert ledger.settle("a", 16) == 0  # counted once
    ledger.count_failed_load("b", "load_abandoned", 2)
    ledger.forget("b")  # it went away before its next lookup: both blocks were recomputed, or never needed
    assert ledger.misses == {"damaged": 16, "load_abandoned": 32} and not ledger.load_misses


def test_an_idle_step_waits_for_a_tiers_answers_only_while_no_load_is_pending(tmp_path):
    """``wait_for_lookups`` (an engine step with nothing to compute): a lookup waiting for a tier that
    is asked off the scheduler's thread (a shared directory here) is waited for, unless a load is
    pending: the workers wait for that one, and a new request should wait for one of the two at most."""
    mgr = manager(str(tmp_path / "disk"), host_slots=4, disk_entries=10, remote_url=f"file://{tmp_path / 'shared'}")
    shared = mgr.tiers[1]
    assert mgr.lookups.asking == [shared]  # asked off the scheduler's thread; the disk answers at once
    assert mgr.lookup(chain(0, 2), token="r") is None  # asked; answered off this thread
    mgr.wait_for_lookups(30.0)
    assert shared.num_waits == 1
    assert mgr.lookup(chain(0, 2), token="r") == 0  # the answer was in when the wait ended
    complete(mgr, mgr.plan_store("s", chain(1, 1), [0]))
    assert mgr.lookup(chain(1, 1), token="l") == 1
    load = mgr.plan_load("l", chain(1, 1), [5])
    assert mgr.lookup(chain(2, 2), token="q") is None
    mgr.wait_for_lookups(30.0)
    assert shared.num_waits == 1  # the load is pending: not waited for here
    complete(mgr, load)
    mgr.wait_for_lookups(30.0)
    assert shared.num_waits == 2
    assert mgr.lookup(chain(2, 2), token="q") == 0


def test_a_wait_for_a_tiers_answer_ends_at_its_bound():
    from kvtier.tiers.base import ExistenceIndex

    class Unanswered:
        def done(self):
            return False

    index = ExistenceIndex("slow", lambda keys: Unanswered(), timeout_s=60.0)
    assert index.lookup(chain(0, 1), "r") is None
    began = time.monotonic()
    index.wait_for_answers(0.05)
    took = time.monotonic() - began
    assert 0.05 <= took < 5.0
    assert index.lookup(chain(0, 1), "r") is None  # still waiting for the tier: ask again
