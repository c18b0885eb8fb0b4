"""The scheduler's ledger: misses counted by reason, and what each index gained and lost. Torch-free.

Every index (the host pool's and each tier's) appends ``(kind, tier, key)`` to one
shared list as a block becomes loadable from it (``stored``) or stops being
(``evicted``, ``damaged``). The ledger drains that list into the reason a later miss
of the key gets (evicted from which tier, damaged) and, for KV events, into what
``take_holdings`` returns. Misses are counted in prompt tokens; a block never stored
here is first looked for under the other namespaces recorded in the tiers
(``kvtier.tiers.namespaces.ForeignProbe``), off the scheduler's thread.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Sequence

from kvtier.tiers.base import ExistenceIndex


class Ledger:
    MAX_UNSETTLED = 4096  # requests whose failed loads wait to be counted; past it the oldest are counted

    def __init__(self, indexes: Sequence, block_tokens: int, track_holdings: bool = False):
        self.holdings: list = []  # the same list object in every index, which appends to it
        for index in indexes:
            index.holdings = self.holdings
        # What a tier says unasked (a storage pool's own evictions) joins the holdings on absorbing.
        self._absorb_news = [index.absorb_news for index in indexes if isinstance(index, ExistenceIndex)]
        self._events_out: list | None = [] if track_holdings else None
        self._gone: OrderedDict[bytes, str] = OrderedDict()  # key -> "evicted_<tier>" or "damaged"
        self.max_gone = 200_000
        self.misses: Counter = Counter()  # reason -> prompt tokens missed for it (the first missed block's)
        self.block_tokens = block_tokens  # tokens per block (the engine's), for misses counted in blocks
        # req_id -> reason -> tokens its failed loads did not deliver, counted when the request is looked up
        # again (``settle``: what another tier then delivers was no miss) or goes away (``forget``).
        self.load_misses: dict[str, Counter] = {}
        self.probe = None  # a ForeignProbe, where the scheduler has one

    def count(self, reason: str, tokens: int, token_ids=None, token: int = 0, extra_keys=()) -> None:
        """Count ``tokens`` missed for ``reason``; a block never stored here (``token_ids``'
        block at position ``token``) is first looked for under the other recorded namespaces."""
        if reason == "never_stored" and token_ids is not None and self.probe is not None \
                and self.probe.submit(token_ids, token, extra_keys, tokens):
            return  # counted when the probe answers
        self.misses[reason] += tokens

    def count_failed_load(self, req_id: str, reason: str, num_blocks: int) -> None:
        """Blocks a load planned and then did not deliver: the engine looks the request up again, and
        loads them from another tier or recomputes them."""
        self.load_misses.setdefault(req_id, Counter())[reason] += num_blocks * self.block_tokens
        if len(self.load_misses) > self.MAX_UNSETTLED:  # a request that went away before its load ended
            self.misses.update(self.load_misses.pop(next(iter(self.load_misses))))

    def settle(self, req_id: str, missed: int) -> int:
        """The request, looked up again after a failed load, misses ``missed`` tokens: as many of its
        failed loads' tokens count as misses, under their reasons (the rest came from another tier).
        Returns the tokens counted."""
        counted = 0
        for reason, tokens in self.load_misses.pop(req_id, Counter()).items():
            take = min(tokens, missed - counted)
            if take > 0:  # no zero entries: a reason shows only once it counted tokens
                self.misses[reason] += take
                counted += take
        return counted

    def gone(self, key: bytes) -> str | None:
        """Why ``key``, once loadable, is not any more (None: nothing known)."""
        self.absorb()
        return self._gone.get(key)

    def take_holdings(self) -> list[tuple[str, str, bytes]]:
        """What became loadable from each index, and what stopped being, since the last call
        (with ``track_holdings``)."""
        self.absorb()
        taken, self._events_out = self._events_out or [], [] if self._events_out is not None else None
        return taken

    def absorb(self) -> None:
        if self.probe is not None:
            for reason, tokens in self.probe.take():
                self.misses[reason] += tokens
        for absorb_news in self._absorb_news:
            absorb_news()
        if not self.holdings:
            return
        for kind, tier, key in self.holdings:
            if kind == "stored":
                self._gone.pop(key, None)
            else:
                self._gone[key] = "damaged" if kind == "damaged" else f"evicted_{tier}"
                self._gone.move_to_end(key)
        while len(self._gone) > self.max_gone:
            self._gone.popitem(last=False)
        if self._events_out is not None:
            self._events_out += self.holdings
        self.holdings.clear()  # the same list object: every index appends to it

    def forget(self, req_id: str) -> None:
        """The request went away: what its failed loads did not deliver was recomputed (or never needed)."""
        self.misses.update(self.load_misses.pop(req_id, Counter()))

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
