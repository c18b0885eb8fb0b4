"""Namespace records and the probe that tells "stored under another namespace" from "never
stored": real disk and shared-directory tiers, entries written by their own stores."""

import json
import os
import time

from contextlib import contextmanager

import numpy as np
import pytest

from kvtier.tiers import namespaces
from kvtier.common.keys import Namespace, block_keys
from kvtier.tiers.base import TierSpec
from kvtier.tiers.registry import make_index, make_store, release_outside

SLOT = 4096
TOKENS = list(range(100, 100 + 64))


def namespace(block_size: int) -> Namespace:
    return Namespace("m", "torch.float32", "kv", (1, 8), 2, block_size, weights="w")


@contextmanager
def tier_of(kind: str, tmp_path):
    if kind == "disk":
        yield TierSpec("disk", "kvtier.tiers.disk", str(tmp_path / "disk"), 64 * (SLOT + 64))
    elif kind == "file":
        yield TierSpec("file", "kvtier.tiers.shared_dir", f"file://{tmp_path / 'shared'}")
    else:
        from kvtier.cli.servers import local_mooncake, local_redis
        with (local_redis if kind == "redis" else local_mooncake)(log_path=str(tmp_path / f"{kind}.log")) as server:
            yield TierSpec(kind, f"kvtier.tiers.{kind}", server.url, timeout_s=5)


def store_blocks(tier: TierSpec, space: Namespace, tokens) -> dict:
    """What an instance of ``space`` does: its record, and the prompt's full blocks written."""
    rank = space.for_rank(0, "cpu").fingerprint()
    record = namespaces.record_of(space, [rank], SLOT)
    assert namespaces.write_all([tier], record) == []
    keys = block_keys(space.fingerprint(), tokens, space.block_size)
    index, store = make_index(tier, SLOT, [rank]), make_store(tier, rank, SLOT)
    store.attach(np.random.default_rng(0).integers(0, 256, (len(keys), SLOT), dtype=np.uint8))
    places = index.prepare_store(keys)
    keys = list(places)
    assert store.write_from(keys, list(range(len(keys))), list(places.values()),
                            time.monotonic() + 10) == [None] * len(keys)
    index.complete_store(keys, [])
    index.close()
    store.close()
    return record


def namespaces_root(tier: TierSpec) -> str:
    return tier.location if tier.name == "disk" else tier.location[len("file://"):]


def answers(probe, want: int, timeout_s: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += probe.take()
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("kind", ["disk", "file", "redis", "mooncake"])
def test_a_block_held_under_another_namespace_is_told_from_one_never_stored(tmp_path, kind):
    with tier_of(kind, tmp_path) as tier:
        other = store_blocks(tier, namespace(16), TOKENS)
        ours = namespaces.record_of(namespace(32), [namespace(32).for_rank(0, "cpu").fingerprint()], SLOT)
        probe = namespaces.ForeignProbe([tier], ours, timeout_s=2)
        deadline = time.monotonic() + 20
        while not probe.foreign and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r["fingerprint"] for r in probe.foreign] == [other["fingerprint"]]
        assert probe.submit(TOKENS, 32, (), 32)  # block 1 of ours: tokens 32..63, held there as block 2
        assert probe.submit(TOKENS[:32] + [7] * 32, 32, (), 32)  # other tokens: nobody stored them
        assert probe.submit(TOKENS, 0, ("lora:a:1",), 64)  # same tokens, another adapter: other keys
        assert answers(probe, 3) == [("namespace_differs", 32), ("never_stored", 32), ("never_stored", 64)]
        probe.close()
        # This instance's record is left by the probe's thread, beside the other's.
        assert {r["fingerprint"]: r for r in namespaces.read_all([tier])} == {
            ours["fingerprint"]: ours, other["fingerprint"]: other}
        release_outside(tier)  # the client that read them, closed while its pool is up
    assert namespaces.differences(ours, other) == ["block_size: 32 here, 16 there"]
    if kind in ("disk", "file"):
        assert oct(os.stat(os.path.join(namespaces_root(tier), "namespaces")).st_mode & 0o777) == "0o700"


