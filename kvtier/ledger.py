"""The scheduler's ledger: misses counted by reason, and what each index gained and lost. Torch-free.

Every index (the host pool's and each tier's) appends ``(kind, tier, key)`` to one
shared list as a block becomes loadable from it (``stored``) or stops being
(``evicted``, ``damaged``). The ledger drains that list into the reason a later miss
of the key gets (evicted from which tier, damaged) and, for KV events, into what
``take_holdings`` returns. Misses are counted in prompt tokens; a block never stored
here is first looked for under the other namespaces recorded in the tiers
(``kvtier.namespaces.ForeignProbe``), off the scheduler's thread.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Sequence


class Ledger:
    def __init__(self, indexes: Sequence, block_tokens: int, track_holdings: bool = False):
        self.holdings: list = []  # the same list object in every index, which appends to it
        for index in indexes:
            index.holdings = self.holdings
        self._events_out: list | None = [] if track_holdings else None
        self._gone: OrderedDict[bytes, str] = OrderedDict()  # key -> "evicted_<tier>" or "damaged"
        self.max_gone = 200_000
        self.misses: Counter = Counter()  # reason -> prompt tokens missed for it (the first missed block's)
        self.block_tokens = block_tokens  # tokens per block (the engine's), for misses counted in blocks
        self.load_misses: dict[str, int] = {}  # req_id -> tokens counted as missed when its load failed
        self.probe = None  # a ForeignProbe, where the scheduler has one

    def count(self, reason: str, tokens: int, token_ids=None, token: int = 0, extra_keys=()) -> None:
        """Count ``tokens`` missed for ``reason``; a block never stored here (``token_ids``'
        block at position ``token``) is first looked for under the other recorded namespaces."""
        if reason == "never_stored" and token_ids is not None and self.probe is not None \
                and self.probe.submit(token_ids, token, extra_keys, tokens):
            return  # counted when the probe answers
        self.misses[reason] += tokens

    def count_failed_load(self, req_id: str, reason: str, num_blocks: int) -> None:
        """Blocks a load planned and then did not deliver (the engine recomputes them)."""
        tokens = num_blocks * self.block_tokens
        self.misses[reason] += tokens
        # The engine looks the request up again to recompute: those tokens are counted already.
        self.load_misses[req_id] = self.load_misses.get(req_id, 0) + tokens

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
        self.load_misses.pop(req_id, None)

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
