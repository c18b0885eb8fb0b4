"""The tier interface, in two halves. Torch-free.

A tier below the host pool (local disk, a shared directory, a storage pool) is
two objects that never meet:

- a ``TierIndex`` in the scheduler: which blocks the tier holds, pins for loads
  in flight, room for stores, eviction, counters. It answers from memory, or
  says "ask again" while an answer is being fetched off the scheduler's thread.
- a ``TierStore`` in kvtier's I/O process: reads entries into host slots and
  writes them from host slots, one outcome per block. Framing, checksums and
  deadlines live here, never on the engine's interpreter.

Both are built from a ``TierSpec`` by the tier's module (``kvtier.tiers.registry``
maps a configuration to modules). The manager and the worker walk the ordered
list of tiers and name none of them.
"""

from __future__ import annotations

import errno
import importlib
import os
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable
from urllib.parse import parse_qs, urlparse

# The contract's outcomes, which every tier module takes from here.
from kvtier.common.outcomes import Miss, bad, full, gone, unavailable  # noqa: F401
from kvtier.common.redact import redact
from kvtier.common.units import parse_bytes
from kvtier.tiers.audit import StoredAudit


# Errors that the next write will meet too: the device is full, read-only or failing.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_LASTING_ERRNOS = FULL_ERRNOS | {errno.EROFS, errno.EFBIG, errno.EIO}


class WriteBackOff:
    """A filesystem tier's writes after a lasting error (ENOSPC, EROFS, ...): skipped at once
    for ``pause_s``, then tried again, instead of failing one by one against the device."""

    def __init__(self, pause_s: float = 30.0, full_pause_s: float | None = None):
        self.pause_s = pause_s
        self.full_pause_s = pause_s if full_pause_s is None else full_pause_s  # after ENOSPC or EDQUOT
        self._until = 0.0
        self._why = ""
        self._full = False  # the pause is for a full device
        self.num_pauses = 0

    def skipped(self) -> Miss | None:
        """Why a write is skipped now, or None to try it."""
        left = self._until - time.monotonic()
        if left <= 0:
            return None
        return (full if self._full else unavailable)(f"write skipped: tier paused for {left:.0f} s after {self._why}")

    def failed(self, error: BaseException) -> Miss:
        """A write raised ``error``: its outcome, errno named; a lasting error pauses the writes."""
        code = getattr(error, "errno", None)
        why = f"{errno.errorcode.get(code, code)}: {getattr(error, 'strerror', None) or error}" if code else repr(error)
        is_full = code in FULL_ERRNOS
        pause_s = self.full_pause_s if is_full else self.pause_s
        if code in _LASTING_ERRNOS and pause_s > 0:
            self._why, self._full, self._until = why, is_full, time.monotonic() + pause_s
            self.num_pauses += 1
        return (full if is_full else unavailable)(f"write failed: {why}")


