"""What the storage-pool tiers (Mooncake Store, Redis/Valkey) share. Torch-free.

A storage pool is a tier that many instances reach. Its module (``mooncake``,
``redis``) provides a ``PoolClient``: batched existence checks, puts and gets of
whole entries (the ``kvtier.common.entry`` header, then the slot's bytes). This module
turns a client into the tier's two halves:

- the index (scheduler): existence asked off the scheduler's thread, through a
  store in a lookup process of its own (``ExistenceIndex``, ``make_pool_index``);
- the store (I/O process): ``PoolStore`` frames and checks entries, reading into
  and writing from the host pool directly where the client allows (Mooncake
  registers the mapping and moves bytes with no copy).

Keys in the pool are ``kvtier/<rank fingerprint hex>/<key hex>``: two models, two
layouts or two ranks never read each other's blocks. A pool that is down or slow
never stalls anything: each client sits behind a ``GuardedClient``, whose failed or
too-slow call marks the pool down for ``remote_retry_s``, during which calls are
misses at once; the next call after that reconnects.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable, Sequence

import numpy as np
import xxhash

from kvtier.common.entry import HEADER_BYTES, check_entry, encode_header
from kvtier.common.redact import redact
from kvtier.io.messages import Held
from kvtier.tiers.base import ExistenceIndex, Miss, SharedStore, TierSpec, bad, gone, index_timings, unavailable

logger = logging.getLogger("kvtier.pool")


def pool_key(rank_fingerprint: bytes, key: bytes) -> str:
    return f"kvtier/{rank_fingerprint.hex()}/{key.hex()}"


class PoolUnavailable(Exception):
    """The pool did not answer in time, or refused the call."""


class PoolClient(ABC):
    """One backend's client. Calls may raise; ``GuardedClient`` turns that into misses."""

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def put(self, names: Sequence[str], headers: Sequence[memoryview], payloads: Sequence[memoryview]) -> list[bool]:
        """Store header + payload under each name; True where it is stored. ``headers`` and
        ``payloads`` are ``Spans`` where they lie in the host pool (a store's calls)."""

    @abstractmethod
    def get_into(self, names: Sequence[str], headers: Sequence[memoryview],
                 payloads: Sequence[memoryview]) -> list[bool | None]:
        """Read each value into its header and payload buffers: True where it was read whole, None
        where there is no such value (evicted, expired, never put), False where it is there but not
        exactly that long, or not a plain value. The buffers are ``Spans`` as ``put``'s are."""

    def register(self, address: int, num_bytes: int) -> None:
        """Offer host memory for zero-copy transfers (a no-op where unsupported)."""

    def abort(self) -> None:
        """Make the calls in flight fail now, from another thread (a no-op where a call cannot be cut)."""

    def close(self) -> None:
        return None


class _Lease:
    """One connected client and the calls inside it. A client that failed is retired: no new
    call gets it, and it is closed by whoever leaves it last, never under a call in flight
    (closing a Mooncake client under a batch call crashes the process)."""

    __slots__ = ("client", "calls", "retired")

    def __init__(self, client: PoolClient):
        self.client, self.calls, self.retired = client, 0, False


READS = ("exists", "get_into")  # what a request waits on: cut at timeout_s (a write only holds its slots)


