"""The storage-pool tiers against a real redis-server, a real Redis Cluster and a real mooncake_master, on loopback."""

import itertools
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from kvtier.cli.servers import local_mooncake, local_redis, local_redis_cluster
from kvtier.common.config import KVTierConfig
from kvtier.common.entry import HEADER_BYTES, encode_header
from kvtier.common.keys import Namespace
from kvtier.scheduler.manager import TierManager
from kvtier.tiers.base import TierSpec
from kvtier.tiers.pool import pool_key
from kvtier.worker import TierWorker

NB, BS = 32, 4
NAMESPACE = Namespace("remote-test", "bfloat16", "kv", (1, 8), 2, BS)


def start_pool(kind: str, tmp_path):
    if kind == "redis-cluster":
        return local_redis_cluster(str(tmp_path), log_path=str(tmp_path / "pool.log"))
    return (local_redis if kind == "redis" else local_mooncake)(log_path=str(tmp_path / "pool.log"))


def raw_redis(url: str):
    """redis-py's own client of a ``redis://`` or ``redis+cluster://`` pool, to act behind kvtier's back."""
    import redis
    from redis.cluster import RedisCluster

    if "+cluster" in url:
        return RedisCluster.from_url(url.replace("+cluster", ""))
    return redis.Redis.from_url(url)


@pytest.fixture(params=["redis", "redis-cluster", "mooncake"])
def pool(request, tmp_path):
    with start_pool(request.param, tmp_path) as server:
        yield server


def keys_of(ids):
    return [i.to_bytes(16, "little") for i in ids]


class Instance:
    """One engine's kvtier halves on a fresh KV cache, with only host + pool."""

    def __init__(self, url, track_holdings=False, **config):
        self.tensors = [torch.randint(-5000, 5000, (NB, 1, BS, 16), dtype=torch.int16).view(torch.bfloat16)
                        for _ in range(2)]
        self.config = KVTierConfig.from_sources({"host_bytes": 16 * 2 * BS * 16 * 2, "disk_dir": None,
                                                 "remote_url": url, "remote_timeout_s": 1.0,
                                                 "remote_retry_s": 1.0, **config}, environ={})
        self.worker = TierWorker(self.config, self.tensors, NB, BS, NAMESPACE)
        self.manager = TierManager(self.config, self.worker.layout.slot_bytes, [self.worker.rank_fingerprint],
                                   track_holdings=track_holdings)

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
    assert reader.manager.host.num_pins == 0 and reader.manager.stats.planned_blocks[job.fill_from[0]] == 3
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


def test_a_pool_entry_evicted_between_lookup_and_load_is_a_miss_but_not_shunned(pool):
    """The pool evicts a value after the lookup found it: the load fails for that block
    (recompute), but the entry is not counted as damaged, and once stored again (by the
    instance that recomputed it) it is offered at once."""
    writer, reader = Instance(pool.url), Instance(pool.url)
    writer.run(writer.manager.plan_store("a", keys_of([1, 2]), [1, 2]), writer.worker.submit_store)
    assert reader.lookup(keys_of([1, 2]), token="first") == 2
    name = pool_key(writer.worker.rank_fingerprint, keys_of([1])[0])
    if pool.url.startswith("redis"):
        raw = raw_redis(pool.url)
        assert raw.delete(name) == 1
        raw.close()
    else:
        from kvtier.tiers.mooncake import MooncakeClient
        raw = MooncakeClient(pool.url, 10.0)
        assert raw._store.remove(name, True) == 0
        raw.close()
    report = reader.run(reader.manager.plan_load("first", keys_of([1, 2]), [5, 6]), reader.worker.submit_load)
    assert report.failed_block_ids == [5] and not report.bad_keys and report.gone_keys == keys_of([1])
    assert reader.manager.stats.bad_entries == 0 and reader.manager.stats.failed_load_blocks == 1
    tier = "redis" if pool.url.startswith("redis") else "mooncake"  # the tier's name: its kind's
    reader.manager.ledger.forget("first")  # the request ends: its failed block was recomputed
    assert reader.manager.ledger.misses == {f"evicted_{tier}": reader.manager.ledger.block_tokens}
    assert reader.manager.ledger.gone(keys_of([1])[0]) == f"evicted_{tier}"  # a later miss of it says so too
    third = Instance(pool.url)
    third.run(third.manager.plan_store("b", keys_of([1]), [1]), third.worker.submit_store)
    assert reader.lookup(keys_of([1, 2]), token="again") == 2
    assert reader.manager.host.num_pins == 0
    for instance in (writer, reader, third):
        instance.close()


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


