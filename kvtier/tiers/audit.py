"""Asking a shared tier, now and then, whether the blocks this instance stored in it are still
there. Torch-free, engine-free.

A shared tier drops entries on its own: Mooncake evicts and says nothing, another
instance's ``max_bytes`` deletes from a shared directory, a Redis that publishes no
notices (or a Redis Cluster) evicts and expires in silence. Without asking, this
instance learns of it only when a load finds the entry gone: until then routers are
told a block is there that is not, and a miss of it is not explained. ``StoredAudit``
follows the blocks this instance stored (the most recent ``max_blocks``) and, every
``interval_s``, asks the tier about the ``batch`` it asked about least recently, with
the index's own off-thread check (one batch call). What the tier no longer holds is
returned to the index, which tells it as evicted.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence


class StoredAudit:
    def __init__(self, start: Callable[[list[bytes]], Any], interval_s: float, timeout_s: float,
                 batch: int = 4096, max_blocks: int = 200_000):
        self._start, self.interval_s, self._timeout_s = start, interval_s, timeout_s
        self._batch, self._max_blocks = batch, max_blocks
        self._followed: OrderedDict[bytes, None] = OrderedDict()  # least recently asked about first
        self._asking: tuple[list[bytes], Any, float] | None = None  # keys, check, when asked
        self._stored_meanwhile: set[bytes] = set()  # stored while a check was out: its answer is older
        # Found gone lately: the server's own notice of the same eviction (a Redis that publishes them,
        # heard at about the same moment) is then no news, and is not told twice.
        self._found: OrderedDict[bytes, None] = OrderedDict()
        self._next = time.monotonic() + interval_s
        self.num_asked = 0
        self.num_found_gone = 0

    def stored(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._followed[key] = None
            self._followed.move_to_end(key)
            self._found.pop(key, None)  # stored again: a later eviction is news again
        if self._asking is not None:
            self._stored_meanwhile.update(keys)
        while len(self._followed) > self._max_blocks:  # the oldest let go: no longer followed, not told gone
            self._followed.popitem(last=False)

    def news(self, keys: Sequence[bytes]) -> list[bytes]:
        """Of the blocks a server said it dropped, those no audit found gone already; all are let go."""
        fresh = [key for key in keys if key not in self._found]
        for key in keys:
            self._found.pop(key, None)
        self.let_go(fresh)
        return fresh

    def let_go(self, keys: Sequence[bytes]) -> None:
        """Blocks the index knows are gone (a load found them so, the server said so)."""
        for key in keys:
            self._followed.pop(key, None)

    def step(self) -> list[bytes]:
        """Called every scheduler step: the blocks found gone since the last call. Never waits."""
        now = time.monotonic()
        if self._asking is None:
            if now >= self._next and self._followed:
                self._ask(now)
            return []
        keys, check, asked = self._asking
        if not check.done():
            if now - asked > self._timeout_s:  # no answer: nothing learnt, asked again next time
                self._asking, self._next = None, now + self.interval_s
            return []
        self._asking, self._next = None, now + self.interval_s
        try:
            found = check.result()
        except Exception:  # a failed check says nothing of the entries; the tier's breaker logs it
            found = None
        if found is None:  # the tier did not answer (down): nothing learnt
            return []
        # Only blocks still followed, and not stored again after the check was sent (its answer
        # is of a moment before that store).
        gone = [key for key, held in zip(keys, found)
                if not held and key in self._followed and key not in self._stored_meanwhile]
        for key in keys:
            if key in self._followed:
                self._followed.move_to_end(key)  # asked about: the others come first next time
        self.let_go(gone)
        self.num_found_gone += len(gone)
        self._found.update(dict.fromkeys(gone))
        while len(self._found) > self._batch:
            self._found.popitem(last=False)
        return gone

    def _ask(self, now: float) -> None:
        keys = list(itertools.islice(self._followed, self._batch))
        try:
            check = self._start(keys)
        except OSError:  # no check can start now (too many running): the next interval tries again
            self._next = now + self.interval_s
            return
        self._asking = (keys, check, now)
        self._stored_meanwhile.clear()
        self.num_asked += len(keys)
