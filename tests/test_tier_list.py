"""The ``tiers`` key: the tiers below the host pool as an ordered list of URLs, each with its own
options; the shorthand keys (``disk_dir``, ``disk_bytes``, ``remote_url``, ``store_to``) expand
into the same list. Two disk tiers on two directories, through the real I/O process."""

import json
import os
from pathlib import Path

import pytest
import torch

from kvtier.common.config import ConfigError, KVTierConfig
from kvtier.tiers.registry import tier_specs
from tests.test_tiering import Engine, keys_of, layouts, randomize


def specs(extra, environ=None):
    return tier_specs(KVTierConfig.from_sources(extra, environ=environ or {}))


def test_the_shorthand_is_the_list_it_stands_for(tmp_path):
    shared = tmp_path / "shared"
    short = specs({"disk_dir": str(tmp_path / "d ir"), "disk_bytes": "3GiB", "remote_url": f"file://{shared}",
                   "store_to": "remote", "remote_timeout_s": 4, "remote_answer_s": 3})
    listed = specs({"tiers": [f"disk://{tmp_path}/d%20ir?max_bytes=3GiB&write=false", f"file://{shared}"],
                    "remote_timeout_s": 4, "remote_answer_s": 3})  # the remote_* keys: every tier's defaults
    assert short == listed
    assert [(s.name, s.module, s.location, s.capacity_bytes, s.options["write"]) for s in listed] == [
        ("disk", "kvtier.tiers.disk", f"{tmp_path}/d ir", 3 << 30, False),
        ("file", "kvtier.tiers.shared_dir", f"file://{shared}", None, True)]
    own = specs({"tiers": [f"disk://{tmp_path}", f"file://{shared}?max_bytes=1GiB&timeout_s=4&answer_s=3"]})
    assert [(s.timeout_s, s.options["answer_s"]) for s in own] == [(2.0, 1.0), (4.0, 3.0)]  # each tier its own
    assert own[1].location == f"file://{shared}?max_bytes=1GiB"  # the tier's own query, as written
    default = specs({})
    assert [(s.name, s.capacity_bytes) for s in default] == [("disk", 16 << 30)]  # the embedded default


def test_a_relative_disk_dir_is_the_directory_under_the_working_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert [(s.name, s.location) for s in specs({"disk_dir": "kv-cache"})] == [("disk", str(tmp_path / "kv-cache"))]
    assert [s.location for s in specs({"disk_dir": "~/kv"})] == [str(Path.home() / "kv")]


def test_tiers_come_from_yaml_and_from_the_environment_in_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    yaml_file = tmp_path / "kvtier.yaml"
    yaml_file.write_text(f"tiers:\n  - disk://{a}?max_bytes=1MiB\n  - disk://{b}?name=nvme1&threads=3\n")
    from_yaml = specs({"config_file": str(yaml_file)})
    assert [(s.name, s.location, s.capacity_bytes, s.threads) for s in from_yaml] == [
        ("disk", str(a), 1 << 20, 2), ("nvme1", str(b), 16 << 30, 3)]
    as_json = specs({}, {"KVTIER_TIERS": json.dumps([f"disk://{b}", f"disk://{a}"])})
    as_words = specs({}, {"KVTIER_TIERS": f"disk://{b}, disk://{a}"})
    assert [(s.name, s.location) for s in as_json] == [(s.name, s.location) for s in as_words] == [
        ("disk", str(b)), ("disk2", str(a))]
    assert specs({"tiers": []}) == []  # no tier below the host pool


@pytest.mark.parametrize("extra, words", [
    ({"tiers": ["ftp://host/x"]}, "tier 0 (ftp://...): scheme 'ftp' is not one of"),
    ({"tiers": ["disk:///tmp", "disk://relative"]}, "tier 1 (disk://...): a disk:// URL names a local directory"),
    ({"tiers": ["disk:///tmp?size=1"]}, "unknown disk:// option(s) ['size']"),
    ({"tiers": ["disk:///tmp?max_bytes=lots"]}, "not a size"),
    ({"tiers": ["disk:///tmp?timeout_s=0"]}, "option timeout_s='0' is not allowed"),
    ({"tiers": ["disk:///tmp?write=perhaps"]}, "option write='perhaps' is not allowed"),
    ({"tiers": ["disk:///tmp?name=a", "disk:///var/tmp?name=a"]}, "tier name 'a' is taken"),
    ({"tiers": ["disk:///tmp?name=host"]}, "reserved"),
    ({"tiers": ["mooncake://127.0.0.1:1"]}, "needs ?metadata="),
    ({"tiers": {"disk": "/tmp"}}, "not a list of tier URLs"),
    ({"tiers": "no-scheme"}, "scheme '' is not one of"),
])
def test_a_bad_tier_fails_at_start_up_naming_the_key_and_the_entry(extra, words):
    with pytest.raises(ConfigError, match="key 'tiers'") as error:  # the key's own options, or its tiers'
        tier_specs(KVTierConfig.from_sources(extra, environ={}))
    assert words in str(error.value)


def test_a_disk_tier_in_a_directory_kvtier_cannot_write_fails_at_start_up(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="key 'tiers'.*is not a directory"):
        tier_specs(KVTierConfig.from_sources({"tiers": [f"disk://{tmp_path}/file/kv"]}, environ={}))