def test_a_redis_cluster_node_that_goes_down_costs_bounded_time_and_the_pool_comes_back(tmp_path):
    """One master of three killed: lookups, stores and loads through the cluster fail within the
    pool's timeout (recompute), not after redis-py's own tries again; once the node is back and the
    cluster is ok, the pool is used again."""
    import redis
    from redis.cluster import key_slot

    from kvtier.cli.servers import REDIS_CLUSTER_SLOTS

    with local_redis_cluster(str(tmp_path), log_path=str(tmp_path / "cluster.log")) as cluster:
        writer, reader = Instance(cluster.url), Instance(cluster.url)
        keys = keys_of(range(1, 13))
        assert writer.run(writer.manager.plan_store("a", keys, list(range(1, 13))), writer.worker.submit_store).success
        assert reader.lookup(keys, token="before") == 12
        # The master of the first block's slot goes: its share of the slots is served by nobody.
        slot = key_slot(pool_key(writer.worker.rank_fingerprint, keys[0]).encode())
        down = slot * len(cluster.procs) // REDIS_CLUSTER_SLOTS
        command, _ = cluster.commands[down]
        os.killpg(cluster.procs[down].pid, signal.SIGKILL)
        cluster.procs[down].wait()
        began = time.monotonic()
        report = reader.run(reader.manager.plan_load("before", keys, list(range(13, 25))), reader.worker.submit_load)
        assert not report.success and 13 in report.failed_block_ids  # recomputed
        assert time.monotonic() - began < 2.5  # the pool's timeout (1 s), not redis-py's tries again
        began = time.monotonic()
        assert reader.lookup(keys, token="during") < 12
        report = writer.run(writer.manager.plan_store("b", keys_of([40, 41]), [25, 26]), writer.worker.submit_store)
        assert report.failed_writes == {"redis": keys_of([40, 41])}  # counted, not raised
        assert time.monotonic() - began < 2.5
        assert writer.manager.host.num_pins == 0 and reader.manager.host.num_pins == 0
        with open(tmp_path / "cluster.log", "a") as log:  # the same node again: its slots and its port
            cluster.procs[down] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        nodes = [redis.Redis(host="127.0.0.1", port=port) for port in cluster.ports]
        while not all(node.execute_command("CLUSTER INFO").get("cluster_state") == "ok" for node in nodes):
            assert time.monotonic() < deadline, "the cluster did not heal"
            time.sleep(0.1)
        for node in nodes:
            node.close()
        time.sleep(1.1)  # remote_retry_s: then kvtier connects again
        report = writer.run(writer.manager.plan_store("c", keys_of([50, 51, 52]), [27, 28, 29]),
                            writer.worker.submit_store)
        assert report.success and not report.failed_writes
        third = Instance(cluster.url)
        assert third.lookup(keys_of([50, 51, 52]), token="after") == 3
        for instance in (writer, reader, third):
            instance.close()


def test_what_redis_evicts_or_expires_on_its_own_reaches_the_index_as_it_happens(tmp_path):
    """A Redis that publishes its evictions and expiries (as ``kvtier serve redis`` starts it): every
    instance's index hears of this layout's entries it dropped, with no load asking for them, and
    its ledger says why they went; an answer that had found them is not reused. The server's other
    names (another layout's blocks, anything else) are not told."""
    import redis

    with local_redis(log_path=str(tmp_path / "redis.log"), maxmemory="3mb") as server:
        writer, reader = Instance(server.url), Instance(server.url)
        keys = keys_of([1, 2, 3])
        writer.run(writer.manager.plan_store("a", keys, [1, 2, 3]), writer.worker.submit_store)
        index = reader.manager.tier("redis")
        index.answer_s = 600.0  # an answer would stand all through the test, unless the news drops it
        assert reader.lookup(keys, token="t") == 3
        raw = redis.Redis.from_url(server.url)
        raw.set(pool_key(b"\x02" * 16, keys_of([4])[0]), b"x" * 100, px=50)  # another layout's: not news here
        raw.pexpire(pool_key(writer.worker.rank_fingerprint, keys[0]), 50)

        def heard(instance, wanted):
            deadline = time.monotonic() + 10
            while any(instance.manager.ledger.gone(key) is None for key in wanted):
                assert time.monotonic() < deadline, f"{wanted} not heard"
                time.sleep(0.05)

        heard(reader, keys[:1])
        filler = b"f" * (256 << 10)
        for i in range(40):  # 10 MiB into 3 MB: least recently used entries are evicted, ours among them
            raw.set(f"filler/{i}", filler)
        for instance in (reader, writer):
            heard(instance, keys)
            assert [instance.manager.ledger.gone(key) for key in keys] == ["evicted_redis"] * 3
            assert instance.manager.ledger.gone(keys_of([4])[0]) is None
            assert instance.manager.tier("redis").stats()["evictions"] == 3
        assert raw.exists(*[pool_key(writer.worker.rank_fingerprint, key) for key in keys]) == 0
        assert reader.lookup(keys, token="t") == 0  # asked again, not the answer that found them
        writer.close()
        reader.close()


