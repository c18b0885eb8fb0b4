"""Redis / Valkey tier: a storage pool (``kvtier.tiers.pool``).

``redis://[:password@]host:port/db``, ``rediss://`` for TLS (``ssl_ca_certs``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` as query parameters, as the
``redis`` client takes them), and ``redis+cluster://host:port`` (or
``rediss+cluster://``) for Redis Cluster. Batches are pipelined: one round trip
per batch of reads or writes. A write sends each entry's header and the host slot
itself as the one value of its ``SET``, and a read takes each value off the socket
straight into its header and slot: no copy of a block in this process. (Redis
Cluster, which routes each key, goes through redis-py's pipeline and copies.)

A write the server refuses (``OOM`` at ``maxmemory`` under ``noeviction``) fails
that entry alone: the pool stays up for reads and for the writes that fit. Entries
expire after ``remote_ttl_s`` (``SET EX``). What the server evicts or expires on its
own, it publishes where ``notify-keyspace-events`` asks it to: the index's lookup
process listens (``GoneNotices``), so routers hear of it at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence
from urllib.parse import urlparse, urlunparse

from kvtier.common.redact import redact
from kvtier.tiers.base import TierKind, TierSpec
from kvtier.tiers.pool import (PoolClient, PoolStore, close_quietly, make_pool_index, outside_calls,
                               unpublished_notice)

logger = logging.getLogger("kvtier.pool")


def validate(url: str) -> None:
    if not urlparse(url).hostname:
        raise ValueError("no host")


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]):
    return make_pool_index(spec, rank_fingerprints)


def _connector(spec: TierSpec):
    return lambda: RedisClient(spec.location, spec.timeout_s, spec.options.get("ttl_s", 0))


held_from_outside, write_record, read_records, release_outside = outside_calls(_connector)


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> PoolStore:
    ttl_s = spec.options.get("ttl_s", 0)
    return PoolStore(spec, rank_fingerprint, slot_bytes, lambda: RedisClient(spec.location, spec.timeout_s, ttl_s),
                     watch=watch_gone)


def watch_gone(spec: TierSpec, prefixes, tell, held=None) -> None:
    """Hear the server's own evictions and expiries (keyspace notifications) of names under ``prefixes``,
    on a thread of their own (``GoneNotices``). Redis Cluster's notices stay on each node: not heard."""
    if urlparse(spec.location).scheme.endswith("+cluster"):
        logger.info("kvtier: a Redis Cluster's evictions are not heard as they come; an evicted block is "
                    "noticed by the audit (remote_audit_s) or when a load finds it gone")
        return
    notices = GoneNotices(spec.location, spec.timeout_s, spec.retry_s, tuple(prefixes), tell)
    threading.Thread(target=notices.run, daemon=True, name="kvtier-redis-gone").start()


class GoneNotices:
    """The names the server evicts (``maxmemory``) or expires (``remote_ttl_s``), as it publishes them on
    ``__keyevent@<db>__:evicted`` and ``:expired``: with ``notify-keyspace-events`` holding ``E`` and
    ``e``/``x`` (``kvtier serve redis`` sets ``Eex``). Told in batches (a burst of evictions is one
    message), less the names stored again meanwhile (``still_gone``); a lost connection is retried
    every ``retry_s``. A server that publishes none is said once."""

    BATCH_S = 0.05  # the longest a notice waits for the next ones of its burst

    def __init__(self, url: str, timeout_s: float, retry_s: float, prefixes: tuple[str, ...], tell):
        self.url, self.timeout_s, self.retry_s = url, timeout_s, retry_s
        self.prefixes, self.tell = prefixes, tell
        self.num_told = 0
        self._checked = False  # whether the server's settings were looked at (once: a reconnect is no news)

    def run(self) -> None:
        import redis

        failing = False
        while True:
            client = None
            try:
                client = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                              socket_connect_timeout=self.timeout_s)
                if not self._checked:
                    self._say_if_unpublished(client)
                    self._checked = True
                db = client.connection_pool.connection_kwargs.get("db", 0)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(f"__keyevent@{db}__:evicted", f"__keyevent@{db}__:expired")
                failing = False
                while True:
                    self._tell_burst(pubsub, client)
            except Exception as error:  # the server went away: heard again once it is back
                if not failing:
                    logger.warning("kvtier: lost the Redis pool's eviction notices (%s); trying again every %.0f s",
                                   redact(error), self.retry_s)
                failing = True
            finally:
                if client is not None:
                    close_quietly(client)
            time.sleep(self.retry_s)

    def _tell_burst(self, pubsub, client) -> None:
        message = pubsub.get_message(timeout=1.0)
        names, until = [], time.monotonic() + self.BATCH_S
        while message is not None:
            name = message["data"]
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            if name.startswith(self.prefixes):
                names.append(name)
            left = until - time.monotonic()
            message = pubsub.get_message(timeout=left) if left > 0 else None
        names = still_gone(client, names) if names else names
        if names:
            self.num_told += len(names)
            self.tell(names)

    def _say_if_unpublished(self, client) -> None:
        missing = unpublished(client)
        if missing:
            logger.info("kvtier: the Redis pool %s does not publish its evictions and expiries (%s): routers "
                        "hear of a block it dropped through the audit (remote_audit_s) or when a load finds it gone",
                        redact(self.url), missing)


