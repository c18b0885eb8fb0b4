"""Remote tier: a storage pool shared by many instances. Torch-free.

Selected by ``remote_url``: ``mooncake://host:rpc_port?metadata=http://...`` (Mooncake
Store), ``redis://`` / ``rediss://`` (Redis or Valkey, TLS with ``rediss``) or
``redis+cluster://`` (Redis Cluster). Each backend lives in its own module and
implements ``RemoteStore``: batched existence checks, puts and gets of whole
entries (the ``kvtier.entry`` header, then the slot's bytes).

Keys in the pool are ``kvtier/<rank fingerprint hex>/<key hex>``: two models, two
layouts or two ranks never read each other's blocks. Every value is checked
(header and checksum) before it is used; anything else is a miss.

A pool that is down or slow must never stall the engine: every call has a
timeout, a failure opens a circuit breaker for ``remote_retry_s`` during which
the tier is skipped (local tiers and recompute carry on), and the next call after
that reconnects.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Sequence
from urllib.parse import parse_qs, urlparse

logger = logging.getLogger("kvtier.remote")

SCHEMES = ("mooncake", "redis", "rediss", "redis+cluster", "rediss+cluster")


def remote_key(rank_fingerprint: bytes, key: bytes) -> str:
    return f"kvtier/{rank_fingerprint.hex()}/{key.hex()}"


def validate_url(url: str) -> str:
    """Raise ValueError unless ``url`` names a supported pool."""
    parsed = urlparse(url)
    if parsed.scheme not in SCHEMES:
        raise ValueError(f"scheme {parsed.scheme!r} is not one of {', '.join(SCHEMES)}")
    if not parsed.hostname:
        raise ValueError("no host")
    if parsed.scheme == "mooncake" and "metadata" not in parse_qs(parsed.query):
        raise ValueError("a mooncake:// URL needs ?metadata=<metadata server URL>")
    return url


class RemoteUnavailable(Exception):
    """The pool did not answer in time, or refused the call."""


class RemoteStore(ABC):
    """One backend's client. Calls may raise; ``RemoteTier`` turns that into misses."""

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def put(self, names: Sequence[str], headers: Sequence[memoryview], payloads: Sequence[memoryview]) -> list[bool]:
        """Store header + payload under each name; True where it is stored."""

    @abstractmethod
    def get_into(self, names: Sequence[str], headers: Sequence[memoryview],
                 payloads: Sequence[memoryview]) -> list[bool]:
        """Read each value into its header and payload buffers; False where it
        is absent or not exactly that long."""

    def register(self, address: int, num_bytes: int) -> None:
        """Offer host memory for zero-copy transfers (a no-op where unsupported)."""

    def close(self) -> None:
        return None


def connect(url: str, timeout_s: float) -> RemoteStore:
    scheme = urlparse(url).scheme
    if scheme == "mooncake":
        from kvtier.tiers.mooncake import MooncakeStore
        return MooncakeStore(url, timeout_s)
    from kvtier.tiers.redis import RedisStore
    return RedisStore(url, timeout_s)


class RemoteTier:
    """A remote store behind a circuit breaker. Thread-safe."""

    def __init__(self, url: str, timeout_s: float, retry_s: float):
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._store: RemoteStore | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._registered: list[tuple[int, int]] = []
        self.num_failures = 0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _client(self) -> RemoteStore:
        with self._lock:
            if not self.available:
                raise RemoteUnavailable(f"{self.url} is marked down for another "
                                        f"{self._down_until - time.monotonic():.1f} s")
            if self._store is None:
                self._store = connect(self.url, self.timeout_s)
                for address, num_bytes in self._registered:
                    self._store.register(address, num_bytes)
            return self._store

    def register(self, address: int, num_bytes: int) -> None:
        self._registered.append((address, num_bytes))
        if self._store is not None:
            self._store.register(address, num_bytes)

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            self.num_failures += 1
            self._down_until = time.monotonic() + self.retry_s
            store, self._store = self._store, None  # reconnect after the pause
        logger.warning("kvtier: remote pool %s failed (%s); using local tiers for %.0f s", self.url, error,
                       self.retry_s)
        if store is not None:
            try:
                store.close()
            except Exception:  # closing a broken client may fail too; it is dropped either way
                pass

    def call(self, method: str, *args) -> list | None:
        """``store.<method>(*args)``, or None if the pool is down or the call failed."""
        try:
            client = self._client()
            began = time.monotonic()
            result = getattr(client, method)(*args)
            elapsed = time.monotonic() - began
            if elapsed > self.timeout_s:  # answered, but too slowly to keep using for now
                self._failed(RemoteUnavailable(f"{method} took {elapsed:.2f} s"))
            return result
        except RemoteUnavailable as error:
            if self.available:
                self._failed(error)
            return None
        except Exception as error:  # any client error is a failed call: fall back, never crash the engine
            self._failed(error)
            return None

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()


class ExistenceQueries:
    """Asks the pool which keys it holds, off the caller's thread.

    ``query(token, names)`` returns the answer once it has arrived, None while it
    is pending (ask again later), and all-False once ``timeout_s`` has passed
    without one: a pool that does not answer is a miss, never a wait.
    """

    def __init__(self, tier: RemoteTier, num_threads: int = 2):
        from concurrent.futures import ThreadPoolExecutor

        self._tier = tier
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kvtier-remote-lookup")
        self._pending: dict[str, tuple[tuple[str, ...], float, object]] = {}

    def query(self, token: str, names: Sequence[str]) -> list[bool] | None:
        names = tuple(names)
        if not names:
            return []
        if not self._tier.available:
            return [False] * len(names)
        entry = self._pending.get(token)
        if entry is None or entry[0] != names:
            future = self._pool.submit(self._tier.call, "exists", list(names))
            self._pending[token] = (names, time.monotonic(), future)
            return None
        _, began, future = entry
        if future.done():
            del self._pending[token]
            found = future.result()
            return [False] * len(names) if found is None else list(found)
        if time.monotonic() - began > self._tier.timeout_s:
            del self._pending[token]
            return [False] * len(names)
        return None

    def forget(self, token: str) -> None:
        self._pending.pop(token, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