class GuardedClient:
    """A pool client behind a circuit breaker. Thread-safe.

    At most ``max_calls`` calls are inside the client at once: a pool that hangs holds
    that many threads, and every call past them is a miss at once, never a queue. A read
    still in flight at ``timeout_s`` is cut there (where the client can cut a call): a pool
    that trickles its answer in keeps each socket read inside the client's own timeout,
    so without this one read could last many times ``timeout_s``."""

    def __init__(self, url: str, connect: Callable[[], PoolClient], timeout_s: float, retry_s: float,
                 max_calls: int = 8):
        self.url = url
        self._connect = connect
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.max_calls = max_calls
        self._lease: _Lease | None = None
        self._connecting = False
        self._started: dict[int, float] = {}  # call -> when it began, for the calls in flight
        self._call_ids = itertools.count()
        self._calls = 0  # in every lease, retired ones included
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._connected = threading.Condition(self._lock)  # a connect ended (well or not)
        self._registered: list[tuple[int, int]] = []
        self.num_failures = 0
        self.last_error = ""  # why the pool was last marked down (passwords redacted)
        self.num_refused = 0  # calls turned away because max_calls were in flight
        self.num_cut = 0  # reads cut at timeout_s
        self._reads: dict[int, tuple[float, _Lease]] = {}  # read in flight -> (its deadline, its lease)
        self._read_started = threading.Condition(self._lock)
        self._watchdog: threading.Thread | None = None
        self._closed = False

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    @property
    def calls_in_flight(self) -> int:
        return self._calls

    def _acquire(self) -> _Lease:
        with self._lock:
            # Another thread is connecting: wait for it (the lock is free meanwhile), at most timeout_s.
            deadline = time.monotonic() + self.timeout_s
            while self._lease is None and self._connecting and self.available:
                if not self._connected.wait(deadline - time.monotonic()):
                    self.num_refused += 1
                    raise _Busy("connecting")
            if not self.available:
                raise PoolUnavailable(f"marked down for another {self._down_until - time.monotonic():.1f} s")
            if self._calls >= self.max_calls:
                self.num_refused += 1
                raise _Busy(f"{self._calls} calls in flight")
            if self._lease is not None:
                self._lease.calls += 1
                self._calls += 1
                return self._lease
            self._connecting = True  # one connect at a time, outside the lock: a hung connect holds
            # one thread, never the lock that marking the pool down (from any thread) needs
        try:
            client = self._connect()
            for address, num_bytes in self._registered:
                client.register(address, num_bytes)
        except BaseException:
            with self._lock:
                self._connecting = False
                self._connected.notify_all()
            raise
        with self._lock:
            self._connecting = False
            self._connected.notify_all()
            lease = _Lease(client)
            if not self.available:  # marked down while connecting: this client is not used
                lease.retired = True
            else:
                self._lease = lease
                back = self.num_failures > 0  # after an outage: said once, as its start was
            lease.calls += 1
            self._calls += 1
        if not lease.retired and back:
            logger.warning("kvtier: storage pool %s is back; using it again", redact(self.url))
        return lease

    def connect(self) -> None:
        """Connect now rather than in the first call: a client's setup (Mooncake's registers its
        segments) would otherwise delay a new process's first job. A failure marks the pool down, as a
        call's would."""
        lease = self._try_acquire()
        if lease is not None:
            self._release(lease)

    def _try_acquire(self) -> _Lease | None:
        """A lease, or None: busy (``max_calls`` in flight, or a connect taking too long), down, or
        the connect failed (which marks the pool down)."""
        try:
            return self._acquire()
        except _Busy:
            return None
        except Exception as error:  # down, or the connect failed
            if self.available:
                self.mark_down(error)
            return None

    def _release(self, lease: _Lease) -> None:
        with self._lock:
            lease.calls -= 1
            self._calls -= 1
            close = lease.retired and lease.calls == 0
        if close:
            close_quietly(lease.client)

    def register(self, address: int, num_bytes: int) -> None:
        self._registered.append((address, num_bytes))
        if self._lease is not None:
            self._lease.client.register(address, num_bytes)

    def mark_down(self, error: BaseException | str) -> None:
        """Skip the pool for ``retry_s`` and retire its client (closed when its last call leaves)."""
        with self._lock:
            was_up = self.available
            self.num_failures += was_up  # outages: a call that fails while the pool is down is no new one
            self.last_error = redact(error)
            self._down_until = time.monotonic() + self.retry_s
            lease, self._lease = self._lease, None  # the next call after the pause reconnects
            close = lease is not None and lease.calls == 0
            if lease is not None:
                lease.retired = True
            self._connected.notify_all()  # callers waiting for a connect: the pool is down now
        if was_up:  # one line per outage, not one per call that finds it
            logger.warning("kvtier: storage pool %s failed (%s); using the other tiers for %.0f s",
                           redact(self.url), redact(error), self.retry_s)
        if close:
            close_quietly(lease.client)

    def _mark_down_if_overdue(self) -> None:
        """A call in flight past ``timeout_s`` marks the pool down now, not when it returns: the
        calls after it do not queue behind a pool that has stopped answering."""
        with self._lock:
            oldest = min(self._started.values(), default=None)
        if oldest is not None and self.available and time.monotonic() - oldest > self.timeout_s:
            self.mark_down(PoolUnavailable(f"a call in flight for {time.monotonic() - oldest:.2f} s"))

    def call(self, method: str, *args) -> list | None:
        """``client.<method>(*args)``, or None if the pool is down, busy, or the call failed."""
        self._mark_down_if_overdue()
        call_id = next(self._call_ids)
        lease = self._try_acquire()
        if lease is None:
            return None
        try:
            began = self._started[call_id] = time.monotonic()
            if method in READS:
                self._watch(call_id, began + self.timeout_s, lease)
            result = getattr(lease.client, method)(*args)
            elapsed = time.monotonic() - began
            if elapsed > self.timeout_s:  # answered, but too slowly to keep using for now
                self.mark_down(PoolUnavailable(f"{method} took {elapsed:.2f} s"))
            return result
        except Exception as error:  # any client error is a failed call: fall back, never crash
            if not lease.retired:  # a retired client's error (one cut, one already failed) is no news
                self.mark_down(error)
            return None
        finally:
            self._started.pop(call_id, None)
            if method in READS:
                with self._lock:
                    self._reads.pop(call_id, None)
            self._release(lease)

    def _watch(self, call_id: int, deadline: float, lease: _Lease) -> None:
        with self._lock:
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._cut_overdue_reads, daemon=True,
                                                  name="kvtier-pool-watchdog")
                self._watchdog.start()
            if not self._reads:
                self._read_started.notify()  # the watchdog waits for no deadline: this is its next
            self._reads[call_id] = (deadline, lease)

    def _cut_overdue_reads(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                due = {id(lease): lease for deadline, lease in self._reads.values() if deadline <= now}
                if not due:
                    # Deadlines only grow (each is its call's start + timeout_s): the oldest is next.
                    next_deadline = min((deadline for deadline, _ in self._reads.values()), default=None)
                    self._read_started.wait(None if next_deadline is None else next_deadline - now)
                    continue
                self._reads = {c: entry for c, entry in self._reads.items() if id(entry[1]) not in due}
                news = any(not lease.retired for lease in due.values())  # else the pool is down already
            # Down first, so that the cut calls' errors find their client retired and no new
            # call gets it; then the cut, outside the lock (it closes sockets).
            if news:
                self.mark_down(PoolUnavailable(f"a read in flight past {self.timeout_s:.2f} s, cut"))
            for lease in due.values():
                self.num_cut += 1
                try:
                    lease.client.abort()
                except Exception as error:  # the call then ends at the client's own timeout
                    logger.debug("kvtier: cutting a pool read failed: %s", error)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._read_started.notify()
            lease, self._lease = self._lease, None
            close = lease is not None and lease.calls == 0
            if lease is not None:
                lease.retired = True
        if close:
            close_quietly(lease.client)


class _Busy(Exception):
    """``max_calls`` calls are in flight."""


def close_quietly(client: PoolClient) -> None:
    try:
        client.close()
    except Exception:  # closing a broken client may fail too; it is dropped either way
        pass


class PoolIndex(ExistenceIndex):
    """The index asks the pool through a store in a lookup process of its own (``kvtier.io``):
    a client on a thread of the scheduler's process needs the GIL after every call into the
    network, and an engine's busy loop holds it (in vLLM's one-process layout the check's answer
    would wait for the loop's GIL switch interval, call after call). The store's client there is guarded as
    every pool client is: down or past ``timeout_s``, a check is a miss."""

    def __init__(self, spec: TierSpec, rank_fingerprints: Sequence[bytes]):
        from kvtier.io.client import IOProcess  # the I/O process itself builds stores, not indexes

        ranks = list(rank_fingerprints)
        prefixes = [pool_key(fp, b"") for fp in ranks]  # "kvtier/<rank>/": the names of this layout's blocks
        watched = dataclasses.replace(spec, options={**spec.options, "gone_prefixes": prefixes})
        self._down = [0]  # the store's count, as of its last answer

        def start(keys: list[bytes]) -> _PoolCheck:
            return _PoolCheck(self.lookups.check(spec.name, [pool_key(fp, key) for key in keys for fp in ranks]),
                              len(ranks), self._down)

        super().__init__(spec.name, start, spec.timeout_s, failed_ttl_s=max(spec.retry_s, 30.0),
                         wait=lambda done, timeout_s: self.lookups.wait_until(done, timeout_s), **index_timings(spec))
        self._held = _Held(ranks)
        # Last, with everything its news lands in built: the process tells what its server holds at once.
        self.lookups = IOProcess(None, [watched], bytes(16), None, drain_s=0.0, on_news=self._take_news)

    def _take_news(self, message) -> None:
        """On the thread that took it, in the order the lookup process sent it."""
        if isinstance(message, Held):
            self._held.told(message.names, message.complete)
        else:  # Gone
            self._held.drop(_name_hash(name) for name in message.names)
            self.told_gone(_keys_of(message.names))

    def _known(self, keys):
        return self._held.answer(keys)

    def complete_load(self, keys, bad_keys, gone_keys=()):
        self._held.drop(_entry_hash(fp, key) for key in gone_keys for fp in self._held.ranks)
        super().complete_load(keys, bad_keys, gone_keys)

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "down": self._down[0]}

    def close(self) -> None:
        super().close()
        self.lookups.close(0.0)