def test_with_no_other_namespace_a_miss_is_never_stored_at_once(tmp_path):
    tier = TierSpec("disk", "kvtier.tiers.disk", str(tmp_path / "disk"), 64 * (SLOT + 64))
    ours = namespaces.record_of(namespace(32), [b"r" * 16], SLOT)
    probe = namespaces.ForeignProbe([tier], ours, timeout_s=2)
    time.sleep(0.2)
    assert not probe.submit(TOKENS, 0, (), 64)  # the caller counts it as never stored itself
    probe.close()


def test_records_that_are_not_well_formed_are_skipped(tmp_path):
    folder = tmp_path / "namespaces"
    folder.mkdir()
    (folder / "a.json").write_text("{not json")
    (folder / "b.json").write_text(json.dumps({"fingerprint": "zz", "rank_fingerprints": [], "slot_bytes": 1,
                                               "namespace": {"block_size": 16}}))
    good = namespaces.record_of(namespace(16), [b"r" * 16], SLOT)
    namespaces.write_record_in(str(tmp_path), good)
    assert namespaces.read_records_in([str(tmp_path)]) == [good]


def test_key_at_names_the_other_namespaces_block_covering_a_position():
    other = namespaces.record_of(namespace(16), [], SLOT)
    keys = block_keys(namespace(16).fingerprint(), TOKENS, 16)
    assert namespaces.key_at(other, TOKENS, 40) == keys[2]
    assert namespaces.key_at(other, TOKENS[:40], 32) is None  # that block is not full


def test_the_disk_events_journal_keeps_to_what_the_disk_holds_while_it_runs(tmp_path):
    """Stores and evictions for a long time: the journal is rewritten to the live blocks once
    the records past them pile up, and a restart reads back exactly the live ones."""
    from kvtier.integrations.vllm.events import BlockMeta, meta_of
    from kvtier.scheduler.announcements import DiskJournal

    path = tmp_path / "entries-0.kvtier.events"
    journal = DiskJournal(path, set(), meta_of=meta_of)
    meta = [BlockMeta(os.urandom(32), None, tuple(range(16)), None, None, None) for _ in range(10)]
    keys = [os.urandom(16) for _ in range(10)]
    for round_ in range(500):  # 5,000 stores, the disk never holding more than 10 blocks
        for key, one in zip(keys, meta):
            journal.drop(key)
            journal.append(key, one)
    journal.close()
    assert path.stat().st_size < 2 * 10 * 100 + 1000 * 100  # one record is under 100 bytes
    again = DiskJournal(path, set(keys[:4]), meta_of=meta_of)  # the disk holds 4 of them now
    deadline = time.monotonic() + 10
    found = []
    while len(found) < 4 and time.monotonic() < deadline:
        found += again.take_found()
    again.close()
    assert sorted(found, key=lambda item: item[0]) == sorted(zip(keys[:4], meta[:4]), key=lambda item: item[0])


def test_a_block_stored_again_since_the_journals_last_rewrite_is_announced_once_at_restart(tmp_path):
    """Each store of a block appends a record; a restart announces the block once, with its last
    record's metadata (it announced every record before: one block, many "stored" events)."""
    from kvtier.integrations.vllm.events import BlockMeta, meta_of
    from kvtier.scheduler.announcements import DiskJournal

    path = tmp_path / "entries-0.kvtier.events"
    key = os.urandom(16)
    first, last = (BlockMeta(os.urandom(32), None, tuple(range(16)), None, None, None) for _ in range(2))
    journal = DiskJournal(path, set(), meta_of=meta_of)
    journal.append(key, first)
    journal.close()
    journal = DiskJournal(path, {key}, meta_of=meta_of)  # rewritten to the one record, then the block is evicted and stored again
    journal.drop(key)
    journal.append(key, last)
    journal.close()
    again = DiskJournal(path, {key}, meta_of=meta_of)
    again.close()  # the journal is read before its thread takes the close
    assert again.take_found() == [(key, last)]
