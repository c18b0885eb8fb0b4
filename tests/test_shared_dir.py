"""The shared-filesystem tier (``file:///path``), built through the tier interface alone:
two instances on one directory, as on an NFS mount or a Kubernetes volume."""

import os

import pytest
import torch

from kvtier.common.config import ConfigError, KVTierConfig
from kvtier.common.entry import HEADER_BYTES
from kvtier.tiers.disk import entries_in
from kvtier.tiers.entry_files import entry_path
from kvtier.tiers.registry import tier_specs
from tests.damage import flip_byte
from tests.test_remote import BS, Instance, answer_holding_the_gil, keys_of


@pytest.fixture
def shared(tmp_path):
    path = tmp_path / "shared"
    path.mkdir()
    return path


def test_blocks_stored_by_one_instance_load_byte_exact_in_another(shared):
    writer, reader = Instance(f"file://{shared}"), Instance(f"file://{shared}")
    report = writer.run(writer.manager.plan_store("a", keys_of([1, 2, 3]), [3, 4, 9]), writer.worker.submit_store)
    assert report.success and not report.failed_writes
    assert writer.manager.stats.written_blocks["file"] == 3
    assert reader.manager.lookup(keys_of([1, 2, 3, 4]), "r") is None  # asked off the scheduler's thread
    assert reader.lookup(keys_of([1, 2, 3, 4])) == 3
    job = reader.manager.plan_load("r", keys_of([1, 2, 3]), [0, 1, 2])
    assert job.fill_from == ["file"] * 3
    report = reader.run(job, reader.worker.submit_load)
    assert report.success
    for t_writer, t_reader in zip(writer.tensors, reader.tensors):
        assert torch.equal(t_writer[[3, 4, 9]].view(torch.int16), t_reader[[0, 1, 2]].view(torch.int16))
    assert reader.manager.host.num_pins == 0
    writer.close()
    reader.close()


def test_entries_are_written_atomically_and_once(shared):
    first, second = Instance(f"file://{shared}"), Instance(f"file://{shared}")
    first.run(first.manager.plan_store("a", keys_of([1]), [1]), first.worker.submit_store)
    path = entry_path(shared, first.worker.rank_fingerprint, keys_of([1])[0])
    stamp = path.stat().st_mtime_ns
    second.run(second.manager.plan_store("a", keys_of([1]), [1]), second.worker.submit_store)
    assert path.stat().st_mtime_ns == stamp  # the second instance found it there and did not rewrite it
    assert not [p for p in shared.rglob("*.tmp")]
    assert path.stat().st_size == HEADER_BYTES + first.worker.layout.slot_bytes
    first.close()
    second.close()


def test_a_damaged_shared_entry_is_a_miss_and_is_not_offered_again(shared):
    writer, reader = Instance(f"file://{shared}"), Instance(f"file://{shared}")
    writer.run(writer.manager.plan_store("a", keys_of([1, 2]), [1, 2]), writer.worker.submit_store)
    path = entry_path(shared, writer.worker.rank_fingerprint, keys_of([1])[0])
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 7] ^= 0xFF
    path.write_bytes(bytes(data))
    assert reader.lookup(keys_of([1, 2]), token="first") == 2
    report = reader.run(reader.manager.plan_load("first", keys_of([1, 2]), [5, 6]), reader.worker.submit_load)
    assert report.failed_block_ids == [5] and report.bad_keys == keys_of([1])
    # The request's load failed from the only shared tier: blocks a producer hands over cannot reach it.
    assert not reader.manager.can_arrive("first") and reader.manager.can_arrive("again")
    assert reader.lookup(keys_of([1, 2]), token="again") == 0
    assert path.exists()  # a shared entry is never deleted by a reader: another instance may rewrite it
    writer.close()
    reader.close()