class _Held:
    """The names that a pool's server says it holds (the node server: ``Held`` notices; no other pool
    says), as hashes, kept by whichever thread takes the lookup process's news and read by the
    scheduler's: each step under the GIL, a set's add, discard and membership test need no lock.
    ``complete`` once the server has told all it held when the watch began, and every name since:
    a name not among them is then a miss, answered at once as a hit is."""

    MAX_NAMES = 1 << 18  # about 20 MiB of hashes; past them a name not among them is asked of the server

    def __init__(self, ranks: Sequence[bytes]):
        self.ranks = list(ranks)
        self._names: set[int] = set()  # ``_entry_hash`` of each: a lookup hashes bytes, formats no name
        self._complete = False
        self._full = False
        self._from_start = False  # a watch's first notice (None) was heard: its list is whole when complete

    def told(self, names: list[str] | None, complete: bool) -> None:
        if names is None:  # a new watch (it tells all again), or a lost one: nothing told stands
            self._complete, self._full, self._from_start = False, False, True
            self._names = set()
            return
        room = self.MAX_NAMES - len(self._names)
        self._full = self._full or len(names) > room
        self._names.update(_name_hash(name) for name in names[:max(room, 0)])
        if complete:  # a list heard from its middle on is no list of all: its names are asked of the server
            self._complete = self._from_start and not self._full

    def drop(self, hashes) -> None:
        held = self._names
        for each in hashes:
            held.discard(each)

    def answer(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each key's entries (one per rank) are all held, or None where that is not known."""
        held, complete = self._names, self._complete
        if not held:
            return [False] * len(keys) if complete else None
        found = [all(_entry_hash(fp, key) in held for fp in self.ranks) for key in keys]
        return found if complete or all(found) else None


def _entry_hash(rank_fingerprint: bytes, key: bytes) -> int:
    """One rank's entry of a block (``pool_key``'s name), as ``_Held`` keeps it."""
    return xxhash.xxh3_64_intdigest(rank_fingerprint + key)


def _name_hash(name: str) -> int:
    """``_entry_hash`` of a pool name; a name that is not one of kvtier's hashes to one no key has."""
    try:
        _, rank, key = name.split("/")
        return _entry_hash(bytes.fromhex(rank), bytes.fromhex(key))
    except ValueError:
        return -1


def make_pool_index(spec: TierSpec, rank_fingerprints: Sequence[bytes]) -> PoolIndex:
    return PoolIndex(spec, rank_fingerprints)


def _keys_of(names: Sequence[str]) -> list[bytes]:
    """The block keys of pool names (``pool_key``); a block is gone once any rank's shard is. A name
    that is not one of kvtier's is skipped."""
    keys = []
    for name in names:
        try:
            keys.append(bytes.fromhex(name[name.rindex("/") + 1:]))
        except ValueError:
            continue
    return list(dict.fromkeys(keys))


class _PoolCheck:
    """One existence check in the lookup process, as ``ExistenceIndex`` polls it."""

    def __init__(self, check, num_ranks: int, down: list[int]):
        self._check, self._ranks, self._down = check, num_ranks, down

    def done(self) -> bool:
        return self._check.done()

    def result(self) -> list[bool] | None:
        answer = self._check.result()
        if answer is None:
            return None
        self._down[0] = max(self._down[0], answer.down)
        if answer.found is None:
            return None
        # A block counts as stored only if every rank stored its shard.
        return [all(answer.found[i:i + self._ranks]) for i in range(0, len(answer.found), self._ranks)]


# What is asked of a pool besides blocks (the namespace probe, `kvtier doctor`) goes through one
# client per pool and process: the scheduler's index's where there is one (no second connection,
# no second Mooncake segment), else one made on first use.
RECORD_BYTES = 4096  # one namespace record, JSON padded with spaces
RECORD_SLOTS = 32  # kvtier-namespaces/<i>: a record takes the slot its fingerprint names
_outside: dict[str, tuple[GuardedClient, np.ndarray, threading.Lock]] = {}
_outside_lock = threading.Lock()


def _outside_client(spec: TierSpec, connect: Callable[[], PoolClient], guarded: GuardedClient | None = None):
    with _outside_lock:
        found = _outside.get(spec.location)
        if found is None:
            guarded = guarded or GuardedClient(spec.location, connect, spec.timeout_s, spec.retry_s, max_calls=2)
            buffers = np.zeros((RECORD_SLOTS, RECORD_BYTES), np.uint8)  # registered: Mooncake moves no other bytes
            guarded.register(buffers.ctypes.data, buffers.nbytes)
            found = _outside[spec.location] = (guarded, buffers, threading.Lock())
        return found


def release_outside(spec: TierSpec) -> None:
    """Close the client kept for ``spec``'s pool (a Mooncake client left open keeps threads that
    retry a pool gone away)."""
    with _outside_lock:
        found = _outside.pop(spec.location, None)
    if found is not None:
        found[0].close()


def pool_held(spec: TierSpec, connect: Callable[[], PoolClient], rank_fingerprints: Sequence[bytes],
              keys: Sequence[bytes]) -> set[bytes]:
    """Which of ``keys`` every rank stored in the pool (nothing while it is down)."""
    guarded = _outside_client(spec, connect)[0]
    ranks = list(rank_fingerprints)
    answer = guarded.call("exists", [pool_key(fp, key) for key in keys for fp in ranks])
    if answer is None:
        return set()
    return {key for i, key in enumerate(keys) if all(answer[i * len(ranks):(i + 1) * len(ranks)])}


def _record_name(slot: int) -> str:
    return f"kvtier-namespaces/{slot}"


def write_pool_record(spec: TierSpec, connect: Callable[[], PoolClient], record: dict) -> bool:
    """Leave ``record`` (``kvtier.tiers.namespaces``) in the pool, in the slot its fingerprint names."""
    import json

    data = json.dumps(record, separators=(",", ":")).encode()
    if len(data) > RECORD_BYTES:
        return False
    guarded, buffers, lock = _outside_client(spec, connect)
    slot = int(record["fingerprint"][:8], 16) % RECORD_SLOTS
    with lock:
        buffers[slot] = ord(" ")
        buffers[slot, :len(data)] = np.frombuffer(data, np.uint8)
        row = memoryview(buffers[slot])
        stored = guarded.call("put", [_record_name(slot)], [row[:HEADER_BYTES]], [row[HEADER_BYTES:]])
    if stored and stored[0]:
        return True
    # A pool that keeps a value once written (Mooncake) refuses the put of a record already there.
    return any(r["fingerprint"] == record["fingerprint"] for r in read_pool_records(spec, connect))


def read_pool_records(spec: TierSpec, connect: Callable[[], PoolClient]) -> list[dict]:
    """The records instances left in the pool (plain JSON, never unpickled; not trusted for bytes)."""
    import json

    guarded, buffers, lock = _outside_client(spec, connect)
    with lock:
        rows = [memoryview(buffers[i]) for i in range(RECORD_SLOTS)]
        found = guarded.call("get_into", [_record_name(i) for i in range(RECORD_SLOTS)],
                             [row[:HEADER_BYTES] for row in rows], [row[HEADER_BYTES:] for row in rows])
        texts = [bytes(buffers[i]) for i, hit in enumerate(found or []) if hit]
    records = []
    for text in texts:
        try:
            records.append(json.loads(text))
        except ValueError:
            continue
    return records


def unpublished_notice(spec: TierSpec, why: str = "it publishes no evictions") -> str:
    """``kvtier doctor``'s line for a pool whose evictions are not heard as they come."""
    audit_s = spec.options.get("audit_s", 0)
    later = (f"within {audit_s:g} s (remote_audit_s) or when a load finds the block gone" if audit_s else
             "when a load finds the block gone")
    return f"; {why}: routers hear of them {later}"


def outside_calls(connector: Callable[[TierSpec], Callable[[], PoolClient]]):
    """A pool module's ``held_from_outside``, ``write_record``, ``read_records`` and
    ``release_outside`` (``kvtier.tiers.registry``), given how it connects to a spec's pool."""

    def held_from_outside(spec, slot_bytes, rank_fingerprints, keys):
        return pool_held(spec, connector(spec), rank_fingerprints, keys)

    def write_record(spec, record):
        return write_pool_record(spec, connector(spec), record)

    def read_records(spec):
        return read_pool_records(spec, connector(spec))

    return held_from_outside, write_record, read_records, release_outside


def _end(rows: np.ndarray) -> int:
    """The address just past the last row of ``rows`` (rows may lie apart)."""
    return rows.ctypes.data + rows.strides[0] * (len(rows) - 1) + rows.shape[1]


class Spans(list):
    """Buffers that lie in memory a client may have registered: the memoryviews, and each one's
    address (``addresses``), which a client that moves bytes by address (Mooncake's) takes from here
    rather than from each view."""

    def __init__(self, views: list, addresses: list[int]):
        super().__init__(views)
        self.addresses = addresses


class _Rows:
    """The rows of a 2-D uint8 array (rows may lie apart), a batch of them at a time as ``Spans``,
    found by arithmetic: no numpy view or ctypes object per row, whose making would be most of a
    batch's Python time in the store."""

    def __init__(self, rows: np.ndarray):
        self.address, self.pitch, self.width, self.count = rows.ctypes.data, rows.strides[0], rows.shape[1], len(rows)
        span = _end(rows) - self.address if len(rows) else 0
        # One flat view from the first row's start to the last one's end; it keeps the memory alive.
        self._flat = memoryview(np.lib.stride_tricks.as_strided(rows, shape=(span,), strides=(1,)))

    def spans(self, ids: Sequence[int]) -> Spans:
        if ids and not (0 <= min(ids) and max(ids) < self.count):  # a slice past the end would only be short
            raise IndexError(f"slots {min(ids)}..{max(ids)} outside 0..{self.count - 1}")
        flat, pitch, width = self._flat, self.pitch, self.width
        return Spans([flat[i * pitch:i * pitch + width] for i in ids], [self.address + i * pitch for i in ids])


class PoolStore(SharedStore):
    """Entries of one rank in a storage pool, moved in batches straight from and into host slots."""

    def __init__(self, spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int, connect: Callable[[], PoolClient],
                 watch: Callable[..., None] | None = None):
        self.client = GuardedClient(spec.location, connect, spec.timeout_s, spec.retry_s)
        self.rank_fingerprint = rank_fingerprint
        self.slot_bytes = slot_bytes
        self._spec, self._watch = spec, watch  # ``watch``: the backend's notices of what its server drops

    def watch_gone(self, tell, held=None) -> None:
        prefixes = self._spec.options.get("gone_prefixes")  # an index's lookup process: its ranks' names
        if self._watch is not None and prefixes:
            self._watch(self._spec, prefixes, tell, held)

    def attach(self, host_slots, heads=None) -> None:
        super().attach(host_slots, heads)
        if heads is not None:  # each entry's header right before its block: one run, one registered span
            self.client.register(heads.ctypes.data, _end(host_slots) - heads.ctypes.data)
        else:  # slots without heads (CUDA's): one header row per slot, apart, registered too
            self.heads = np.zeros((len(host_slots), HEADER_BYTES), np.uint8)
            self.client.register(host_slots.ctypes.data, _end(host_slots) - host_slots.ctypes.data)
            self.client.register(self.heads.ctypes.data, self.heads.nbytes)
        self._head_rows, self._slot_rows = _Rows(self.heads), _Rows(host_slots)

    def read_into(self, keys, slot_ids, locations, deadline, check=True) -> list[Miss | int | None]:
        heads, slots = self._head_rows.spans(slot_ids), self._slot_rows.spans(slot_ids)
        found = self.client.call("get_into", [pool_key(self.rank_fingerprint, key) for key in keys], heads, slots)
        if found is None:
            return [unavailable("storage pool down or failing")] * len(keys)
        # A value gone since the lookup found it (the pool evicted it) is a miss, not a bad entry.
        return [check_entry(bytes(head), slot, self.rank_fingerprint, key, self.slot_bytes, self.mac_key, check)
                if hit else gone("no longer in the storage pool") if hit is None else bad("wrong size in the storage pool")
                for key, head, slot, hit in zip(keys, heads, slots, found)]

    def write_from(self, keys, slot_ids, locations, deadline, checksums=None) -> list[Miss | None]:
        heads, slots = self._head_rows.spans(slot_ids), self._slot_rows.spans(slot_ids)
        for key, head, slot, check in zip(keys, heads, slots, checksums or [None] * len(keys)):
            head[:] = encode_header(self.rank_fingerprint, key, slot, self.mac_key, check)
        stored = self.client.call("put", [pool_key(self.rank_fingerprint, k) for k in keys], heads, slots)
        if stored is None:
            return [unavailable("storage pool down or failing")] * len(keys)
        return [None if ok else unavailable("refused by the storage pool") for ok in stored]

    def exists(self, names: Sequence[str]) -> list[bool] | None:
        return self.client.call("exists", names) if self.client.available else None

    def connect(self) -> None:
        self.client.connect()

    @property
    def num_down(self) -> int:
        return self.client.num_failures

    def close(self) -> None:
        self.client.close()
