"""The node server's index of its arena: which entry lies in which pages, who holds what. Torch-free.

The arena is ``num_pages`` pages of one size. An entry (one rank's block: header and payload) takes
as many pages as its bytes need, anywhere: no two sizes of block compete for runs of free memory,
so namespaces of any block size share the capacity without fragmenting it.

An entry is being written (held by its writer, visible to no one) or ready. A ready entry may be
pinned by readers; only ready, unpinned entries are in the LRU list, so eviction never takes pages
that a client copies into or out of. Every hold belongs to a ``Holder`` (a connection, or the
server's own disk writer), and ``release`` lets go of all of one holder's at once.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Sequence


class Holder:
    """Whoever holds entries: one client connection (its engine's label), or the server itself."""

    def __init__(self, engine: str):
        self.engine = engine
        self.pins: Counter[str] = Counter()  # name -> pins this holder took
        self.writing: set[str] = set()  # names reserved and not yet committed


@dataclass
class _Entry:
    size: int
    pages: list[int]
    namespace: str
    engine: str  # whose store wrote it
    writer: Holder | None  # set while being written
    pins: int = 0


@dataclass
class EngineCounters:  # of the entries one engine stored
    stores: int = 0
    hits_served_to_others: int = 0  # other engines' hits on them
    evictions: int = 0


DEPARTED = "departed"  # the engines whose connections have all closed, together


@dataclass
class NamespaceCounters:
    hits: int = 0
    hits_other_engine: int = 0  # hits on an entry another engine stored
    stores: int = 0
    evictions: int = 0
    refused_stores: int = 0  # no room: every page held


def namespace_of(name: str) -> str:
    """The namespace part of a pool name (``kvtier/<rank fingerprint hex>/<key hex>``)."""
    parts = name.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == "kvtier" else "other"


class Arena:
    def __init__(self, num_pages: int, page_bytes: int):
        if num_pages <= 0:
            raise ValueError(f"the node's host pool needs at least one page, got {num_pages}")
        self.num_pages, self.page_bytes = num_pages, page_bytes
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._entries: dict[str, _Entry] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # ready, unpinned; oldest first
        self.counters: dict[str, NamespaceCounters] = defaultdict(NamespaceCounters)
        self.engines: dict[str, EngineCounters] = defaultdict(EngineCounters)  # connected, and DEPARTED
        self.evicted: list[str] = []  # names evicted since the server last took them (``take_evicted``)

    # --- writes ----------------------------------------------------------------
    def reserve(self, holder: Holder, names: Sequence[str], sizes: Sequence[int]) -> list[list[int] | None]:
        """Pages for each new entry, evicting the least recently used; [] for one held already,
        None for one being written by another or that does not fit now."""
        answer: list[list[int] | None] = []
        for name, size in zip(names, sizes):
            entry = self._entries.get(name)
            if entry is not None:
                answer.append([] if entry.writer is None else None)
                continue
            need = max(1, math.ceil(size / self.page_bytes))
            if need > len(self._free) + self._evictable_pages(need):
                self.counters[namespace_of(name)].refused_stores += 1
                answer.append(None)
                continue
            while len(self._free) < need:
                self._evict_one()
            pages = sorted(self._free.pop() for _ in range(need))  # ascending: runs copy as one
            self._entries[name] = _Entry(size, pages, namespace_of(name), holder.engine, holder)
            holder.writing.add(name)
            answer.append(pages)
        return answer

    def _evictable_pages(self, need: int) -> int:
        """Pages that evictions could free, counted up to ``need`` (a full count each time is O(entries))."""
        pages = 0
        for name in self._lru:
            pages += len(self._entries[name].pages)
            if pages >= need:
                break
        return pages

    def commit(self, holder: Holder, names: Sequence[str], ok: Sequence[bool]) -> list[str]:
        """Make written entries visible (or let failed ones go); the names now ready."""
        ready = []
        for name, done in zip(names, ok):
            entry = self._entries.get(name)
            if entry is None or entry.writer is not holder:
                continue  # not this holder's to commit (a client out of step): nothing changes
            holder.writing.discard(name)
            entry.writer = None
            if done:
                self.counters[entry.namespace].stores += 1
                self.engines[entry.engine].stores += 1
                self._lru[name] = None
                ready.append(name)
            else:
                self._drop(name)
        return ready

    # --- reads -----------------------------------------------------------------
    def pin(self, holder: Holder, names: Sequence[str], count: bool = True) -> list[tuple[int, list[int]] | None]:
        """Pin each ready entry for ``holder``: (its bytes, its pages), or None where it is not ready
        here. ``count``: a client's hit (the server's own pins, its disk writer's, are none)."""
        answer = []
        for name in names:
            entry = self._entries.get(name)
            if entry is None or entry.writer is not None:
                answer.append(None)
                continue
            self._lru.pop(name, None)
            entry.pins += 1
            holder.pins[name] += 1
            if count:
                counters = self.counters[entry.namespace]
                counters.hits += 1
                if entry.engine != holder.engine:
                    counters.hits_other_engine += 1
                    self.engines[entry.engine].hits_served_to_others += 1
            answer.append((entry.size, entry.pages))
        return answer

    def unpin(self, holder: Holder, names: Sequence[str]) -> None:
        for name in names:
            if holder.pins[name] <= 0:
                continue  # never pinned by this holder: a client out of step changes nothing
            holder.pins[name] -= 1
            if not holder.pins[name]:
                del holder.pins[name]
            entry = self._entries[name]
            entry.pins -= 1
            if entry.pins == 0:
                self._lru[name] = None  # most recently used now

    def release(self, holder: Holder) -> int:
        """Let go of everything ``holder`` holds (its connection closed): pins, and reserved entries,
        which were never visible. Returns the holds let go."""
        held = sum(holder.pins.values()) + len(holder.writing)
        for name, count in list(holder.pins.items()):
            for _ in range(count):
                self.unpin(holder, [name])
        for name in list(holder.writing):
            self.commit(holder, [name], [False])
        return held

    def depart(self, engine: str) -> None:
        """``engine``'s last connection closed: its entries and counters are DEPARTED's from now on,
        so that engines that come and go (a new label each) leave no trail."""
        gone = self.engines.pop(engine, None)
        if gone is not None:
            kept = self.engines[DEPARTED]
            for field, value in vars(gone).items():
                setattr(kept, field, getattr(kept, field) + value)
        for entry in self._entries.values():
            if entry.engine == engine:
                entry.engine = DEPARTED

    # --- queries ---------------------------------------------------------------
    def holds(self, name: str) -> bool:
        """Ready here (a name being written is not, yet)."""
        entry = self._entries.get(name)
        return entry is not None and entry.writer is None

    def ready_names(self) -> list[str]:
        return [name for name, entry in self._entries.items() if entry.writer is None]

    def pages_of(self, name: str) -> tuple[int, list[int]]:
        entry = self._entries[name]
        return entry.size, entry.pages

    def take_evicted(self) -> list[str]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def stats(self) -> dict:
        """Pages used and pinned and entries, per namespace; the counters; the totals."""
        used: Counter[str] = Counter()
        pinned: Counter[str] = Counter()
        entries: Counter[str] = Counter()
        by_engine: Counter[str] = Counter()
        for entry in self._entries.values():
            used[entry.namespace] += len(entry.pages)
            entries[entry.namespace] += 1
            by_engine[entry.engine] += len(entry.pages)
            if entry.pins or entry.writer is not None:
                pinned[entry.namespace] += len(entry.pages)
        namespaces = set(used) | set(self.counters)
        return {"pages": self.num_pages, "page_bytes": self.page_bytes, "free_pages": len(self._free),
                "namespaces": {ns: {"pages_used": used[ns], "pages_pinned": pinned[ns], "entries": entries[ns],
                                    **vars(self.counters[ns])} for ns in sorted(namespaces)},
                "stored_by": {engine: {"pages_used": by_engine[engine],
                                       **vars(self.engines.get(engine) or EngineCounters())}
                              for engine in sorted(set(by_engine) | set(self.engines))}}

    @property
    def num_pinned_pages(self) -> int:
        return sum(len(e.pages) for e in self._entries.values() if e.pins or e.writer is not None)

    # --- internals -------------------------------------------------------------
    def _evict_one(self) -> None:
        name, _ = self._lru.popitem(last=False)
        entry = self._entries[name]
        self.counters[entry.namespace].evictions += 1
        self.engines[entry.engine].evictions += 1
        self._drop(name)
        self.evicted.append(name)

    def _drop(self, name: str) -> None:
        entry = self._entries.pop(name)
        self._lru.pop(name, None)
        self._free.extend(entry.pages)
