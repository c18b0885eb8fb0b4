"""What a lookup counts on: the leading blocks the tiers hold, and the host slots their load takes. Torch-free.

A lookup asks the host pool, then every tier at once (a tier that asks others answers
off the scheduler's thread: "ask again"). What it counts, the request's plan delivers
(``kvtier.scheduler.manager.TierManager.plan_load``): each tier hit is staged through a host slot
and each evictable host hit is pinned, so a lookup counts no more of them than the host
pool's available slots less those other lookups were promised, and promises its own
until its request plans or goes away. It also remembers, per request, what the tiers
found (the plan uses it), whether its hits stopped for lack of a host slot, and how long
it has waited for a block that is being written to the host pool, or for a free slot.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from kvtier.scheduler.ledger import Ledger
from kvtier.tiers.base import ExistenceIndex, TierIndex
from kvtier.tiers.host import HostPoolIndex

HOST = "host"


class Lookups:
    def __init__(self, host: HostPoolIndex, tiers: Sequence[TierIndex], ledger: Ledger, wait_s: float):
        self.host = host
        self.tiers = list(tiers)
        # The tiers that other instances write: they answer from the tier itself, off the scheduler's
        # thread, and may say "ask again"; a plan uses what its request's lookup found there.
        self.asking = [tier for tier in self.tiers if isinstance(tier, ExistenceIndex)]
        self.ledger = ledger
        self.wait_s = wait_s  # the longest a lookup waits for a block being written to the host pool
        self._found: dict[str, list[dict[bytes, bool]]] = {}  # token -> per tier, what its last lookup found
        self._promised: dict[str, int] = {}  # token -> host slots its lookup counted on
        self._waiting_since: dict[str, float] = {}  # token -> when its lookup began waiting for a write
        self._slot_limited: set[str] = set()  # tokens whose last lookup's hits stopped for lack of host slots
        self._in_waves: set[str] = set()  # tokens whose last lookup's hits need more host slots than one wave has
        # Token -> the tiers whose load failed for it (a read that failed or timed out): its lookups ask
        # them no more, so vLLM loads from the other tiers or recomputes. Else a tier that answers for its
        # entries but cannot serve them (a pool too slow to read) would have the request loaded, failed
        # and rescheduled by vLLM for ever. Each failed load takes at least one tier out (all of them when
        # it was the host pool's copy that failed), so a request fails at most len(tiers) + 1 loads.
        self._failed: dict[str, set[str]] = {}

    def lookup(self, keys: Sequence[bytes], token: str | None = None,
               first_read: Callable[[int], int] | None = None) -> int | None:
        """Number of leading ``keys`` that some tier holds and that can be loaded now.

        ``first_read(n)``: of a hit of ``n`` leading keys, the first the engine reads (a sliding
        window's engine reads only the blocks within the window of the hit's next token); the keys
        before it need not be held. None: the engine reads every key of a hit.

        The host pool first, then each tier in order. While a tier that asks others has
        not answered, this returns None (ask again with the same ``token``); one that is
        down or silent counts as a miss. Where the hits stop at a block that is being
        written to the host pool (another request's store or load of the same prefix),
        this also returns None, for at most ``wait_s``: waiting a step for a copy beats
        recomputing it. So it does where a tier holds the first block but no host slot is free to
        stage it in (all pinned, being written or promised); ``wait_s`` past that, the request's
        miss is counted as ``no_free_host_slot``.
        """
        self._promised.pop(token, None)  # this lookup replaces the token's previous one
        local = self.host.lookup(keys)
        found: list[dict[bytes, bool]] = []
        failed = self._failed.get(token, ())
        if local < len(keys) and len(failed) < len(self.tiers):
            rest = keys[local:]
            # Every tier asked at once, but those the token's loads failed from (their entries count as misses).
            answers = [[False] * len(rest) if tier.name in failed else tier.lookup(rest, token) for tier in self.tiers]
            if any(answer is None for answer in answers):
                return None
            found = [dict(zip(rest, answer)) for answer in answers]
        start = 0 if first_read is None else self.window_start(keys, found, first_read)
        sources, first_wave, taken = self.walk(keys[start:], found)
        hits = start + len(sources) if first_wave else 0  # a hit loads in waves once its first wave has a block
        if token is None:
            return hits
        self._found[token] = found
        limited = bool(sources) and not first_wave  # found, but no slot
        (self._slot_limited.add if limited else self._slot_limited.discard)(token)
        (self._in_waves.add if first_wave < len(sources) else self._in_waves.discard)(token)
        # Found, but not one host slot to stage its first block in: every slot is pinned by a load or
        # store in flight, being written, or promised, and each frees as its job ends (a hit of one
        # block loads the rest in waves). Or the hits stop at a block being written to the host pool.
        # Either way, waiting a few steps beats recomputing the prompt.
        if (hits == 0 and limited) or (hits < len(keys) and self.host.is_being_written(keys[hits])):
            now = time.monotonic()
            if now - self._waiting_since.setdefault(token, now) < self.wait_s:
                return None
        self._waiting_since.pop(token, None)
        if taken:
            self._promised[token] = taken
        return hits

    def wait_for_answers(self, timeout_s: float) -> None:
        """An engine step that computes nothing: wait for the tiers' answers that lookups wait for
        (each tier in turn, all within ``timeout_s``) instead of asking again at once."""
        deadline = time.monotonic() + timeout_s
        for tier in self.asking:
            tier.wait_for_answers(deadline - time.monotonic())

    def source(self, key: bytes, found: list[dict[bytes, bool]]) -> str | None:
        """Where a block can be loaded from: "host", a tier's name, or None."""
        if self.host.lookup((key,)):
            return HOST
        if self.host.contains(key):  # being written to host: not readable, and cannot take a second slot
            return None
        for tier, tier_found in zip(self.tiers, found):
            if tier_found.get(key):
                return tier.name
        return None

    def in_one_wave(self, token: str) -> bool:
        """Whether the token's last lookup found host slots for all its hits at once (else they load
        in waves, ``walk``)."""
        return token not in self._in_waves

    def window_start(self, keys: Sequence[bytes], found: list[dict[bytes, bool]],
                     first_read: Callable[[int], int]) -> int:
        """Where the longest hit whose read keys are all held starts: ``first_read(n)`` of the largest
        ``n`` with keys ``first_read(n)`` to ``n`` held (vLLM's own sliding-window hit, the same way),
        its last key always among them. Its keys run on from there, so the hit is walked from it as
        any other."""
        run = best = 0  # held keys in a row, up to the n-th; the longest hit so far
        for n, key in enumerate(keys, 1):
            run = run + 1 if self.source(key, found) is not None else 0
            if run and n - run <= first_read(n):
                best = n
        return min(first_read(best), best - 1) if best else 0

    def slots_needed(self, key: bytes, source: str) -> int:
        """Host slots a plan takes for ``key``: a stage takes one, pinning an evictable host hit one."""
        return self.host.is_evictable(key) if source == HOST else 1

    def free_slots(self) -> int:
        """Host slots a plan could take now (free or evictable), less those lookups were promised."""
        return self.host.num_available - sum(self._promised.values())

    def walk(self, keys: Sequence[bytes], found: list[dict[bytes, bool]],
             host_only: bool = False) -> tuple[list[str], int, int]:
        """(where each leading loadable block of ``keys`` is read from, up to the first found nowhere
        or, ``host_only``, the first not in the host pool; how many of them a plan's first wave takes,
        as many as ``free_slots`` allow; the slots it takes). The rest goes in later waves, through the
        slots each wave frees (``kvtier.scheduler.load_waves``): a prompt larger than the host pool loads whole."""
        sources: list[str] = []
        end = taken = 0
        room = self.free_slots()
        for key in keys:
            source = self.source(key, found)
            if source is None or (host_only and source != HOST):
                break
            sources.append(source)
            need = self.slots_needed(key, source)
            if end == len(sources) - 1 and taken + need <= room:  # the first wave: contiguous from the start
                end, taken = end + 1, taken + need
        return sources, end, taken

    def found_for_plan(self, token: str, keys: Sequence[bytes],
                       found: list[dict[bytes, bool]] | None = None) -> list[dict[bytes, bool]]:
        """What each tier holds of ``keys``, for the token's plan: a tier that asks others, what the
        token's lookup found (a later wave: ``found``, its first wave's); the others are asked again
        now (an entry may have been evicted since). The lookup's promised slots are taken now."""
        remembered = self.take(token)
        remembered = found or remembered or [{} for _ in self.tiers]
        for tier in self.asking:  # the answer is used up: if this load fails, the next lookup asks again
            tier.forget(token)
        return [remembered[i] if tier in self.asking else dict(zip(keys, tier.lookup(keys, None)))
                for i, tier in enumerate(self.tiers)]

    def take(self, token: str) -> list[dict[bytes, bool]] | None:
        """What the token's lookup found, as its plan takes its slots now (its promise ends)."""
        self._promised.pop(token, None)
        self._waiting_since.pop(token, None)
        return self._found.pop(token, None)

    def miss_reason(self, key: bytes, token: str | None = None) -> str:
        """Why ``key`` (the first block a lookup did not find) is not loadable: the tier that
        evicted it, a damaged entry, a pool that was down or slow, no free host slot, or never
        stored (or stored under another namespace, which looks the same from here)."""
        if token is not None and token in self._slot_limited:
            return "no_free_host_slot"
        gone = self.ledger.gone(key)
        if gone is not None and not self.host.contains(key):
            return gone
        if token is not None and any(tier.unanswered(token) for tier in self.asking):
            return "pool_down_or_slow"
        return "never_stored"

    def can_arrive(self, token: str) -> bool:
        """Whether blocks that another instance stores can still reach the token's lookups: some tier
        that answers from the storage itself (a pool, a shared directory) answered its last lookup and
        has not failed a load of it."""
        failed = self._failed.get(token, ())
        return any(tier.name not in failed and not tier.silent(token) for tier in self.asking)

    def load_failed(self, token: str, tiers: Iterable[str]) -> None:
        """The token's load failed from these tiers: its later lookups ask them no more. Where only
        the host pool's copies failed (``tiers`` empty), they ask no tier: host hits only."""
        tiers = set(tiers) or {tier.name for tier in self.tiers}
        self._failed.setdefault(token, set()).update(tiers)

    def forget(self, token: str) -> None:
        """Drop what the token's lookup remembered (a request that went away)."""
        self.take(token)
        self._slot_limited.discard(token)
        self._in_waves.discard(token)
        self._failed.pop(token, None)