def still_gone(client, names: list[str]) -> list[str]:
    """Those of ``names`` that the server does not hold: one stored again since the notice was published
    (by this instance or another) is no removal. Asked after the notice came, so the answer is of a moment
    after the eviction; a store that lands after the answer still meets a removal told. Where the server
    cannot be asked, every name is told, as the server said it."""
    import redis

    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(name)
    try:
        held = pipe.execute()
    except redis.RedisError:
        return names
    return [name for name, there in zip(names, held) if not there]


def unpublished(client) -> str | None:
    """Why the server does not publish both its evictions and its expiries, or None where it does (or
    will not say: a managed service that refuses CONFIG, listened to all the same)."""
    import redis

    try:
        flags = client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
    except redis.ResponseError:
        return None
    if "E" in flags and ({"e", "x"} <= set(flags) or "A" in flags):
        return None
    return f"notify-keyspace-events is {flags!r}; 'Eex' publishes them"


class RedisClient(PoolClient):
    def __init__(self, url: str, timeout_s: float, ttl_s: float = 0):
        import redis

        self._ttl_ms = int(ttl_s * 1000) or None
        parsed = urlparse(url)
        options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._cluster = parsed.scheme.endswith("+cluster")
        if self._cluster:
            from redis.backoff import NoBackoff
            from redis.cluster import RedisCluster
            from redis.retry import Retry

            plain = urlunparse(parsed._replace(scheme=parsed.scheme.replace("+cluster", "")))
            # One try per call: redis-py would otherwise try a failed node again (and again after a cut,
            # ``abort``), past ``timeout_s``; the pool's breaker retries after ``retry_s`` instead.
            self._client = RedisCluster.from_url(plain, retry=Retry(NoBackoff(), 0), **options)
        else:
            self._client = redis.Redis.from_url(url, **options)
        self._client.ping()

    def exists(self, names: Sequence[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(found) for found in pipe.execute()]

    def put(self, names, headers, payloads) -> list[bool]:
        if not names:
            return []
        if not self._cluster:
            return self._put_gathered(names, headers, payloads)
        pipe = self._client.pipeline(transaction=False)
        for name, header, payload in zip(names, headers, payloads):
            pipe.set(name, b"".join((header, payload)), px=self._ttl_ms)  # one value: whole or absent
        # Errors per command (OOM at maxmemory) come back as values: that entry is refused, and
        # the pool is not failed for it. A broken connection still raises, and fails the call.
        return [ok is True for ok in pipe.execute(raise_on_error=False)]

    def _put_gathered(self, names, headers, payloads) -> list[bool]:
        """The batch's ``SET``s on one connection, each value sent from its header and its slot
        as they lie: redis-py's packing would first copy every block into one bytes object."""
        chunks, tail = [], b""
        for name, header, payload in zip(names, headers, payloads):
            value_bytes = len(header) + len(payload)
            chunks += [_set_prefix(tail, name.encode(), value_bytes, self._ttl_ms) + bytes(header), payload]
            tail = _set_suffix(self._ttl_ms)
        return self._exchange(chunks + [tail], lambda connection: [_stored(connection) for _ in names])

    def _exchange(self, command: list, receive):
        """Send ``command`` (RESP, in pieces) on a connection of the client's own pool (its password,
        TLS and timeouts), then ``receive(connection)`` the replies."""
        pool = self._client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command(command, check_health=False)
            return receive(connection)
        except BaseException:
            connection.disconnect()  # replies may be left unread: the connection is out of step
            raise
        finally:
            pool.release(connection)

    def get_into(self, names, headers, payloads) -> list[bool | None]:
        if not names:
            return []
        if not self._cluster:
            command = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n in map(str.encode, names))
            return self._exchange([command], lambda connection: _ValueReader(connection).values_into(headers, payloads))
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        found = []
        for value, header, payload in zip(pipe.execute(), headers, payloads):
            if value is None or len(value) != len(header) + len(payload):
                found.append(None if value is None else False)
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