def test_an_entry_deleted_between_lookup_and_load_is_a_miss_but_not_shunned(shared):
    """Another instance's size bound (or a full filesystem) deletes an entry after this one's
    lookup found it: the load fails for that block (recompute), but nothing is wrong with the
    tier's entries: it is not counted as damaged, and once stored again it is offered at once."""
    writer, reader = Instance(f"file://{shared}"), Instance(f"file://{shared}")
    writer.run(writer.manager.plan_store("a", keys_of([1, 2]), [1, 2]), writer.worker.submit_store)
    assert reader.lookup(keys_of([1, 2]), token="first") == 2
    entry_path(shared, writer.worker.rank_fingerprint, keys_of([1])[0]).unlink()
    report = reader.run(reader.manager.plan_load("first", keys_of([1, 2]), [5, 6]), reader.worker.submit_load)
    assert report.failed_block_ids == [5] and not report.bad_keys and report.gone_keys == keys_of([1])
    assert reader.manager.stats.bad_entries == 0 and reader.manager.stats.failed_load_blocks == 1
    reader.manager.ledger.forget("first")  # the request ends: its failed block was recomputed
    assert reader.manager.ledger.misses == {"evicted_file": reader.manager.ledger.block_tokens}
    assert reader.manager.ledger.gone(keys_of([1])[0]) == "evicted_file"  # a later miss of it says so too
    third = Instance(f"file://{shared}")  # recomputes the block and stores it again
    third.run(third.manager.plan_store("b", keys_of([1]), [1]), third.worker.submit_store)
    assert reader.lookup(keys_of([1, 2]), token="again") == 2
    assert reader.manager.host.num_pins == 0
    for instance in (writer, reader, third):
        instance.close()


def test_max_bytes_bounds_the_directory(shared):
    probe = Instance(f"file://{shared}")
    entry = HEADER_BYTES + probe.worker.layout.slot_bytes
    probe.close()
    bounded = Instance(f"file://{shared}?max_bytes={10 * entry}")
    for i in range(4):
        keys = keys_of(range(i * 4, i * 4 + 4))
        bounded.run(bounded.manager.plan_store("a", keys, [1, 2, 3, 4]), bounded.worker.submit_store)
    files = [p for p in shared.rglob("*") if p.is_file()]
    assert len(files) * entry <= 10 * entry
    newest = entry_path(shared, bounded.worker.rank_fingerprint, keys_of([15])[0])
    assert newest.exists()  # the oldest go first
    # The scheduler's index hears what the bound deleted: a later miss of it is explained, and
    # KV events tell the fleet the tier no longer holds it.
    ledger = bounded.manager.ledger
    deleted = [key for key in keys_of(range(16)) if not entry_path(shared, bounded.worker.rank_fingerprint, key).exists()]
    assert len(deleted) >= 6 and keys_of([0])[0] in deleted
    assert {key: ledger.gone(key) for key in keys_of(range(16))} == {
        key: "evicted_file" if key in deleted else None for key in keys_of(range(16))}
    bounded.close()


@pytest.mark.parametrize("url, words", [
    ("file://relative/path", "not host"),
    ("file:///mnt/kv?size=1", "unknown file:// option"),
    ("file:///mnt/kv?max_bytes=lots", "not a size"),
])
def test_a_bad_file_url_fails_at_start_up_naming_the_key(url, words):
    with pytest.raises(ConfigError, match="remote_url") as error:
        tier_specs(KVTierConfig.from_sources({"remote_url": url}, environ={}))
    assert words in str(error.value)


def test_the_shared_directory_is_made_owner_only(shared):
    instance = Instance(f"file://{shared}")
    instance.run(instance.manager.plan_store("a", keys_of([1]), [1]), instance.worker.submit_store)
    path = entry_path(shared, instance.worker.rank_fingerprint, keys_of([1])[0])
    assert os.stat(path).st_mode & 0o777 == 0o600
    instance.close()


def _existence_index(shared, slot_bytes, fingerprints):
    from kvtier.tiers.base import TierSpec
    from kvtier.tiers.shared_dir import make_index
    return make_index(TierSpec("file", "kvtier.tiers.shared_dir", f"file://{shared}"), slot_bytes, fingerprints)


