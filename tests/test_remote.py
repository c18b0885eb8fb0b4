"""The storage-pool tiers against a real redis-server and a real mooncake_master, on loopback."""

import time

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.entry import HEADER_BYTES, encode_header
from kvtier.keys import Namespace
from kvtier.manager import TierManager
from kvtier.servers import local_mooncake, local_redis
from kvtier.tiers.base import TierSpec
from kvtier.tiers.pool import pool_key
from kvtier.worker import TierWorker

NB, BS = 32, 4
NAMESPACE = Namespace("remote-test", "bfloat16", "kv", (1, 8), 2, BS)


@pytest.fixture(params=["redis", "mooncake"])
def pool(request, tmp_path):
    context = local_redis if request.param == "redis" else local_mooncake
    with context(log_path=str(tmp_path / "pool.log")) as server:
        yield server


def keys_of(ids):
    return [i.to_bytes(16, "little") for i in ids]


class Instance:
    """One engine's kvtier halves on a fresh KV cache, with only host + pool."""

    def __init__(self, url, **config):
        self.tensors = [torch.randint(-5000, 5000, (NB, 1, BS, 16), dtype=torch.int16).view(torch.bfloat16)
                        for _ in range(2)]
        self.config = KVTierConfig.from_sources({"host_bytes": 16 * 2 * BS * 16 * 2, "disk_dir": None,
                                                 "remote_url": url, "remote_timeout_s": 1.0,
                                                 "remote_retry_s": 1.0, **config}, environ={})
        self.worker = TierWorker(self.config, self.tensors, NB, BS, NAMESPACE)
        self.manager = TierManager(self.config, self.worker.layout.slot_bytes, [self.worker.rank_fingerprint])

    def run(self, job, submit, timeout=30):
        submit(job)
        deadline = time.monotonic() + timeout
        while True:
            reports = self.worker.poll()
            self.manager.on_released(self.worker.released_slots())
            if reports:
                self.manager.on_reports(reports)
                return reports[0]
            assert time.monotonic() < deadline, "job did not finish"
            time.sleep(0.001)

    def lookup(self, keys, token="r", timeout=10):
        deadline = time.monotonic() + timeout
        while (hits := self.manager.lookup(keys, token)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return hits

    def close(self):
        self.worker.close()
        self.manager.close()


def test_blocks_stored_by_one_instance_load_byte_exact_in_another(pool):
    writer, reader = Instance(pool.url), Instance(pool.url)
    blocks = [3, 4, 9]
    report = writer.run(writer.manager.plan_store("a", keys_of([1, 2, 3]), blocks), writer.worker.submit_store)
    assert report.success and not report.failed_writes
    assert reader.lookup(keys_of([1, 2, 3, 4])) == 3
    job = reader.manager.plan_load("r", keys_of([1, 2, 3]), [20, 21, 22])
    assert job.fill_from == [reader.manager.tiers[0].name] * 3
    report = reader.run(job, reader.worker.submit_load)
    assert report.success
    for w, r in zip(writer.tensors, reader.tensors):
        assert torch.equal(w[blocks].view(torch.int16), r[[20, 21, 22]].view(torch.int16))
    assert reader.manager.host.num_pins == 0 and reader.manager.stats.hit_blocks[job.fill_from[0]] == 3
    writer.close()
    reader.close()


def test_corrupt_truncated_and_foreign_pool_entries_are_misses(tmp_path):
    import redis

    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        writer, reader = Instance(server.url), Instance(server.url)
        writer.run(writer.manager.plan_store("a", keys_of(range(4)), [1, 2, 3, 4]), writer.worker.submit_store)
        client = redis.Redis.from_url(server.url)
        fp = writer.worker.rank_fingerprint
        names = [pool_key(fp, k) for k in keys_of(range(4))]
        good = client.get(names[0])
        damaged = bytearray(good)
        damaged[HEADER_BYTES + 5] ^= 0xFF
        client.set(names[0], bytes(damaged))  # garbage in the payload
        client.set(names[1], good[: len(good) // 2])  # truncated
        foreign = encode_header(b"\x99" * 16, keys_of([2])[0], good[HEADER_BYTES:]) + good[HEADER_BYTES:]
        client.set(names[2], foreign)  # another model's entry under this name
        assert reader.lookup(keys_of(range(4))) == 4
        report = reader.run(reader.manager.plan_load("r", keys_of(range(4)), [10, 11, 12, 13]),
                            reader.worker.submit_load)
        assert sorted(report.failed_block_ids) == [10, 11, 12]
        assert sorted(report.bad_keys) == sorted(keys_of(range(3)))
        assert reader.manager.stats.bad_entries == 3 and reader.manager.host.num_pins == 0
        writer.close()
        reader.close()


def test_a_pool_that_is_down_costs_bounded_time_and_comes_back(tmp_path):
    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        instance = Instance(server.url)
        server.stop()
        began = time.monotonic()
        assert instance.lookup(keys_of([1, 2])) == 0  # a miss, within the timeout
        report = instance.run(instance.manager.plan_store("a", keys_of([5]), [5]), instance.worker.submit_store)
        assert report.failed_writes == {"redis": keys_of([5])}  # counted, not raised
        assert time.monotonic() - began < 5
        assert instance.manager.stats.failed_writes["redis"] == 1
        server.start()
        time.sleep(1.1)  # remote_retry_s: then kvtier reconnects
        report = instance.run(instance.manager.plan_store("a", keys_of([6]), [6]), instance.worker.submit_store)
        assert report.success and not report.failed_writes
        other = Instance(server.url)
        assert other.lookup(keys_of([6])) == 1
        instance.close()
        other.close()


def test_existence_queries_never_wait_on_a_silent_pool():
    from kvtier.tiers import redis as redis_tier

    spec = TierSpec("redis", "kvtier.tiers.redis", "redis://127.0.0.1:9/0", timeout_s=0.3, retry_s=60)
    index = redis_tier.make_index(spec, 64, [b"\x01" * 16])  # nothing listens on port 9
    began = time.monotonic()
    answer = None
    while answer is None:
        answer = index.lookup(keys_of([1, 2]), "t")
        time.sleep(0.01)
    assert answer == [False, False] and time.monotonic() - began < 2
    assert index.lookup(keys_of([1]), "t") is None  # a new question is asked off this thread...
    time.sleep(0.05)
    assert index.lookup(keys_of([1]), "t") == [False]  # ...and, the pool being marked down, answered at once
    index.close()


def test_a_damaged_pool_entry_is_not_offered_again(tmp_path):
    """After a pool entry fails to load, lookups miss it (else the engine would retry forever)."""
    import redis

    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        writer, reader = Instance(server.url), Instance(server.url)
        writer.run(writer.manager.plan_store("a", keys_of([1, 2]), [1, 2]), writer.worker.submit_store)
        client = redis.Redis.from_url(server.url)
        client.set(pool_key(writer.worker.rank_fingerprint, keys_of([1])[0]), b"garbage")
        assert reader.lookup(keys_of([1, 2]), token="first") == 2  # it exists in the pool...
        report = reader.run(reader.manager.plan_load("first", keys_of([1, 2]), [5, 6]), reader.worker.submit_load)
        assert report.failed_block_ids == [5]
        assert reader.lookup(keys_of([1, 2]), token="again") == 0  # ...but is no longer offered
        writer.close()
        reader.close()