def test_redis_eviction_notices_come_back_after_a_restart_and_a_server_that_publishes_none_is_said(
        tmp_path, caplog):
    """``GoneNotices`` on its own, on a server with a password: one set to publish nothing is said in
    the log; one that restarts (its notices lost meanwhile) is listened to again once it is back."""
    import logging
    import threading

    import redis

    from kvtier.tiers.redis import GoneNotices

    told, arrived = [], threading.Event()

    def tell(names):
        told.extend(names)
        arrived.set()

    with local_redis(log_path=str(tmp_path / "redis.log"), password="pool-secret") as server:
        raw = redis.Redis.from_url(server.url)
        raw.config_set("notify-keyspace-events", "")
        with caplog.at_level(logging.INFO, logger="kvtier.pool"):
            GoneNotices(server.url, 1.0, 60.0, ("kvtier/a/",), tell)._say_if_unpublished(raw)
        assert [r.message for r in caplog.records if "does not publish" in r.message] != []
        notices = GoneNotices(server.url, 1.0, 0.2, ("kvtier/a/",), tell)
        threading.Thread(target=notices.run, daemon=True).start()
        raw.config_set("notify-keyspace-events", "Eex")
        time.sleep(0.5)  # subscribed by now
        raw.set("kvtier/a/01", b"x", px=20)
        raw.set("kvtier/b/02", b"x", px=20)  # another prefix: not told
        assert arrived.wait(5) and told == ["kvtier/a/01"]
        server.stop()
        time.sleep(0.5)  # the notices' connection fails; they try again every 0.2 s
        server.start()
        raw = redis.Redis.from_url(server.url)
        arrived.clear()
        deadline = time.monotonic() + 10
        while not arrived.is_set():  # until the notices are back: an expiry before that is not heard
            assert time.monotonic() < deadline, "the notices did not come back"
            raw.set("kvtier/a/03", b"x", px=20)
            arrived.wait(0.3)
        assert told[1:2] == ["kvtier/a/03"] and notices.num_told >= 2


def test_an_entry_stored_again_before_its_eviction_notice_is_heard_is_not_told_gone(tmp_path):
    """A notice is heard after the fact: an entry expired (or evicted) and stored again before its notice
    is handled is held, and is not told as a removal; the others of the same burst are."""
    import threading

    import redis

    from kvtier.tiers.redis import GoneNotices

    told, held_up, release = [], threading.Event(), threading.Event()

    def tell(names):
        told.append(list(names))
        held_up.set()
        release.wait(10)  # the first burst holds the notices' thread while the next ones happen

    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        raw = redis.Redis.from_url(server.url)
        notices = GoneNotices(server.url, 1.0, 0.2, ("kvtier/a/",), tell)
        threading.Thread(target=notices.run, daemon=True).start()
        deadline = time.monotonic() + 10
        while not held_up.is_set():  # until subscribed: an expiry before that is not heard
            assert time.monotonic() < deadline, "no notice heard"
            raw.set("kvtier/a/00", b"x", px=20)
            held_up.wait(0.3)
        raw.set("kvtier/a/01", b"x", px=20)
        raw.set("kvtier/a/02", b"x", px=20)
        time.sleep(0.2)
        assert raw.exists("kvtier/a/01", "kvtier/a/02") == 0  # both expired, their notices published
        raw.set("kvtier/a/01", b"stored again")
        release.set()
        while len(told) < 2:
            assert time.monotonic() < deadline, f"the second burst was not told: {told}"
            time.sleep(0.05)
        assert told[1] == ["kvtier/a/02"] and notices.num_told == len(told[0]) + 1


