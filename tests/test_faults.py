"""Faults and hostile input, one test per case of the README's "Faults kvtier survives":
real servers, real processes, real files."""

import contextlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvtier.config import ConfigError, KVTierConfig
from kvtier.servers import local_mooncake, local_redis
from kvtier.tiers.base import TierSpec
from tests.e2e.apps import ROOT

FP = b"\x07" * 16


def keys_of(ids):
    return [i.to_bytes(16, "little") for i in ids]


def test_a_failing_pool_never_closes_its_client_under_a_call_in_flight(tmp_path):
    """Every call fails while others are inside the client: the process lives on (closing a
    Mooncake client under a batch call killed it with SIGSEGV), no call is left in flight."""
    with local_mooncake(log_path=str(tmp_path / "mooncake.log")) as server:
        run = subprocess.run([sys.executable, "-m", "tests.e2e.pool_churn", server.url, "5"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["failures"] >= 2 and result["in_flight"] == 0 and result["calls"] > result["failures"]


def test_urls_that_kvtier_prints_carry_no_password(tmp_path, caplog):
    with pytest.raises(ConfigError) as error:
        KVTierConfig.from_sources({"remote_url": "redis://:hunter2@/0"}, environ={})
    assert "remote_url" in str(error.value) and "hunter2" not in str(error.value)
    with pytest.raises(ConfigError) as error:
        KVTierConfig.from_sources({"remote_url": "ftp://kv:hunter2@host/x?password=hunter2"}, environ={})
    assert "remote_url" in str(error.value) and "hunter2" not in str(error.value)

    from kvtier.tiers.pool import GuardedClient
    from kvtier.tiers.redis import RedisClient

    with local_redis(log_path=str(tmp_path / "redis.log"), password="hunter2") as server:
        guarded = GuardedClient(server.url, lambda: RedisClient(server.url, 0.5), 0.5, 60)
        assert guarded.call("exists", ["x"]) == [False]
        wrong = server.url.replace("hunter2", "hunter3")
        refused = GuardedClient(wrong, lambda: RedisClient(wrong, 0.5), 0.5, 60)
        server.stop()
        with caplog.at_level(logging.WARNING, logger="kvtier.pool"):
            assert guarded.call("exists", ["x"]) is None
            assert refused.call("exists", ["x"]) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.pool"]
    assert len(lines) == 2 and all("redis://:***@127.0.0.1" in line for line in lines)
    assert not any("hunter" in line for line in lines)


def test_the_native_copier_refuses_a_bad_table_before_moving_a_byte():
    from kvtier._native import copy_runs

    device = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
    host = np.zeros((2, 64), np.uint8)
    good = np.array([[device.ctypes.data, 64, 0, 64]], np.int64)
    ids, slots = np.array([1, 3], np.int64), np.array([0, 1], np.int64)
    args = (host.ctypes.data, 64, 4, 2, True)
    assert copy_runs.copy_blocks(good, ids, slots, *args) == 128
    assert (host == device[[1, 3]]).all()
    host[:] = 0
    for table in ([[device.ctypes.data, 64, 0, -1]],  # a negative length
                  [[device.ctypes.data, 64, 32, 64]],  # runs past the slot's end
                  [[device.ctypes.data, 64, -8, 8]],  # before the slot's start
                  [[device.ctypes.data, -64, 0, 64]]):  # a negative stride
        with pytest.raises(ValueError, match="does not fit a slot"):
            copy_runs.copy_blocks(np.array(table, np.int64), ids, slots, *args)
    with pytest.raises(ValueError, match="int64"):  # int32 ids are not read as half as many int64
        copy_runs.copy_blocks(good, ids.astype(np.int32), slots.astype(np.int32), *args)
    with pytest.raises(ValueError, match="int64"):
        copy_runs.copy(np.zeros(2, np.int32), np.zeros(2, np.int32), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="negative length"):
        copy_runs.copy(np.array([host.ctypes.data]), np.array([device.ctypes.data]), np.array([-1]))
    assert not host.any()  # nothing was copied by a refused call


def _redis_store(url, slot_bytes, num_slots, ttl_s=0.0):
    from kvtier.tiers import redis as redis_tier

    spec = TierSpec("redis", "kvtier.tiers.redis", url, timeout_s=2.0, retry_s=60, options={"ttl_s": ttl_s})
    store = redis_tier.make_store(spec, FP, slot_bytes)
    host = np.random.default_rng(1).integers(0, 255, (num_slots, slot_bytes), np.uint8)
    store.attach(host)
    return store, host


def test_a_full_redis_refuses_writes_without_taking_the_pool_down(tmp_path):
    """Redis at maxmemory with noeviction: the writes that do not fit are refused one by one;
    reads of what is stored, and later writes that fit, go on (one refused SET used to mark
    the whole pool down)."""
    with local_redis(log_path=str(tmp_path / "redis.log"), maxmemory="4mb", policy="noeviction") as server:
        store, host = _redis_store(server.url, 256 << 10, 32)
        reasons = store.write_from(keys_of(range(32)), list(range(32)), [-1] * 32, 0)
        stored = [i for i, reason in enumerate(reasons) if reason is None]
        refused = [reason for reason in reasons if reason is not None]
        assert stored and refused and all(reason == "refused by the storage pool" for reason in refused)
        assert store.client.available and store.client.num_failures == 0
        expected = host[stored].copy()
        host[stored] = 0
        assert store.read_into(keys_of(stored), stored, [-1] * len(stored), 0) == [None] * len(stored)
        assert (host[stored] == expected).all()
        store.close()


def test_kvtier_serve_redis_is_bounded_and_entries_expire(tmp_path):
    import redis

    with local_redis(log_path=str(tmp_path / "redis.log"), maxmemory="4mb") as server:  # serve's policy: LRU
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        store, _ = _redis_store(server.url, 256 << 10, 32, ttl_s=3600)
        assert store.write_from(keys_of(range(32)), list(range(32)), [-1] * 32, 0) == [None] * 32  # old ones evicted
        assert int(client.info("memory")["used_memory"]) <= 5 << 20
        ttls = [client.ttl(name) for name in client.keys("kvtier/*")]
        assert ttls and all(3500 < ttl <= 3600 for ttl in ttls)
        store.close()
    assert KVTierConfig.from_sources({}, environ={}).remote_ttl_s == 86400


def test_an_existence_check_past_its_deadline_marks_the_pool_down_at_once(tmp_path):
    """The pool answers, but a byte every 0.3 s (each socket read within the client's 0.5 s
    timeout, the whole answer 2.4 s): the lookup is a miss at ``remote_timeout_s``, and the
    pool is down from that moment, not from the late answer; checks waiting at once are capped."""
    from kvtier.tiers import redis as redis_tier
    from tests.e2e.relay import Relay

    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        relay = Relay(("127.0.0.1", server.port), arm_on=b"EXISTS", trickle_s=0.3)
        url = f"redis://127.0.0.1:{relay.port}/0"
        spec = TierSpec("redis", "kvtier.tiers.redis", url, timeout_s=0.5, retry_s=60)
        index = redis_tier.make_index(spec, 64, [FP])
        began = time.monotonic()
        while (answer := index.lookup(keys_of([1, 2]), "slow")) is None:
            time.sleep(0.01)
        waited = time.monotonic() - began
        assert answer == [False, False] and 0.5 <= waited < 1.5
        assert not index.client.available and index.num_overdue == 1
        assert index.lookup(keys_of([3]), "next") is None
        time.sleep(0.05)
        assert index.lookup(keys_of([3]), "next") == [False]  # down: answered at once
        index.close()
        relay.close()

    capped = redis_tier.make_index(TierSpec("redis", "kvtier.tiers.redis", "redis://127.0.0.1:9/0", timeout_s=30,
                                            retry_s=60), 64, [FP])
    capped._exists = lambda keys: time.sleep(5)  # every check hangs
    assert all(capped.lookup(keys_of([i]), f"t{i}") is None for i in range(64))
    assert capped.lookup(keys_of([99]), "t99") == [False] and capped.num_refused == 1
    capped.close()


@pytest.mark.parametrize("value, why", [
    ("", "an empty path"),
    ("{file}", "is not a directory"),
    ("{file}/below", "is not a directory"),
    ("{readonly}/kvtier", "not writable"),
])
def test_a_disk_dir_that_cannot_work_fails_at_start_up_naming_the_key(tmp_path, value, why):
    (tmp_path / "file").write_bytes(b"x")
    readonly = tmp_path / "readonly"
    with _tmpfs(readonly, "64k", read_only=True):
        with pytest.raises(ConfigError, match=f"key 'disk_dir'.*{why}"):
            KVTierConfig.from_sources({"disk_dir": value.format(file=tmp_path / "file", readonly=readonly)},
                                      environ={})


@contextlib.contextmanager
def _tmpfs(path, size, read_only=False):
    """A small filesystem of its own at ``path`` (a real ENOSPC, a real EROFS)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700" + (",ro" if read_only else ""), "tmpfs",
                    str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _disk_engine(disk_dir, **config):
    from tests.test_tiering import Engine, layouts

    return Engine(layouts()[0][1], str(disk_dir), host_blocks=4, disk_blocks=64, **config)


@pytest.mark.parametrize("tier, fault", [("disk", "ENOSPC"), ("file", "ENOSPC"), ("file", "EROFS")])
def test_a_full_or_read_only_disk_is_said_once_and_writes_pause(tmp_path, caplog, tier, fault):
    """A 64 KiB tmpfs under the tier (a real ENOSPC), or the same remounted read-only (a real
    EROFS; the disk tier keeps its file open, so only the shared-directory tier can meet one):
    the writes that fail are counted, one warning names the errno, what was written loads
    byte-exact, pins go to 0."""
    from tests.test_tiering import keys_of, randomize

    with _tmpfs(tmp_path / "fs", "64k") as fs:
        config = {} if tier == "disk" else {"remote_url": f"file://{fs}", "store_to": "remote"}
        engine = _disk_engine(fs if tier == "disk" else tmp_path / "disk", **config)
        randomize(engine.tensors)
        expected = [t[:4].clone() for t in engine.tensors]
        assert engine.store(keys_of(range(4)), list(range(4)))[0].success  # 4 blocks, 18 KiB: they fit
        if fault == "EROFS":
            subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        with caplog.at_level(logging.WARNING, logger="kvtier.worker"):
            failed = []
            for first in range(4, 44, 4):  # 40 more blocks, 180 KiB: past the filesystem's end
                reports = engine.store(keys_of(range(first, first + 4)), list(range(first, first + 4)))
                failed += reports[0].failed_writes.get(tier, [])
        assert failed, "no write failed"
        lines = [r.getMessage() for r in caplog.records if f"writes to tier {tier} failed" in r.getMessage()]
        assert len(lines) == 1 and fault in lines[0]
        for t in engine.tensors:
            t[:4] = 0
        while engine.manager.lookup(keys_of(range(4)), token="r") is None:
            time.sleep(0.01)
        job, report = engine.load(keys_of(range(4)), [44, 45, 46, 47])
        assert report.success and set(job.fill_from) <= {tier, None}
        assert all(torch.equal(t[44:48].view(torch.int16), e.view(torch.int16))
                   for t, e in zip(engine.tensors, expected))
        assert engine.manager.host.num_pins == 0 and engine.manager.num_pending == 0
        engine.close()


def test_a_shared_directory_deleted_under_a_running_instance_is_made_again_owner_only(tmp_path):
    from tests.test_tiering import keys_of

    shared = tmp_path / "shared"
    engine = _disk_engine(tmp_path / "disk", remote_url=f"file://{shared}", store_to="remote")
    assert engine.store(keys_of([1]), [1])[0].success
    shutil.rmtree(shared)
    assert engine.store(keys_of([2]), [2])[0].success  # not "every later write fails, forever"
    made = [p for p in shared.rglob("*") if p.is_dir()] + [shared]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in made)
    engine.close()


def test_a_symbolic_link_planted_in_disk_dir_is_not_followed(tmp_path):
    from kvtier.tiers.disk import DiskIndex

    disk, elsewhere = tmp_path / "disk", tmp_path / "elsewhere"
    disk.mkdir()
    elsewhere.mkdir()
    fingerprint = b"\x05" * 16
    (disk / fingerprint.hex()).symlink_to(elsewhere)
    with pytest.raises(OSError, match="symbolic link"):
        DiskIndex(disk, 1 << 20, 4096, [fingerprint])
    assert not list(elsewhere.iterdir())