def test_an_existence_check_is_answered_while_the_engines_thread_never_lets_go_of_the_gil(shared):
    """vLLM's one-process layout: the engine's busy loop keeps the GIL. With a switch interval of
    60 s no Python thread could take it during this loop; the stat() calls need none."""
    writer = Instance(f"file://{shared}")
    writer.run(writer.manager.plan_store("a", keys_of([1, 2]), [1, 2]), writer.worker.submit_store)
    index = _existence_index(shared, writer.worker.layout.slot_bytes, [writer.worker.rank_fingerprint])
    assert answer_holding_the_gil(index, keys_of([1, 2, 3])) == [True, True, False]
    writer.close()


def test_an_existence_check_needs_every_ranks_entry_whole(shared):
    """Two ranks: a block counts only where both ranks' entries are there at their full size."""
    import time

    slot_bytes, fingerprints = 1024, [b"\x01" * 16, b"\x02" * 16]
    keys = keys_of([1, 2, 3, 4])
    for key, sizes in zip(keys, [(1024, 1024), (1024, None), (1024, 1000), (None, None)]):
        for fp, size in zip(fingerprints, sizes):
            if size is not None:
                path = entry_path(shared, fp, key)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"\x00" * (HEADER_BYTES + size))
    index = _existence_index(shared, slot_bytes, fingerprints)
    found = index.lookup(keys, "r")
    deadline = time.monotonic() + 5.0
    while found is None and time.monotonic() < deadline:
        time.sleep(0.001)
        found = index.lookup(keys, "r")
    assert found == [True, False, False, False]


def test_existence_checks_past_the_cap_are_misses_at_once_never_a_queue(shared):
    from kvtier._native import stat_batch

    with pytest.raises(BlockingIOError):
        stat_batch.Sizes([os.fsencode(shared)], 0)
    index = _existence_index(shared, 1024, [b"\x01" * 16])
    index._start = lambda keys: stat_batch.Sizes([b"/"] * len(keys), 0)  # as if 64 checks hung on the mount
    assert index.lookup(keys_of([1, 2]), "r") == [False, False]
    assert index.unanswered("r") and index.num_refused == 1
    assert stat_batch.live() == 0