@pytest.fixture(params=["redis", "redis-cluster", "mooncake", "file"])
def shared_tier(request, tmp_path):
    """A shared tier of each kind, and how to drop an entry from it as the tier itself would (an
    eviction, another instance's size bound): behind this instance's back, with no notice."""
    if request.param == "file":
        from kvtier.tiers.entry_files import entry_path

        (tmp_path / "shared").mkdir()
        yield f"file://{tmp_path / 'shared'}", lambda fp, key: entry_path(tmp_path / "shared", fp, key).unlink()
        return
    with start_pool(request.param, tmp_path) as server:
        if request.param.startswith("redis"):
            raw = raw_redis(server.url)  # a DEL publishes no eviction notice
            yield server.url, lambda fp, key: raw.delete(pool_key(fp, key))
        else:
            from kvtier.tiers.mooncake import MooncakeClient

            raw = MooncakeClient(server.url, 10.0)
            yield server.url, lambda fp, key: raw._store.remove(pool_key(fp, key), True)
        raw.close()


def test_what_a_shared_tier_drops_in_silence_is_found_by_asking_about_what_this_instance_stored(shared_tier):
    """Mooncake says nothing of its evictions, nor a directory of another instance's deletions: every
    ``remote_audit_s`` the index asks the tier about the blocks this instance stored, and tells those it
    no longer holds as evicted (a KV event's removal; a later miss's reason), with no load asking for
    them. Each is told once."""
    url, drop = shared_tier
    instance = Instance(url, track_holdings=True, remote_audit_s=0.2)
    keys, fp = keys_of([1, 2, 3]), instance.worker.rank_fingerprint
    instance.run(instance.manager.plan_store("a", keys, [1, 2, 3]), instance.worker.submit_store)
    index, ledger = instance.manager.tiers[0], instance.manager.ledger
    events = []

    def heard(key):
        deadline = time.monotonic() + 10
        while ledger.gone(key) is None:
            assert time.monotonic() < deadline, "the audit did not find the dropped block"
            time.sleep(0.02)
        events.extend(ledger.take_holdings())

    drop(fp, keys[0])
    heard(keys[0])
    assert [ledger.gone(key) for key in keys] == [f"evicted_{index.name}", None, None]
    assert ("evicted", index.name, keys[0]) in events
    asked = index.audit.num_asked
    while index.audit.num_asked < asked + 4:  # two more audits: the rest is still there, the dropped one not asked
        ledger.absorb()
        time.sleep(0.02)
    assert index.audit.num_found_gone == 1 and [ledger.gone(key) for key in keys[1:]] == [None, None]
    drop(fp, keys[2])
    heard(keys[2])
    assert index.audit.num_found_gone == 2 and ledger.gone(keys[1]) is None
    assert index.stats()["evictions"] == 2  # vllm:kvtier_evictions_total{tier}
    assert events.count(("evicted", index.name, keys[0])) == 1
    assert instance.manager.host.num_pins == 0
    instance.close()


def test_a_redis_expiry_both_heard_and_found_by_an_audit_is_told_once(tmp_path):
    """A Redis that publishes its expiries, audited often: an audit's EXISTS expires the entry itself,
    so the audit and the server's notice learn of it at the same moment. Whichever comes first tells
    it; the other is no news."""
    import redis

    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        instance = Instance(server.url, track_holdings=True, remote_audit_s=0.02)
        keys, fp = keys_of(range(1, 13)), instance.worker.rank_fingerprint
        instance.run(instance.manager.plan_store("a", keys, list(range(1, 13))), instance.worker.submit_store)
        assert instance.lookup(keys) == 12  # the lookup process is up, and listens for notices
        time.sleep(0.5)
        ledger, raw = instance.manager.ledger, redis.Redis.from_url(server.url)
        for key in keys:
            raw.pexpire(pool_key(fp, key), 30)
        deadline, told = time.monotonic() + 10, []
        while any(ledger.gone(key) is None for key in keys):
            assert time.monotonic() < deadline, "an expiry was neither heard nor found"
            told += ledger.take_holdings()
            time.sleep(0.005)
        time.sleep(0.5)  # any later notice or audit answer of the same expiries is in by now
        told += ledger.take_holdings()
        removed = [key for kind, _, key in told if kind == "evicted"]
        assert sorted(removed) == sorted(keys)
        index = instance.manager.tiers[0]
        assert index.num_told_gone + index.audit.num_found_gone >= len(keys)  # both saw some of them
        instance.close()


