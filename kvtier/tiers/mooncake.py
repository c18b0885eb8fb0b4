"""Mooncake Store tier (``mooncake://``): a storage pool (``kvtier.tiers.pool``).

``mooncake://<master host>:<rpc port>?metadata=<metadata URL>&protocol=tcp&segment=<bytes>``
(``protocol`` defaults to tcp, ``rdma`` where the deployment has it;
``segment`` is the memory this client contributes to the pool, default 256 MiB;
``local_host`` is this client's address, default 127.0.0.1).

Zero-copy: the host pool and its headers are registered with the client, and
entries move with the batch calls that write from and read into them. An entry is
one object, its header then its block, put from and got into memory where it lies:
one buffer where the header lies right before its block (a slot's head,
``kvtier.common.host_slots``: ``batch_put_from`` / ``batch_get_into``), else two
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``, a second transfer per
entry). One call per batch each way, as a raw client's. A put is whole or absent (Mooncake
publishes an object once all of it is written), so an entry needs no second object
to say that it is complete; a reader checks its header and checksum.

An entry of another size (a foreign or truncated object) fails its get (the client
logs it) and is a miss.
"""

from __future__ import annotations

import os
import socket
from typing import Sequence
from urllib.parse import parse_qs, urlparse

from kvtier.common.units import parse_bytes
from kvtier.tiers.base import TierKind, TierSpec
from kvtier.tiers.pool import (PoolClient, PoolStore, PoolUnavailable, Spans, make_pool_index, outside_calls,
                               unpublished_notice)

_OBJECT_NOT_FOUND = -704  # a batch get's code for a key the store does not hold (Mooncake's ErrorCode)

# A batch call has a fixed cost besides its bytes (its round trips to the master), and the thread that
# makes it polls for its end, holding a core meanwhile: fewer, larger calls load a long prompt sooner
# (``kvtier bench tiers --large --tiers mooncake``). Jobs this large still let a long load's device
# copies start while its later jobs are read.
JOB_BYTES = 32 << 20


def validate(url: str) -> None:
    parsed = urlparse(url)
    if not parsed.hostname:
        raise ValueError("no host")
    if "metadata" not in parse_qs(parsed.query):
        raise ValueError("a mooncake:// URL needs ?metadata=<metadata server URL>")


def make_index(spec: TierSpec, slot_bytes: int, rank_fingerprints: Sequence[bytes]):
    return make_pool_index(spec, rank_fingerprints)


def _connector(spec: TierSpec):
    return lambda: MooncakeClient(spec.location, spec.timeout_s)


held_from_outside, write_record, read_records, release_outside = outside_calls(_connector)


def make_store(spec: TierSpec, rank_fingerprint: bytes, slot_bytes: int) -> PoolStore:
    return PoolStore(spec, rank_fingerprint, slot_bytes, _connector(spec))


def _addresses(buffers) -> list[int]:
    if isinstance(buffers, Spans):
        return buffers.addresses
    import ctypes
    return [ctypes.addressof(ctypes.c_char.from_buffer(view)) for view in buffers]


def _runs(headers, payloads) -> tuple[list[int], list[int]] | None:
    """(addresses, sizes) of each entry as one run of memory, or None unless every header lies
    right before its block."""
    starts = _addresses(headers)
    if any(start + len(h) != p for start, h, p in zip(starts, headers, _addresses(payloads))):
        return None
    return starts, [len(h) + len(p) for h, p in zip(headers, payloads)]


def _pieces(headers, payloads) -> tuple[list[list[int]], list[list[int]]]:
    return ([list(pair) for pair in zip(_addresses(headers), _addresses(payloads))],
            [[len(h), len(p)] for h, p in zip(headers, payloads)])


class MooncakeClient(PoolClient):
    def __init__(self, url: str, timeout_s: float):
        from mooncake.store import MooncakeDistributedStore

        parsed = urlparse(url)
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        # Mooncake's setup holds the GIL while it retries a server that is not there (90 s, seen):
        # every thread of the process would stop. Both servers are reached first, within timeout_s.
        metadata = urlparse(query["metadata"])
        for host, port in ((parsed.hostname, parsed.port or 50051), (metadata.hostname, metadata.port)):
            if host and port:
                try:
                    socket.create_connection((host, port), timeout=timeout_s).close()
                except OSError as error:
                    raise PoolUnavailable(f"mooncake server {host}:{port} unreachable: {error}") from None
        local_host = query.get("local_host", "127.0.0.1")
        # The transfer engine listens on the address it announces, not on any interface it finds.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_host)
        self._store = MooncakeDistributedStore()
        code = self._store.setup(
            local_host, query["metadata"],
            parse_bytes(query.get("segment", "256MiB")), parse_bytes(query.get("buffer", "64MiB")),
            query.get("protocol", "tcp"), query.get("device", ""), f"{parsed.hostname}:{parsed.port or 50051}")
        if code != 0:
            raise PoolUnavailable(f"mooncake setup returned {code}")

    def register(self, address: int, num_bytes: int) -> None:
        code = self._store.register_buffer(address, num_bytes)
        if code != 0:
            raise PoolUnavailable(f"mooncake register_buffer returned {code}")

    def exists(self, names: Sequence[str]) -> list[bool]:
        codes = self._store.batch_is_exist(list(names))
        if any(code < 0 for code in codes):
            raise PoolUnavailable("mooncake batch_is_exist failed")
        return [code == 1 for code in codes]

    def put(self, names, headers, payloads) -> list[bool]:
        if not names:
            return []
        runs = _runs(headers, payloads)
        if runs is not None:
            codes = self._store.batch_put_from(list(names), *runs)
        else:
            codes = self._store.batch_put_from_multi_buffers(list(names), *_pieces(headers, payloads))
        return [code == 0 for code in codes]  # 0 too where the entry was there already: it is stored

    def get_into(self, names, headers, payloads) -> list[bool | None]:
        if not names:
            return []
        runs = _runs(headers, payloads)
        if runs is not None:
            codes = self._store.batch_get_into(list(names), *runs)
        else:
            codes = self._store.batch_get_into_multi_buffers(list(names), *_pieces(headers, payloads))
        return [True if code == len(h) + len(p) else None if code == _OBJECT_NOT_FOUND else False
                for code, h, p in zip(codes, headers, payloads)]

    def close(self) -> None:
        self._store.close()


KIND = TierKind("mooncake", make_index, make_store, shared=True, job_bytes=JOB_BYTES, validate=validate,
                notices=unpublished_notice, write_record=write_record, read_records=read_records,
                held_from_outside=held_from_outside, release_outside=release_outside)