def _stored(connection) -> bool:
    import redis

    try:
        return connection.read_response() in (b"OK", "OK", True)
    except redis.ResponseError:  # refused (OOM at maxmemory): that entry alone fails
        return False


def _set_prefix(tail: bytes, name: bytes, value_bytes: int, ttl_ms: int | None) -> bytes:
    """RESP framing of ``SET name <value> [PX ms]`` up to its value, after the previous command's tail."""
    arguments = 3 if ttl_ms is None else 5
    return b"%s*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (tail, arguments, len(name), name, value_bytes)


def _set_suffix(ttl_ms: int | None) -> bytes:
    return b"\r\n" if ttl_ms is None else b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(ttl_ms)), ttl_ms)


class _ValueReader:
    """The bulk-string replies of a batch of GETs, read off the connection's socket straight into
    the header and slot each one fills (redis-py's parser would build a bytes object per value,
    copied once more into the slot). Only the line before each value passes through a buffer."""

    def __init__(self, connection):
        self.sock = connection._sock
        self.pending = bytearray()

    def _receive(self) -> None:
        chunk = self.sock.recv(4096)
        if not chunk:
            raise ConnectionError("the connection closed mid-reply")
        self.pending += chunk

    def _line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            self._receive()
        line = bytes(self.pending[:end])
        del self.pending[:end + 2]
        return line

    def _fill(self, view: memoryview) -> None:
        used = min(len(view), len(self.pending))  # what the line's read brought along first
        view[:used] = self.pending[:used]
        del self.pending[:used]
        while used < len(view):
            got = self.sock.recv_into(view[used:])
            if not got:
                raise ConnectionError("the connection closed mid-value")
            used += got

    def values_into(self, headers, payloads) -> list[bool | None]:
        return [self.value_into(header, payload) for header, payload in zip(headers, payloads)]

    def value_into(self, header: memoryview, payload: memoryview) -> bool | None:
        """The next reply into ``header`` then ``payload``; None if there is no such key, False if it
        is an error (a key of another type) or not exactly their length (then it is read past, not kept)."""
        line = self._line()
        if line[:1] == b"_":  # RESP3's null: no such key
            return None
        if line[:1] == b"-":  # an error for this GET alone
            return False
        if line[:1] != b"$":
            raise ConnectionError(f"unexpected reply {line[:16]!r}")
        length = int(line[1:])
        if length < 0:  # RESP2's null: no such key
            return None
        fits = length == len(header) + len(payload)
        if fits:
            self._fill(memoryview(header).cast("B"))
            self._fill(memoryview(payload).cast("B"))
        else:  # read past in pieces: a foreign value may be of any size
            scratch = memoryview(bytearray(min(length, 1 << 16)))
            for start in range(0, length, len(scratch)):
                self._fill(scratch[:min(len(scratch), length - start)])
        if self._line():
            raise ConnectionError("a value longer than its length")
        return fits


def _notices(spec: TierSpec) -> str:
    """Whether the server publishes its evictions and expiries, which routers then hear at once."""
    if urlparse(spec.location).scheme.endswith("+cluster"):
        return unpublished_notice(spec)
    import redis

    client = redis.Redis.from_url(spec.location, socket_timeout=spec.timeout_s, socket_connect_timeout=spec.timeout_s)
    try:
        missing = unpublished(client)
    except Exception:  # the probe's block went through: a question the server does not answer is no failure
        return ""
    finally:
        client.close()
    return ("; its evictions and expiries are published (routers hear of them at once)" if missing is None else
            unpublished_notice(spec, f"its evictions and expiries are not published ({missing})"))


def _address(spec: TierSpec) -> str:
    parsed = urlparse(spec.location)
    return redact(f"{parsed.hostname}:{parsed.port}{parsed.path}")  # the database number is part of it


KIND = TierKind("redis", make_index, make_store, shared=True, validate=validate, notices=_notices, address=_address,
                write_record=write_record, read_records=read_records, held_from_outside=held_from_outside,
                release_outside=release_outside)