def pwritev_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write all of ``buffers`` at ``offset``: a short write is continued, so that a full device
    raises its own errno (ENOSPC) rather than passing for a write. The error carries the bytes
    written before it (``written``)."""
    left = sum(b.nbytes for b in buffers)
    first = done = 0
    while left:
        try:
            written = os.pwritev(fd, buffers[first:] if first else buffers, offset)
            if written == 0:
                raise OSError(f"no progress writing at {offset}")
        except OSError as error:
            error.written = done
            raise
        offset, left, done = offset + written, left - written, done + written
        while left and written >= buffers[first].nbytes:  # a short write: on from where it stopped
            written -= buffers[first].nbytes
            first += 1
        if left and written:
            buffers[first] = buffers[first][written:]


def directory_url(url: str, what: str, example: str) -> tuple[str, int | None]:
    """A tier URL that names a local directory (``disk:///var/cache/kvtier?max_bytes=100GiB``): its
    path, as written, and its bound (None: none given). ``what`` and ``example`` word the errors."""
    parsed = urlparse(url)
    scheme = f"{parsed.scheme}://"
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"a {scheme} URL names {what} ({scheme}/path), not host {parsed.netloc!r}")
    if not parsed.path.startswith("/"):
        raise ValueError(f"a {scheme} URL needs an absolute path: {scheme}{example}")
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    unknown = set(query) - {"max_bytes"}
    if unknown:
        raise ValueError(f"unknown {scheme} option(s) {sorted(unknown)}; known: max_bytes")
    bound = parse_bytes(query["max_bytes"]) if "max_bytes" in query else None
    if bound is not None and bound <= 0:
        raise ValueError("max_bytes must be > 0")
    return parsed.path, bound


# What one I/O job moves by default: a load's jobs are copied to the device as each lands, while
# the I/O process reads the next. A tier whose every call costs much besides its bytes (a
# storage pool's round trips to its server) declares a larger ``job_bytes`` in its ``TierKind``.
JOB_BYTES = 4 << 20


@dataclass(frozen=True)
class TierSpec:
    """What both halves of one tier are built from. Plain data: it crosses to the I/O process."""

    name: str  # the tier's name in plans, reports, metrics and logs: "disk", "file", "redis", "mooncake"
    module: str  # the module that builds its halves (``make_index``, ``make_store``)
    location: str  # a directory or a URL
    capacity_bytes: int | None = None  # None: unbounded (the store's own limits apply)
    timeout_s: float = 2.0
    retry_s: float = 10.0
    threads: int = 2
    options: dict = field(default_factory=dict)
    job_bytes: int = JOB_BYTES  # about what one I/O job of this tier moves (its kind's ``job_bytes``)

    @property
    def kind(self) -> "TierKind":
        """What the tier's module declares about it (``KIND``)."""
        return importlib.import_module(self.module).KIND


@dataclass(frozen=True)
class TierKind:
    """What a tier module declares about its tiers, as its ``KIND``: how their halves are built,
    and everything the code around the core asks of a tier (KV events, ``kvtier doctor``,
    namespace records), so that no tier name is compared outside ``kvtier/tiers``. The
    registry maps URL schemes to modules; nothing else is needed to add a tier.

    Required: ``name`` and the two builders. The rest says what the tier can do; None is
    "cannot" and the caller does without it."""

    name: str  # a tier's name by default ("disk"); a second one of the kind is "disk2", or its ``name=``
    make_index: Callable[["TierSpec", int, Sequence[bytes]], "TierIndex"]  # (spec, slot_bytes, rank fingerprints)
    make_store: Callable[["TierSpec", bytes, int], "TierStore"]  # (spec, rank fingerprint, slot_bytes)
    # Other instances read and write it: KV events announce its blocks as REMOTE, owned by the pool's
    # address (the same string on every instance), and removals are told only when a load meets them.
    shared: bool = False
    medium: str = "STORAGE"  # vLLM's KV events ``medium`` of its blocks
    # A shared tier's identity in KV events: its address without credentials or options, the same
    # string on every instance that reads it.
    address: Callable[["TierSpec"], str] = lambda spec: redact(f"{urlparse(spec.location).hostname}:"
                                                               f"{urlparse(spec.location).port}")
    job_bytes: int | None = None  # about what one I/O job moves; None: the default (``JOB_BYTES``)
    # From a ``tiers`` URL with kvtier's own options taken out: (location, capacity in bytes or None).
    # None: the URL is the location, unbounded (the store's own limits apply).
    place: Callable[[str], tuple[str, int | None]] | None = None
    validate: Callable[[str], None] | None = None  # raise ValueError, saying why, for a URL it cannot use
    # The directory the tier keeps entries in, for ``kvtier doctor``'s check of room and rights; None: none.
    directory: Callable[["TierSpec"], str] | None = None
    probe_spec: Callable[["TierSpec", bytes, int], "TierSpec"] | None = None  # a spec for doctor's one-block probe
    notices: Callable[["TierSpec"], str] | None = None  # doctor: when routers hear of what the tier drops
    # Namespace records (``kvtier.tiers.namespaces``) and questions asked as a process outside the engine.
    write_record: Callable[["TierSpec", dict], bool] | None = None
    read_records: Callable[["TierSpec"], list] | None = None
    held_from_outside: Callable[["TierSpec", int, Sequence[bytes], Sequence[bytes]], set] | None = None
    release_outside: Callable[["TierSpec"], None] | None = None
    # Its server publishes its blocks' KV events once for every engine that uses it: (spec, the first rank's
    # fingerprint) -> a sender of [(key, its stored event, its removed event)] (encoded), with ``close()``.
    # Engines publish none of their own for the tier, and hand it theirs (off the scheduler's thread).
    announcer: Callable[["TierSpec", bytes], Callable] | None = None


class TierIndex(ABC):
    """The scheduler's half. Calls come from one thread (the scheduler's).

    The contract is ``lookup`` (abstract), ``prepare_load``/``complete_load``,
    ``prepare_store``/``complete_store``, ``stats`` and ``close``; each has a default that
    suits a tier which keeps no list of its own. An index tells what became loadable from
    it and what stopped being in ``holdings``, where the manager set one."""

    name: str
    # Where the index tells what became loadable from it and what stopped being, and why:
    # ("stored" | "evicted" | "damaged", tier name, key). The manager drains it (miss reasons,
    # KV events). None: not told.
    holdings: list | None = None

    @abstractmethod
    def lookup(self, keys: Sequence[bytes], token: str | None) -> list[bool] | None:
        """Which of ``keys`` the tier holds, one flag per key, at once, from the index's own list. A
        tier that other instances write answers from the tier itself instead, off the scheduler's
        thread: ``ExistenceIndex``, whose lookup may say None, "ask again" (same ``token``); with
        ``token`` None it answers every key a miss at once (a guess, or a plan's second look).

        Per key rather than a count: a loadable prefix may mix tiers (block 0 on disk,
        block 1 only in the pool), and the manager walks it block by block."""

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Keep these entries loadable until ``complete_load`` (pin them against eviction); returns
        where the tier keeps each, for its store (-1: the store finds it by key)."""
        return [-1] * len(keys)

    def complete_load(self, keys: Sequence[bytes], bad_keys: Sequence[bytes] = (),
                      gone_keys: Sequence[bytes] = ()) -> None:
        """The loads of ``keys`` are over; ``bad_keys`` were found corrupt or foreign (a ``BAD``
        miss), ``gone_keys`` no longer there (``GONE``: evicted or expired since the lookup)."""

    def prepare_store(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        """Reserve room; returns the keys to write (those the tier does not hold, that fit), in
        order, each with where the tier keeps it, for its store (-1: the store finds it by key)."""
        return dict.fromkeys(keys, -1)

    def complete_store(self, written: Sequence[bytes], failed: Sequence[bytes] = (),
                       deleted: Sequence[bytes] = (), full: bool = False) -> None:
        """The writes of ``written`` landed; those of ``failed`` did not. ``deleted``: entries the
        tier's store deleted meanwhile to stay within its bound (``SharedStore.take_deleted``).
        ``full``: a write found no room on the tier's filesystem (a ``FULL`` miss), short of the
        tier's own bound: an index that keeps a list holds at most what it holds now."""
        if self.holdings is not None:
            self.holdings += [("evicted", self.name, key) for key in deleted]

    def stats(self) -> dict[str, int]:
        """Counters for metrics and reports (``entries``, ``evictions``, ...)."""
        return {}

    def close(self) -> None:
        return None


@runtime_checkable
class ListedIndex(Protocol):
    """An index of this instance's own tier that finds its entries again after a restart (the
    local disk) may also say what it holds, for the KV events' journal (``listing``): a path
    beside its entries, and the keys it holds now. An index without it keeps no list across
    restarts, and a restart announces none of its blocks."""

    def listing(self) -> tuple[str, set[bytes]]: ...


class TierStore(ABC):
    """The I/O process's half. Calls come from the I/O process's threads, concurrently.

    The contract is ``read_into`` and ``write_from`` (abstract) and ``close``: each answers
    one outcome per block, None (done) or a ``Miss`` (``kvtier.common.outcomes``).

    ``attach`` hands it the host pool, mapped in the I/O process, before any job: an array of
    ``num_slots`` rows of ``slot_bytes``, and where each slot has a head right before it
    (``kvtier.common.host_slots``), those as ``num_slots`` rows of ``HEADER_BYTES``. Jobs name
    slots by row."""

    host = None
    heads = None  # a slot's head: where a store may put the header of the entry it moves
    mac_key: bytes | None = None  # entries are tagged and checked with this key (``entry_key_file``)

    def attach(self, host_slots, heads=None) -> None:
        self.host, self.heads = host_slots, heads

    @abstractmethod
    def read_into(self, keys: Sequence[bytes], slot_ids: Sequence[int], locations: Sequence[int],
                  deadline: float, check: bool = True) -> list[Miss | int | None]:
        """Read each key's entry (at the index's location) into its slot; per block None (the slot
        holds the block) or a ``Miss``. ``check`` False: the caller checks plain entries' checksums
        (a load's copy to the device takes them as it reads the slots): such an entry's payload is
        not read here, and its outcome is the checksum its header holds
        (``kvtier.common.entry.check_entry``)."""

    @abstractmethod
    def write_from(self, keys: Sequence[bytes], slot_ids: Sequence[int], locations: Sequence[int],
                   deadline: float, checksums: Sequence[int] | None = None) -> list[Miss | None]:
        """Write each slot as its key's entry; per block None (stored) or a ``Miss``. ``checksums``,
        where the worker sends them, are the slots' xxh3-64, taken by the copy that filled them
        (``kvtier.common.entry.encode_header``'s ``check``): the store then does not read the slots to take them."""

    def close(self) -> None:
        return None


class SharedStore(TierStore):
    """A store of a tier that outlives this instance and that others may write (a storage pool, a
    shared directory): what the I/O process may ask of it besides the contract. Each default
    suits a store that cannot do it."""

    num_down = 0  # times the store's client was marked down (a storage pool)

    def connect(self) -> None:
        """Called once, on a thread of its own, when the I/O process is up: a store with a client
        connects it here, so that the first job does not wait for it."""

    def exists(self, names: Sequence[str]) -> list[bool] | None:
        """Asked by its index through a lookup process: whether each name is stored; None if the
        store could not ask."""
        raise NotImplementedError(f"{type(self).__name__} answers no existence checks")

    def watch_gone(self, tell: Callable[[list[str]], None],
                   held: Callable[[list[str] | None, bool], None] | None = None) -> None:
        """In an index's lookup process: where the tier's server says which entries it drops on its
        own (evicts, expires), call ``tell(names)`` with those of this instance's names, from a
        thread of the store's own, as they come; where it also says which it holds, ``held(names,
        complete)`` (``kvtier.tiers.node.watch_gone``). Most tiers cannot say: nothing to do."""

    def take_deleted(self) -> list[bytes]:
        """Keys of the entries this store deleted to stay within its size bound since the last call
        (a store that evicts on the I/O side: the shared directory); its index hears of them
        (``TierIndex.complete_store``'s ``deleted``)."""
        return []


POLL_S = 0.0002  # how often a wait asks a check that cannot wake it (a shared directory's native thread)


def _poll_until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def index_timings(spec: TierSpec) -> dict:
    """The ``ExistenceIndex`` timings that a shared tier's spec sets (``remote_audit_s``,
    ``remote_answer_s``); those it leaves out keep the index's defaults."""
    return {name: spec.options[name] for name in ("audit_s", "answer_s") if name in spec.options}


class ExistenceIndex(TierIndex):
    """An index for a tier that other instances write too (a shared directory, a storage
    pool): it holds no list of its own, it asks the tier, off the scheduler's thread.

    ``start(keys)`` asks and returns at once an object whose ``done()`` says whether the
    answer is in and ``result()`` gives it: one bool per key, or None where the tier gave
    none. Neither may wait, nor need a thread of this process to take the GIL: in vLLM's
    one-process layout the engine's busy loop holds it (the shared directory asks on a
    native thread, a storage pool through a lookup process). ``lookup`` returns the
    answer once it has arrived, None while it is pending, and all-False once
    ``timeout_s`` passed without one: a tier that does not answer is a miss, never a
    wait. At most ``max_pending`` checks wait for an answer; lookups past them, or
    checks that cannot start (``OSError``), are misses at once, never a queue. Entries
    that failed to load are misses for a while, or the engine would ask for the same
    broken entry again and again. An engine step with nothing to compute may wait for the
    pending answers instead of asking again at once (``wait_for_answers``, bounded).

    An answer stands for ``answer_s`` (``remote_answer_s``, 1 s by default): the same
    token asking about the same keys again within it gets it at once. vLLM asks again
    every step for a request it could not schedule (no room left in its KV cache, or a
    block of the prefix still being written to the host pool): without this, each such
    step would send the tier a new check and get "ask again" while it runs, so the
    request would also sit out every other step. A hit gone stale meanwhile costs a
    failed load (recompute), a miss one block recomputed. A plan uses the answer up
    (``forget``): after a failed load, the request's next lookup asks the tier again.

    A tier whose server tells what it holds as it changes (the node server) answers from that at
    once, asking nothing (``_known``).
    """

    DEFER_S = 60.0  # the longest a notice waits for the report of this instance's write of its key

    def __init__(self, name: str, start: Callable[[list[bytes]], Any], timeout_s: float,
                 failed_ttl_s: float = 30.0, max_pending: int = 64, audit_s: float = 0.0,
                 wait: Callable[[Callable[[], bool], float], Any] | None = None, answer_s: float = 1.0):
        self.name = name
        self.answer_s = answer_s
        self._start = start
        # wait(done, timeout_s): block until done() or the timeout (a lookup process's ``wait_until``);
        # by default done() is asked every ``POLL_S``, sleeping between.
        self._wait = wait or _poll_until
        self.num_waits = 0  # idle engine steps that waited for this tier's answers
        self.timeout_s = timeout_s
        self._max_pending = max_pending
        self.num_overdue = 0
        self.num_refused = 0
        self._unanswered: set[str] = set()  # tokens whose last lookup the tier did not answer (down, slow, busy)
        self._silent: set[str] = set()  # of those, the ones it could not answer (down, or past ``timeout_s``)
        self._failed_ttl_s = failed_ttl_s
        self._pending: dict[str, tuple[tuple[bytes, ...], float, Any]] = {}
        self._failed: dict[bytes, float] = {}  # key -> until when it is a miss
        self._answered: dict[str, tuple[tuple[bytes, ...], float, list | None]] = {}  # token -> (keys, when, found)
        self.num_checks = 0  # checks sent to the tier
        self.num_bad_entries = 0
        # Keys the tier's server dropped on its own, told from another thread (``told_gone``), taken in
        # on the scheduler's (``absorb_news``). A deque: appends and pops need no lock across threads.
        # Bounded: an engine that takes no step for long keeps the latest news only, as the ledger does.
        self._news: deque[bytes] = deque(maxlen=200_000)
        # This instance's writes planned and not yet reported, per key: news of such a key is about the
        # entry that write made (its report comes with a later engine step), so it is told after it.
        self._writing: Counter[bytes] = Counter()
        self._deferred: list[tuple[bytes, float]] = []  # (key, when heard) held back for a write's report
        self.num_told_gone = 0
        self.num_deleted = 0  # by this instance's store, to stay within the tier's bound
        # What the tier drops in silence (Mooncake's evictions, another instance's bound) is found by
        # asking it about the blocks this instance stored, every ``audit_s`` (0: never).
        self.audit = StoredAudit(start, audit_s, timeout_s) if audit_s > 0 else None

    def lookup(self, keys, token):
        keys = tuple(keys)
        if not keys:
            return []
        if token is None:
            return [False] * len(keys)  # no token, no later call to answer: the tier is skipped
        known = self._known(keys)
        if known is not None:  # the tier's server told what it holds: an answer now, no check, no "ask again"
            self._pending.pop(token, None)
            self._unanswered.discard(token)
            self._silent.discard(token)
            return self._usable(keys, known)
        entry = self._pending.get(token)
        if entry is None or entry[0] != keys:
            answered = self._answered.get(token)
            if answered is not None and answered[0] == keys and time.monotonic() - answered[1] < self.answer_s:
                return self._usable(keys, answered[2])
            if len(self._pending) >= self._max_pending:
                return self._busy(keys, token)
            try:
                pending = self._start(list(keys))
            except OSError:  # no check can start now (too many still running): a miss, never a wait
                return self._busy(keys, token)
            self._pending[token] = (keys, time.monotonic(), pending)
            self.num_checks += 1
            return None
        _, began, check = entry
        if not check.done():
            waited = time.monotonic() - began
            if waited <= self.timeout_s:
                return None
            del self._pending[token]
            self.num_overdue += 1
            self._unanswered.add(token)
            self._silent.add(token)
            return [False] * len(keys)
        del self._pending[token]
        try:
            found = check.result()
        except Exception:  # a failed existence check is a miss; the tier's own breaker logs it
            found = None
        for tokens in (self._unanswered, self._silent):
            (tokens.add if found is None else tokens.discard)(token)
        if len(self._answered) >= 4 * self._max_pending:  # tokens that never came back (forget() drops the rest)
            now = time.monotonic()
            self._answered = {t: a for t, a in self._answered.items() if now - a[1] < self.answer_s}
        self._answered[token] = (keys, time.monotonic(), found)
        return self._usable(keys, found)

    def _known(self, keys: tuple[bytes, ...]) -> list[bool] | None:
        """Whether each key is stored, as far as this index was told it unasked (one bool per key), or
        None: the tier is to be asked. Most tiers tell nothing: asked."""
        return None

    def wait_for_answers(self, timeout_s: float) -> None:
        """An engine step with nothing to compute while lookups wait for this tier ("ask again"):
        wait for their answers, at most ``timeout_s``, without the GIL."""
        checks = [check for _, _, check in self._pending.values()]
        if checks and timeout_s > 0:
            self.num_waits += 1
            self._wait(lambda: all(check.done() for check in checks), timeout_s)

    def _busy(self, keys, token):
        """No check could start for ``token``: a miss, never a wait, and no verdict on the tier."""
        self.num_refused += 1
        self._unanswered.add(token)
        self._silent.discard(token)  # busy is not silent: the tier may answer the next lookup
        return [False] * len(keys)

    def _usable(self, keys, found):
        """The tier's answer, less the entries that failed to load since (misses for a while)."""
        if found is None:
            return [False] * len(keys)
        now = time.monotonic()
        return [bool(hit) and self._failed.get(key, 0.0) <= now for key, hit in zip(keys, found)]

    def prepare_store(self, keys):
        self._writing.update(keys)
        return super().prepare_store(keys)

    def complete_store(self, written, failed=(), deleted=(), full=False):
        for key in (*written, *failed):  # released where the host slots are: every job ends in a report
            if self._writing[key] > 1:
                self._writing[key] -= 1
            else:
                self._writing.pop(key, None)
        if self.holdings is not None:
            self.holdings += [("stored", self.name, key) for key in written]
        if self.audit is not None:
            self.audit.stored(written)
        if written and self._answered:  # an answer that missed what this instance just wrote stands no more
            written = set(written)
            self._answered = {token: answer for token, answer in self._answered.items()
                              if answer[2] is None or not any(not hit and key in written
                                                             for key, hit in zip(answer[0], answer[2]))}
        if deleted:  # this instance's store deleted them for the tier's bound: told here, no audit finds them again
            if self.audit is not None:
                self.audit.let_go(deleted)
            self.num_deleted += len(deleted)
            super().complete_store((), (), deleted)

    def complete_load(self, keys, bad_keys, gone_keys=()):
        if self.holdings is not None:  # a damaged entry is not offered again: not loadable from here
            self.holdings += [("damaged", self.name, key) for key in bad_keys]
            # Evicted by another instance or by the store itself: the fleet hears that it is gone, and a
            # later miss of it is explained as evicted from this tier. Stored again, it is offered again.
            self.holdings += [("evicted", self.name, key) for key in gone_keys]
        if self.audit is not None:
            self.audit.let_go([*bad_keys, *gone_keys])
        until = time.monotonic() + self._failed_ttl_s
        for key in bad_keys:
            self._failed[key] = until
        self.num_bad_entries += len(bad_keys)
        if len(self._failed) > 100_000:
            now = time.monotonic()
            self._failed = {k: t for k, t in self._failed.items() if t > now}

    def told_gone(self, keys: Sequence[bytes]) -> None:
        """Any thread: the tier's server evicted or expired these entries."""
        self._news.extend(keys)

    def absorb_news(self) -> None:
        """Take in, on the scheduler's thread, what the tier said unasked since the last call (a
        storage pool's own evictions): the ledger calls it before it reads ``holdings``."""
        found_gone = self.audit.step() if self.audit is not None else []
        if found_gone:
            self._drop_gone(found_gone)
        if not self._news and not self._deferred:  # the usual step: nothing told
            return
        now = time.monotonic()
        # A server's notice can come before the report of the write it is about (an entry that expired
        # soon after this instance wrote it): told after that write's "stored", in the order they
        # happened, or a router would hear it removed, then stored. A write never reported (its worker
        # died) holds its news back for DEFER_S at most.
        heard = self._deferred + [(self._news.popleft(), now)  # the other thread only appends
                                  for _ in range(len(self._news))]
        self._deferred = [(key, when) for key, when in heard if key in self._writing and now - when < self.DEFER_S]
        held_back = {key for key, _ in self._deferred}
        keys = [key for key, _ in heard if key not in held_back]
        if not keys:
            return
        if self.audit is not None:  # what an audit found gone already was told then
            keys = self.audit.news(keys)
        self.num_told_gone += len(keys)
        # The fleet hears it now, not when a load finds the entry gone. The tier told only entries it
        # did not hold when asked after the eviction; a store of the block landing between that answer
        # and this step still meets a removal told after it: a router may then pass over a hit (the
        # safe side of being wrong); lookups ask the tier itself, so no load is lost either way.
        self._drop_gone(keys)

    def _drop_gone(self, keys: Sequence[bytes]) -> None:
        if self.holdings is not None:
            self.holdings += [("evicted", self.name, key) for key in keys]
        dropped = set(keys)  # an answer that found one of them stands no more: the next lookup asks again
        self._answered = {token: answer for token, answer in self._answered.items()
                          if answer[2] is None or not any(hit and key in dropped
                                                         for key, hit in zip(answer[0], answer[2]))}

    def stats(self) -> dict[str, int]:
        """Entries this instance deleted for the tier's bound, and those the tier dropped on its own, as
        its server told them or an audit found them."""
        found = self.audit.num_found_gone if self.audit is not None else 0
        return {"evictions": self.num_deleted + self.num_told_gone + found}

    def unanswered(self, token: str) -> bool:
        """The tier did not answer ``token``'s last lookup (down, slow or busy): its miss is no verdict."""
        return token in self._unanswered

    def silent(self, token: str) -> bool:
        """The tier could not answer ``token``'s last lookup (down, or past its timeout); busy is not silent."""
        return token in self._silent

    def forget(self, token: str) -> None:
        """A request went away, or a plan used its lookup: drop what its lookups remembered."""
        self._pending.pop(token, None)
        self._answered.pop(token, None)
        self._unanswered.discard(token)
        self._silent.discard(token)

    def close(self):
        self._pending.clear()
        self._answered.clear()
