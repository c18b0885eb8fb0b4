"""``StoredAudit``'s bookkeeping, on checks answered by hand (the tiers' own checks run in
``test_remote.py::test_what_a_shared_tier_drops_in_silence_is_found_by_asking_about_what_this_instance_stored``)."""

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.audit import StoredAudit


class Check:
    """An existence check that answers when the test says so."""

    def __init__(self, keys, held):
        self.keys, self._held, self.answer = keys, held, None

    def done(self):
        return self.answer is not None

    def result(self):
        return self.answer

    def give(self):
        self.answer = [key in self._held for key in self.keys]


def audit_of(held, **options):
    checks = []

    def start(keys):
        checks.append(Check(keys, held))
        return checks[-1]

    return StoredAudit(start, interval_s=0.0, timeout_s=60.0, **options), checks


def test_blocks_are_asked_about_in_turn_and_the_missing_ones_returned_once():
    held = {b"a", b"b", b"c", b"d"}
    audit, checks = audit_of(held, batch=2)
    audit.stored([b"a", b"b", b"c", b"d"])
    asked = []
    for _ in range(4):
        assert audit.step() == []  # asks
        asked.append(checks[-1].keys)
        checks[-1].give()
        assert audit.step() == []  # all held
    assert asked == [[b"a", b"b"], [b"c", b"d"], [b"a", b"b"], [b"c", b"d"]]
    held.discard(b"c")
    found = []
    for _ in range(2):  # a round over every block
        audit.step()
        checks[-1].give()
        found += audit.step()
    assert found == [b"c"]
    for _ in range(3):
        audit.step()
        checks[-1].give()
        assert audit.step() == []  # told once: no longer followed
    assert b"c" not in sum((c.keys for c in checks[-3:]), [])


def test_a_block_stored_again_while_the_question_was_out_is_not_returned():
    held = set()
    audit, checks = audit_of(held)
    audit.stored([b"a", b"b"])
    audit.step()
    audit.stored([b"a"])  # written again after the check was sent: its answer is older than the entry
    held.add(b"a")
    checks[-1].give()  # ...though here the check saw neither
    checks[-1].answer = [False, False]
    assert audit.step() == [b"b"]
    audit.step()
    assert checks[-1].keys == [b"a"]


def test_a_block_let_go_or_told_by_the_server_is_not_returned_again():
    audit, checks = audit_of(set())
    audit.stored([b"a", b"b", b"c"])
    audit.step()
    audit.let_go([b"a"])  # a load found it gone while the question was out
    assert audit.news([b"b"]) == [b"b"]  # the server said it first
    checks[-1].give()
    assert audit.step() == [b"c"]
    assert audit.news([b"c", b"x"]) == [b"x"]  # the server's notice of what the audit found: no news


def test_an_unanswered_or_failed_check_teaches_nothing_and_is_asked_again():
    audit, checks = audit_of(set())
    audit._timeout_s = 0.05
    audit.stored([b"a"])
    audit.step()
    time.sleep(0.1)
    assert audit.step() == []  # past the timeout: given up
    assert audit.step() == [] and len(checks) == 2  # asked again
    checks[-1].answer = None  # the tier was down: no verdict
    checks[-1].done = lambda: True
    assert audit.step() == []
    audit.step()
    checks[-1].give()
    assert audit.step() == [b"a"]


def test_only_the_most_recent_blocks_are_followed():
    audit, checks = audit_of(set(), batch=10, max_blocks=3)
    audit.stored([b"a", b"b", b"c", b"d"])
    audit.step()
    assert checks[-1].keys == [b"b", b"c", b"d"]


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "drop", "told", "step", "look", "answer"]), st.integers(0, 2)),
                max_size=60))
def test_a_block_is_returned_only_when_the_tier_lacked_it_and_once_per_store(ops):
    """Any order of stores, drops behind this instance's back, server notices, and audit checks sent,
    looking at the tier, and answered: a block returned was stored here, was absent when the check
    looked, was not stored again since the check was sent, and is returned (or told by the server)
    at most once per store; a block dropped and never stored again is returned or told within a
    round of audits over every followed block."""
    held = set()
    audit, checks = audit_of(held, batch=3)
    stores = {}  # key -> stores so far
    told = {}  # key -> (its stores when told, times told for that store)
    sent_stores = [None]  # the stores so far when the last check was sent
    noticed = set()  # dropped since their last store, and the server said so

    def tell(key):
        count, times = told.get(key, (None, 0))
        told[key] = (stores[key], (times if count == stores[key] else 0) + 1)
        assert told[key][1] == 1, f"{key!r} told twice for one store"

    def answer():
        lacked = {key for key, there in zip(checks[-1].keys, checks[-1].answer) if not there}
        for key in audit.step():
            assert key in lacked and stores[key] == sent_stores[0][key]  # not stored again since it was sent
            tell(key)

    def ask():
        audit.step()
        if audit._asking is not None:
            sent_stores[0] = dict(stores)

    for op, n in ops:
        key = bytes([n])
        asking = audit._asking is not None
        if op == "store":
            stores[key] = stores.get(key, 0) + 1
            held.add(key)
            noticed.discard(key)
            audit.stored([key])
        elif op == "drop":
            held.discard(key)
        elif op == "told" and key in stores and key not in held and key not in noticed:
            noticed.add(key)  # a server publishes one notice per eviction
            for fresh in audit.news([key]):
                tell(fresh)
        elif op == "step" and not asking:
            ask()
        elif op == "look" and asking and not checks[-1].done():
            checks[-1].give()  # the tier as it is at this moment
        elif op == "answer" and asking and checks[-1].done():
            answer()
    for _ in range(2):  # 3 keys at most, 3 a check: every followed block asked about, after what is out
        if audit._asking is None:
            ask()
        if audit._asking is not None:
            if not checks[-1].done():
                checks[-1].give()
            answer()
    for key, count in stores.items():
        if key not in held:
            assert told.get(key, (None, 0))[0] == count, f"{key!r} dropped and never told"
