"""What a tier's read or write of one block came to, when it did not happen: a ``Miss``.

A tier's store answers each block of a job with None (done) or a ``Miss``; what the
rest of kvtier does with a miss depends on its kind alone:

- ``BAD``: the entry itself is wrong (corrupt, truncated, foreign, another key's). It is
  dropped from its tier's index, or not offered again for a while, and counted damaged.
- ``GONE``: the entry is no longer there (evicted since the lookup found it, by this
  instance or another). Nothing is wrong with the tier: the block, stored again, is offered
  again at once.
- ``UNAVAILABLE``: the tier could not be asked (down, its I/O process gone, switched off).
  The entry may be fine: it is neither dropped nor shunned.
- ``FULL``: a write found no room on the tier's filesystem (ENOSPC, EDQUOT), short of the
  tier's own bound: its index holds at most what it holds now, evicting to make room.

Plain data: it crosses from the I/O process to the worker in its answers (``kvtier.io.messages``).
"""

from __future__ import annotations

from typing import NamedTuple

BAD, GONE, UNAVAILABLE, FULL = "bad", "gone", "unavailable", "full"
_PREFIX = {BAD: "", GONE: "gone: ", UNAVAILABLE: "unavailable: ", FULL: "device full: "}


class Miss(NamedTuple):
    kind: str  # BAD, GONE, UNAVAILABLE or FULL
    why: str

    def __str__(self) -> str:  # as logs and reports word it
        return _PREFIX.get(self.kind, "") + self.why


def bad(why: str) -> Miss:
    return Miss(BAD, why)


def gone(why: str) -> Miss:
    return Miss(GONE, why)


def unavailable(why: str) -> Miss:
    return Miss(UNAVAILABLE, why)


def full(why: str) -> Miss:
    return Miss(FULL, why)
