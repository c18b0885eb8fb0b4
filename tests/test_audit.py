"""``StoredAudit``'s bookkeeping, on checks answered by hand (the tiers' own checks run in
``test_remote.py::test_what_a_shared_tier_drops_in_silence_is_found_by_asking_about_what_this_instance_stored``)."""

import time

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