def test_an_expiry_heard_before_the_report_of_its_write_is_told_after_it_and_once(tmp_path):
    """An entry that expires soon after this instance wrote it: the server's notice can be heard before
    the write's report reaches the scheduler (it comes with a later engine step). Routers hear the
    block stored, then removed, each once, and the audit finds nothing more to tell."""
    import redis

    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        instance = Instance(server.url, track_holdings=True, remote_audit_s=0.05)
        keys, fp = keys_of(range(1, 9)), instance.worker.rank_fingerprint
        assert instance.lookup(keys_of([99])) == 0  # the lookup process is up, and listens for notices
        time.sleep(0.5)
        ledger, index, raw = instance.manager.ledger, instance.manager.tiers[0], redis.Redis.from_url(server.url)
        instance.worker.submit_store(instance.manager.plan_store("a", keys, list(range(1, 9))))
        deadline, reports = time.monotonic() + 10, []
        while not reports:  # the write is done; its report is not yet taken
            assert time.monotonic() < deadline, "the store did not finish"
            reports = instance.worker.poll()
            time.sleep(0.001)
        names = [pool_key(fp, key) for key in keys]
        for name in names:
            raw.pexpire(name, 10)
        while raw.exists(*names):
            assert time.monotonic() < deadline, "the entries did not expire"
            time.sleep(0.01)
        mine = lambda: [told for told in ledger.take_holdings() if told[1] == index.name]  # not the host pool's
        told = []
        # Until every notice is heard: heard later, after the write's report, the audit could find the
        # entries gone first.
        while len(told) + len(index._deferred) < len(keys):  # held back, or told
            assert time.monotonic() < deadline + 10, "the expiries were not heard"
            time.sleep(0.01)
            told += mine()
        assert told == []  # nothing said of a block before its write is reported
        instance.manager.on_reports(reports)
        told = mine()
        while len(told) < 2 * len(keys):
            assert time.monotonic() < deadline + 10, f"the expiries were not told: {told}"
            time.sleep(0.01)
            told += mine()
        assert told[:len(keys)] == [("stored", index.name, key) for key in keys]
        assert sorted(told[len(keys):]) == [("evicted", index.name, key) for key in sorted(keys)]
        time.sleep(0.5)  # the audit has asked about the stored blocks by now
        assert mine() == []
        assert index.audit.num_found_gone == 0 and index.num_told_gone == len(keys)
        assert instance.manager.host.num_pins == 0
        instance.close()


def test_existence_queries_never_wait_on_a_silent_pool():
    from kvtier.tiers import redis as redis_tier

    spec = TierSpec("redis", "kvtier.tiers.redis", "redis://127.0.0.1:9/0", timeout_s=1.0, retry_s=60)
    index = redis_tier.make_index(spec, 64, [b"\x01" * 16])  # nothing listens on port 9
    began = time.monotonic()
    answer = None
    while answer is None:
        answer = index.lookup(keys_of([1, 2]), "t")
        time.sleep(0.01)
    assert answer == [False, False] and time.monotonic() - began < 2
    assert index.lookup(keys_of([1]), "t") is None  # a new question is asked off this thread...
    overdue = index.num_overdue
    while answer != [False]:
        answer = index.lookup(keys_of([1]), "t")
        time.sleep(0.01)
    # ...and, the pool being marked down, answered by the lookup process without asking it: not given up
    # on at timeout_s.
    assert index.num_overdue == overdue
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