@pytest.mark.parametrize("key, value", [("disk_dir", "/tmp"), ("remote_url", "file:///tmp"), ("store_to", "disk")])
def test_tiers_and_a_shorthand_key_at_once_is_refused(key, value, tmp_path):
    with pytest.raises(ConfigError, match=f"key 'tiers' lists the tiers, so key '{key}' cannot be set beside it"):
        KVTierConfig.from_sources({"tiers": [f"disk://{tmp_path}"], key: value}, environ={})
    with pytest.raises(ConfigError, match=f"key '{key}' cannot be set beside it"):  # from two sources too
        KVTierConfig.from_sources({"tiers": [f"disk://{tmp_path}"]}, environ={f"KVTIER_{key.upper()}": value})


def test_remote_url_names_a_shared_tier_only(tmp_path):
    with pytest.raises(ConfigError, match="key 'remote_url'.*not shared between instances"):
        tier_specs(KVTierConfig.from_sources({"remote_url": f"disk://{tmp_path}"}, environ={}))


def test_two_disk_tiers_on_two_directories_load_in_lookup_order_byte_exact(tmp_path):
    """Both written through; a later configuration reads either one alone; a tier with
    write=false is read but not written; a block is loaded from the first tier that holds it."""
    a, b = tmp_path / "a", tmp_path / "b"
    tensors = layouts()[0][1]
    randomize(tensors)
    original = [t.clone() for t in tensors]

    def engine(*urls):
        return Engine(tensors, None, host_blocks=6, tiers=list(urls))

    both = engine(f"disk://{a}", f"disk://{b}")
    assert [t.name for t in both.manager.tiers] == ["disk", "disk2"]
    both.store(keys_of(range(6)), [1, 2, 3, 4, 5, 6])
    both.store(keys_of(range(100, 106)), [40, 41, 42, 43, 44, 45])  # the first six are in the tiers only
    assert all(both.manager.tier("disk").lookup(keys_of(range(6))))
    assert all(both.manager.tier("disk2").lookup(keys_of(range(6))))
    both.close()

    def load_back(engine_, keys, sources, blocks_from):
        for t in tensors:
            t[10:16].zero_()
        job, report = engine_.load(keys, list(range(10, 16)))
        assert report.success and job.fill_from == sources
        for target, source in zip(range(10, 16), blocks_from):
            assert all(torch.equal(t[target].view(torch.uint8), o[source].view(torch.uint8))
                       for t, o in zip(tensors, original))

    only_b = engine(f"disk://{b}?name=nvme1")  # the second directory alone, under a name of its own
    load_back(only_b, keys_of(range(6)), ["nvme1"] * 6, [1, 2, 3, 4, 5, 6])
    only_b.close()

    reading_a = engine(f"disk://{a}?write=false", f"disk://{b}")
    load_back(reading_a, keys_of(range(6)), ["disk"] * 6, [1, 2, 3, 4, 5, 6])  # a first: it holds them too
    for t, o in zip(tensors, original):
        t[20:26].copy_(o[20:26])
    reading_a.store(keys_of(range(200, 206)), list(range(20, 26)))  # written to b only
    reading_a.store(keys_of(range(300, 306)), [40, 41, 42, 43, 44, 45])
    assert not any(reading_a.manager.tier("disk").lookup(keys_of(range(200, 206))))
    load_back(reading_a, keys_of(range(200, 206)), ["disk2"] * 6, list(range(20, 26)))
    assert reading_a.manager.host.num_pins == 0
    reading_a.close()


PLUGIN_DIR = str(__import__("pathlib").Path(__file__).resolve().parent / "plugin_tier")


@pytest.fixture
def memo_plugin(monkeypatch):
    """``tests/plugin_tier``: a distribution that adds the ``memo://`` tier (``memo_tier.py``), on the
    path of this process and of the I/O processes it starts, as an installed one would be."""
    import sys

    from kvtier.tiers import registry

    monkeypatch.syspath_prepend(PLUGIN_DIR)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [PLUGIN_DIR, os.environ.get("PYTHONPATH")])))
    registry._plugins.cache_clear()
    yield
    registry._plugins.cache_clear()
    sys.modules.pop("memo_tier", None)


def test_a_tier_written_against_the_contract_alone_serves_hits_byte_exact(memo_plugin, tmp_path):
    """A tier from another distribution (an entry point, no line in kvtier): listed before the disk,
    it is written through, and a block the host pool dropped is loaded from it, not the disk."""
    tensors = layouts()[0][1]
    randomize(tensors)
    original = [t.clone() for t in tensors]
    engine = Engine(tensors, None, host_blocks=6, tiers=["memo://", f"disk://{tmp_path}"])
    assert [(t.name, type(t).__name__) for t in engine.manager.tiers] == [("memo", "MemoIndex"), ("disk", "DiskIndex")]
    engine.store(keys_of(range(6)), [1, 2, 3, 4, 5, 6])
    engine.store(keys_of(range(100, 106)), [40, 41, 42, 43, 44, 45])
    for t in tensors:
        t[10:16].zero_()
    job, report = engine.load(keys_of(range(6)), list(range(10, 16)))
    assert report.success and job.fill_from == ["memo"] * 6
    assert all(torch.equal(t[10:16].view(torch.uint8), o[1:7].view(torch.uint8)) for t, o in zip(tensors, original))
    assert engine.manager.host.num_pins == 0 and engine.manager.tier("memo").stats() == {"entries": 12}
    engine.close()