def test_an_answer_stands_for_a_request_asked_again_at_once(shared):
    """vLLM asks again every step for a request it could not schedule (its KV cache full): the
    tier is asked once and the answer given at once, rather than a check per step and "ask
    again" every other step. A store of a key it missed, a failed load, or time ends it."""
    import time

    fingerprint = b"\x01" * 16
    index = _existence_index(shared, 1024, [fingerprint])
    keys = keys_of([1, 2])

    def put(key):
        path = entry_path(shared, fingerprint, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x00" * (HEADER_BYTES + 1024))

    def answer(token="r"):
        deadline = time.monotonic() + 5.0
        while (found := index.lookup(keys, token)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        return found

    put(keys[0])
    assert answer() == [True, False] and index.num_checks == 1
    assert all(index.lookup(keys, "r") == [True, False] for _ in range(100))  # as vLLM's steps ask
    assert index.num_checks == 1
    assert answer("other") == [True, False] and index.num_checks == 2  # each request asks for itself
    put(keys[1])
    index.complete_store([keys[1]], [])  # this instance wrote a key the answer missed: asked again
    assert index.lookup(keys, "r") is None and answer() == [True, True] and index.num_checks == 3
    index.complete_load([keys[0]], [keys[0]])  # found damaged: a miss at once, without asking
    assert index.lookup(keys, "r") == [False, True] and index.num_checks == 3
    index.answer_s = 0.05
    time.sleep(0.06)
    assert index.lookup(keys, "r") is None and index.num_checks == 4  # an old answer is asked again
    answer()
    index.forget("r")
    assert index.lookup(keys, "r") is None and index.num_checks == 5
    index.close()


def test_a_load_that_failed_from_the_disk_is_taken_again_from_the_shared_tier(shared, tmp_path):
    """vLLM reschedules a request whose load failed and asks kvtier again: only the tier its load
    failed from is skipped then, so the same blocks load from the next tier that holds them. A
    request fails at most one load per tier (``test_manager.py`` shows the last one)."""
    slot_bytes = 2 * BS * 16 * 2
    inst = Instance(f"file://{shared}", host_bytes=3 * slot_bytes, disk_dir=str(tmp_path / "disk"),
                    store_to="disk,remote")
    keys = keys_of([1, 2, 3])
    for first in (0, 3):  # the second three evict the first from the host pool
        blocks = [first, first + 1, first + 2]
        report = inst.run(inst.manager.plan_store("s", keys_of([b + 1 for b in blocks]), blocks), inst.worker.submit_store)
        assert report.success and not report.failed_writes
    assert inst.lookup(keys) == 3
    job = inst.manager.plan_load("r", keys, [20, 21, 22])
    assert job.fill_from == ["disk"] * 3
    (path, offset, _, _, _), = [e for e in entries_in(tmp_path / "disk") if e[2] == keys[0]]
    flip_byte(path, offset + HEADER_BYTES + 5)
    report = inst.run(job, inst.worker.submit_load)
    assert not report.success and 20 in report.failed_block_ids
    assert inst.lookup(keys) == 3  # the same request: the shared tier's copies, not the disk's
    job = inst.manager.plan_load("r", keys, [20, 21, 22])
    # Blocks 2 and 3 loaded the first time and stayed in the host pool; block 1 is read from the shared
    # tier (its damaged disk entry was dropped, and the request reads the disk no more).
    assert job.ready_keys == keys[1:] and job.fill_keys == keys[:1] and job.fill_from == ["file"]
    assert inst.run(job, inst.worker.submit_load).success
    assert inst.manager.can_arrive("r")  # the shared tier still serves the request: a producer's blocks may come
    for tensor in inst.tensors:
        assert torch.equal(tensor[[0, 1, 2]].view(torch.int16), tensor[[20, 21, 22]].view(torch.int16))
    assert inst.manager.host.num_pins == 0
    inst.manager.forget("r")
    inst.close()


def test_each_tier_is_sent_jobs_of_its_own_size_and_loads_back_byte_exact(shared, tmp_path, monkeypatch):
    """How much one I/O job moves is the tier's (its kind's ``job_bytes``, else the default): a
    store's writes reach the disk in jobs of one block and the shared directory in jobs of three,
    and each tier's reads come the same way, byte for byte."""
    import dataclasses

    import kvtier.tiers.shared_dir

    disk = str(tmp_path / "disk")
    probe = Instance(None)
    slot_bytes = probe.worker.layout.slot_bytes
    probe.close()
    monkeypatch.setattr("kvtier.tiers.base.JOB_BYTES", 1)  # the default: the disk's module sets none
    monkeypatch.setattr(kvtier.tiers.shared_dir, "KIND", dataclasses.replace(kvtier.tiers.shared_dir.KIND,
                                                                          job_bytes=3 * slot_bytes))

    def recorded(instance):
        sent, submit = [], instance.worker.io.submit

        def record(tier, write, keys, *args, **kwargs):
            sent.append((tier, write, len(keys)))
            return submit(tier, write, keys, *args, **kwargs)

        instance.worker.io.submit = record
        return sent

    writer = Instance(f"file://{shared}", disk_dir=disk)
    sent = recorded(writer)
    blocks = list(range(1, 9))
    report = writer.run(writer.manager.plan_store("a", keys_of(range(8)), blocks), writer.worker.submit_store)
    assert report.success and not report.failed_writes
    assert sorted(n for tier, write, n in sent if tier == "disk" and write) == [1] * 8
    assert sorted(n for tier, write, n in sent if tier == "file" and write) == [2, 3, 3]
    stored = [t[blocks].clone() for t in writer.tensors]
    writer.close()

    for url, disk_dir, tier, sizes in ((f"file://{shared}", None, "file", [2, 3, 3]), (None, disk, "disk", [1] * 8)):
        reader = Instance(url, disk_dir=disk_dir)
        sent = recorded(reader)
        assert reader.lookup(keys_of(range(8))) == 8
        job = reader.manager.plan_load("r", keys_of(range(8)), list(range(20, 28)))
        assert job.fill_from == [tier] * 8
        assert reader.run(job, reader.worker.submit_load).success
        assert sorted(n for name, write, n in sent if name == tier and not write) == sizes
        for t, before in zip(reader.tensors, stored):
            assert torch.equal(t[20:28].view(torch.int16), before.view(torch.int16))
        reader.close()