def test_redis_gets_fill_their_buffers_byte_exact_whatever_the_pool_holds(tmp_path):
    """Values are read off the socket straight into their header and slot: every size, and every
    kind of miss in one batch (absent, shorter, longer, another type) leaves the reply in step."""
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvtier.tiers.redis import RedisClient

    kinds = st.sampled_from(["whole", "absent", "shorter", "longer", "list"])
    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        client = RedisClient(server.url, 5.0, ttl_s=60)

        @settings(max_examples=40, deadline=None)
        @given(st.lists(st.tuples(kinds, st.integers(0, 300_000)), min_size=1, max_size=10), st.integers(0, 2**32))
        def check(entries, seed):
            rng = np.random.default_rng(seed)
            client._client.flushdb()
            names = [f"t/{i}" for i in range(len(entries))]
            headers = [rng.integers(0, 256, HEADER_BYTES, dtype=np.uint8) for _ in entries]
            payloads = [rng.integers(0, 256, size, dtype=np.uint8) for _, size in entries]
            whole = [i for i, (kind, _) in enumerate(entries) if kind == "whole"]
            assert client.put([names[i] for i in whole], [memoryview(headers[i]) for i in whole],
                              [memoryview(payloads[i]) for i in whole]) == [True] * len(whole)
            for name, (kind, size), header in zip(names, entries, headers):
                value = bytes(header) + bytes(size)
                if kind in ("shorter", "longer"):
                    client._client.set(name, value[:-1] if kind == "shorter" else value + b"x")
                elif kind == "list":
                    client._client.rpush(name, value)
            into = [(np.zeros(HEADER_BYTES, np.uint8), np.zeros(size, np.uint8)) for _, size in entries]
            found = client.get_into(names, [memoryview(h) for h, _ in into], [memoryview(p) for _, p in into])
            assert found == [True if kind == "whole" else None if kind == "absent" else False for kind, _ in entries]
            for i in whole:
                assert np.array_equal(into[i][0], headers[i]) and np.array_equal(into[i][1], payloads[i])
            assert client.exists(names) == [kind != "absent" for kind, _ in entries]  # the connection is in step
            assert all(0 < client._client.pttl(names[i]) <= 60_000 for i in whole)  # remote_ttl_s applied

        check()
        client.close()


def _mooncake_entries(server):
    from kvtier.tiers.mooncake import MooncakeClient

    writer = Instance(server.url)
    writer.run(writer.manager.plan_store("a", keys_of(range(4)), [1, 2, 3, 4]), writer.worker.submit_store)
    raw = MooncakeClient(server.url, 5.0)
    return writer, raw, [pool_key(writer.worker.rank_fingerprint, k) for k in keys_of(range(4))]


