"""Redis / Valkey tier: a storage pool (``kvtier.tiers.pool``).

``redis://[:password@]host:port/db``, ``rediss://`` for TLS (``ssl_ca_certs``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` as query parameters, as the
``redis`` client takes them), and ``redis+cluster://host:port`` (or
``rediss+cluster://``) for Redis Cluster. Batches are pipelined: one round trip
per batch of reads or writes.
"""

from __future__ import annotations

from typing import Sequence
from urllib.parse import urlparse, urlunparse

from kvtier.tiers.base import TierSpec
from kvtier.tiers.pool import PoolClient, PoolStore, make_pool_index


def validate(url: str) -> None:
    if not urlparse(url).hostname:
        raise ValueError("no host")


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]):
    return make_pool_index(spec, rank_fingerprints, lambda: RedisClient(spec.location, spec.timeout_s))


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> PoolStore:
    return PoolStore(spec, rank_fingerprint, slot_bytes, lambda: RedisClient(spec.location, spec.timeout_s))


class RedisClient(PoolClient):
    def __init__(self, url: str, timeout_s: float):
        import redis

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
            pipe.set(name, b"".join((header, payload)))  # one value: a reader gets all of it or nothing
        return [bool(ok) for ok in pipe.execute()]

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

    def close(self) -> None:
        self._client.close()
