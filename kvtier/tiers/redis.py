"""Redis / Valkey tier: a storage pool (``kvtier.tiers.pool``).

``redis://[:password@]host:port/db``, ``rediss://`` for TLS (``ssl_ca_certs``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` as query parameters, as the
``redis`` client takes them), and ``redis+cluster://host:port`` (or
``rediss+cluster://``) for Redis Cluster. Batches are pipelined: one round trip
per batch of reads or writes.

A write the server refuses (``OOM`` at ``maxmemory`` under ``noeviction``) fails
that entry alone: the pool stays up for reads and for the writes that fit. Entries
expire after ``remote_ttl_s`` (``SET EX``).
"""

from __future__ import annotations

from typing import Sequence
from urllib.parse import urlparse, urlunparse

from kvtier.tiers.base import TierSpec
from kvtier.tiers.pool import PoolClient, PoolStore, make_pool_index, outside_calls


def validate(url: str) -> None:
    if not urlparse(url).hostname:
        raise ValueError("no host")


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]):
    return make_pool_index(spec, rank_fingerprints, lambda: RedisClient(spec.location, spec.timeout_s, 0))


def _connector(spec: TierSpec):
    return lambda: RedisClient(spec.location, spec.timeout_s, spec.options.get("ttl_s", 0))


held_from_outside, write_record, read_records, release_outside = outside_calls(_connector)


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> PoolStore:
    ttl_s = spec.options.get("ttl_s", 0)
    return PoolStore(spec, rank_fingerprint, slot_bytes, lambda: RedisClient(spec.location, spec.timeout_s, ttl_s))


class RedisClient(PoolClient):
    def __init__(self, url: str, timeout_s: float, ttl_s: float = 0):
        import redis

        self._ttl_ms = int(ttl_s * 1000) or None
        parsed = urlparse(url)
        options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        if parsed.scheme.endswith("+cluster"):
            from redis.cluster import RedisCluster

            plain = urlunparse(parsed._replace(scheme=parsed.scheme.replace("+cluster", "")))
            self._client = RedisCluster.from_url(plain, **options)
        else:
            self._client = redis.Redis.from_url(url, **options)
        self._client.ping()

    def exists(self, names: Sequence[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(found) for found in pipe.execute()]

    def put(self, names, headers, payloads) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for name, header, payload in zip(names, headers, payloads):
            pipe.set(name, b"".join((header, payload)), px=self._ttl_ms)  # one value: whole or absent
        # Errors per command (OOM at maxmemory) come back as values: that entry is refused, and
        # the pool is not failed for it. A broken connection still raises, and fails the call.
        return [ok is True for ok in pipe.execute(raise_on_error=False)]

    def get_into(self, names, headers, payloads) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        found = []
        for value, header, payload in zip(pipe.execute(), headers, payloads):
            if value is None or len(value) != len(header) + len(payload):
                found.append(False)
                continue
            view = memoryview(value)
            header[:] = view[:len(header)]
            payload[:] = view[len(header):]
            found.append(True)
        return found

    def abort(self) -> None:
        # Closes the sockets of the connections in use too (redis-py's way to cut calls in other
        # threads): each call in flight fails with a connection error at once.
        if hasattr(self._client, "disconnect_connection_pools"):
            self._client.disconnect_connection_pools()
        else:
            self._client.connection_pool.disconnect(inuse_connections=True)

    def close(self) -> None:
        self._client.close()