def test_mooncake_entries_damaged_truncated_or_foreign_are_misses(tmp_path):
    import numpy as np

    with local_mooncake(log_path=str(tmp_path / "mooncake.log")) as server:
        writer, raw, names = _mooncake_entries(server)
        store = raw._store
        entry = np.zeros(HEADER_BYTES + writer.worker.layout.slot_bytes, np.uint8)  # one object: header, block
        store.register_buffer(entry.ctypes.data, entry.nbytes)
        assert store.get_into(names[0], entry.ctypes.data, entry.nbytes) == entry.nbytes
        good = entry.copy()
        entry[HEADER_BYTES + 5] ^= 0xFF  # garbage in the block
        assert store.remove(names[0], True) == 0  # forced: the get above holds a lease
        assert store.put_from(names[0], entry.ctypes.data, entry.nbytes) == 0
        entry[:] = good
        assert store.remove(names[1]) == 0  # truncated
        assert store.put_from(names[1], entry.ctypes.data, entry.nbytes // 2) == 0
        entry[:HEADER_BYTES] = np.frombuffer(encode_header(b"\x99" * 16, keys_of([2])[0], good[HEADER_BYTES:]),
                                             np.uint8)
        assert store.remove(names[2]) == 0  # another model's
        assert store.put_from(names[2], entry.ctypes.data, entry.nbytes) == 0
        reader = Instance(server.url)
        assert reader.lookup(keys_of(range(4))) == 4
        report = reader.run(reader.manager.plan_load("r", keys_of(range(4)), [10, 11, 12, 13]),
                            reader.worker.submit_load)
        assert sorted(report.failed_block_ids) == [10, 11, 12]
        assert reader.manager.stats.bad_entries == 3 and reader.manager.host.num_pins == 0
        for w, r in zip(writer.tensors, reader.tensors):
            assert torch.equal(w[4].view(torch.int16), r[13].view(torch.int16))
        for instance in (writer, reader):
            instance.close()
        raw.close()


def test_a_mooncake_entry_is_written_once_and_one_evicted_is_written_again(tmp_path):
    with local_mooncake(log_path=str(tmp_path / "mooncake.log")) as server:
        writer, raw, names = _mooncake_entries(server)
        assert raw._store.remove(names[0]) == 0  # as eviction would
        other = Instance(server.url)  # other bytes for the same keys
        assert other.lookup(keys_of(range(4))) == 0
        report = other.run(other.manager.plan_store("b", keys_of([0, 1]), [7, 8]), other.worker.submit_store)
        assert report.success and not report.failed_writes  # the entry of key 1 is there: stored
        reader = Instance(server.url)
        assert reader.lookup(keys_of(range(4))) == 4
        report = reader.run(reader.manager.plan_load("r", keys_of([0, 1]), [20, 21]), reader.worker.submit_load)
        assert report.success
        for o, w, r in zip(other.tensors, writer.tensors, reader.tensors):
            assert torch.equal(o[7].view(torch.int16), r[20].view(torch.int16))  # written again
            assert not torch.equal(w[1].view(torch.int16), r[20].view(torch.int16))
            assert torch.equal(w[2].view(torch.int16), r[21].view(torch.int16))  # the first write's, left whole
            assert not torch.equal(o[8].view(torch.int16), r[21].view(torch.int16))
        for instance in (writer, other, reader):
            instance.close()
        raw.close()


def answer_holding_the_gil(index, keys):
    """An existence index's answer, asked by a thread that never lets go of the GIL (as vLLM's busy
    loop in its one-process layout): with a switch interval of 60 s no other thread of this
    process can take it meanwhile. First asked once normally, so that whatever threads the
    index's checks use are running."""
    import sys

    # Warmed up by an answer that came in time: one past ``timeout_s`` (a lookup process still
    # starting on a loaded machine) is a miss, which says nothing of the GIL.
    for attempt in itertools.count():
        overdue = index.num_overdue
        while index.lookup(keys, f"warm-up-{attempt}") is None:
            time.sleep(0.001)
        if index.num_overdue == overdue:
            break
        assert attempt < 10, "the index never answered within its timeout"
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        assert index.lookup(keys, "r") is None
        deadline, found = time.monotonic() + index.timeout_s + 5.0, None
        while found is None and time.monotonic() < deadline:  # nothing here lets go of the GIL
            found = index.lookup(keys, "r")
    finally:
        sys.setswitchinterval(interval)
    return found


def test_a_pool_existence_check_is_answered_while_the_engines_thread_never_lets_go_of_the_gil():
    """vLLM's one-process layout: the engine's busy loop keeps the GIL. With a switch interval of
    60 s no thread of this process could take it during this loop: the index asks through its
    lookup process, and this thread takes the answer when a shared count says it is there."""
    import redis

    from kvtier.tiers import redis as redis_tier

    fp = b"\x01" * 16
    with local_redis() as server:
        index = redis_tier.make_index(TierSpec("redis", "kvtier.tiers.redis", server.url, timeout_s=5.0), 64, [fp])
        keys = keys_of([1, 2])
        redis.Redis.from_url(server.url).set(pool_key(fp, keys[0]), b"stored")
        assert answer_holding_the_gil(index, keys) == [True, False]
        pid = index.lookups.pid
        index.close()
        assert not Path(f"/proc/{pid}").exists()  # the lookup process is gone with its index


class _Calls:
    """The real Mooncake client, with the names of the batch calls made through it written down."""

    def __init__(self, store):
        self._store, self.made = store, []

    def __getattr__(self, name):
        if name.startswith("batch_"):
            self.made.append(name)
        return getattr(self._store, name)


def test_mooncake_entries_move_in_one_piece_beside_their_headers_and_in_two_apart(tmp_path):
    """A CPU worker's slots have heads (``kvtier.common.host_slots``): an entry, header then block, is put
    and got as one buffer. A CUDA worker's do not: two buffers per entry. Both write the same
    entries: each reads, byte-exact, what the other wrote, and checks it."""
    import numpy as np

    from kvtier.common.host_slots import HostSlots
    from kvtier.tiers.registry import make_store

    slot_bytes, num_slots = 3 * 4096 + 64, 6
    payload = np.random.default_rng(5).integers(0, 256, (num_slots, slot_bytes), dtype=np.uint8)
    keys = keys_of(range(100, 100 + num_slots))
    with local_mooncake(log_path=str(tmp_path / "mooncake.log")) as server:
        stores, calls = {}, {}
        for head in (HEADER_BYTES, 0):
            slots = HostSlots(num_slots, slot_bytes, head)
            memory = np.zeros(slots.num_bytes, np.uint8)
            store = make_store(TierSpec("mooncake", "kvtier.tiers.mooncake", server.url, timeout_s=5.0, retry_s=1.0),
                               b"\x05" * 16, slot_bytes)
            store.attach(*slots.views(memory))
            store.connect()
            lease = store.client._lease
            lease.client._store = calls[head] = _Calls(lease.client._store)
            stores[head] = (store, memory, slots)
        one, two = stores[HEADER_BYTES], stores[0]
        for (store, _, _), first in ((one, 0), (two, 3)):  # each writes half of the entries
            store.host[first:first + 3] = payload[first:first + 3]
            assert store.write_from(keys[first:first + 3], list(range(first, first + 3)), [-1] * 3, 0.0) == [None] * 3
        for store, _, _ in (one, two):
            store.host[:] = 0
            assert store.read_into(keys, list(range(num_slots)), [-1] * num_slots, 0.0) == [None] * num_slots
            assert np.array_equal(store.host, payload)
        assert calls[HEADER_BYTES].made == ["batch_put_from", "batch_get_into"]
        assert calls[0].made == ["batch_put_from_multi_buffers", "batch_get_into_multi_buffers"]
        heads = one[2].views(one[1])[1]
        heads[2, 40] ^= 0xFF  # a head is scratch: a read writes the pool's header over whatever it holds
        one[0].host[2] ^= 1
        assert one[0].read_into([keys[2]], [2], [-1], 0.0) == [None]
        assert np.array_equal(one[0].host[2], payload[2])
        for store, _, _ in (one, two):
            store.close()


def test_a_store_finds_its_slots_buffers_and_addresses_by_arithmetic_exactly():
    """The views and addresses a pool store hands its client are the slots' own, for any layout of
    rows (heads before slots, or apart) and any batch of slot ids; ids past the end are refused."""
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvtier.tiers.pool import _Rows

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, 9), st.integers(1, 40), st.integers(0, 24), st.data())
    def check(count, width, gap, data):
        memory = np.random.default_rng(count * width + gap).integers(0, 256, (count, width + gap), dtype=np.uint8)
        rows = memory[:, gap:]  # rows that lie apart, as slots after their heads
        ids = data.draw(st.lists(st.integers(0, count - 1), max_size=12))
        spans = _Rows(rows).spans(ids)
        assert [bytes(view) for view in spans] == [rows[i].tobytes() for i in ids]
        assert spans.addresses == [rows[i].ctypes.data for i in ids]
        for view, i in zip(spans, ids):  # writes land in the row itself
            view[:] = bytes(range(width))
            assert rows[i].tobytes() == bytes(range(width))
        with pytest.raises(IndexError):
            _Rows(rows).spans(ids + [count])

    check()


def test_an_idle_step_waits_for_a_pool_checks_answer_not_for_its_bound():
    """``wait_for_answers`` (an engine step with nothing to compute while a lookup waits for the pool)
    returns once the lookup process has answered: the next lookup has the answer at once."""
    import redis

    from kvtier.tiers import redis as redis_tier

    fp = b"\x01" * 16
    with local_redis() as server:
        index = redis_tier.make_index(TierSpec("redis", "kvtier.tiers.redis", server.url, timeout_s=30.0), 64, [fp])
        keys = keys_of([1, 2])
        redis.Redis.from_url(server.url).set(pool_key(fp, keys[0]), b"stored")
        index.wait_for_answers(30.0)  # no lookup waits: returns at once
        assert index.num_waits == 0
        for token in ("first", "second"):  # the first also waits for the lookup process's client to connect
            assert index.lookup(keys, token) is None
            began = time.monotonic()
            index.wait_for_answers(30.0)
            assert index.lookup(keys, token) == [True, False]
            assert time.monotonic() - began < 20.0, "waited for the bound, not for the answer"
        assert index.num_waits == 2
        index.close()
