"""The local disk tier: entries in places of one preallocated file per rank."""

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from kvtier.common.entry import HEADER_BYTES
from kvtier.common.outcomes import BAD, bad
from kvtier.tiers.disk import DiskIndex, DiskStore, entries_file
from kvtier.tiers.entry_files import EntryFiles
from tests.damage import flip_byte

FP = b"\x11" * 16
SLOT = 1000  # deliberately not a multiple of 16
ENTRY = HEADER_BYTES + SLOT


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)


def read(store, i, place):
    out = np.zeros(SLOT, np.uint8)
    return store.read(key(i), memoryview(out), place), out


def test_write_read_round_trip_and_owner_only_permissions(disk_dir):
    index = DiskIndex(disk_dir, 10 * ENTRY, SLOT, [FP])
    store = DiskStore(disk_dir, FP, SLOT)
    (place,) = index.prepare_store([key(1)]).values()
    store.write(key(1), memoryview(payload(1)), place)
    why, out = read(store, 1, place)
    assert why is None and np.array_equal(out, payload(1))
    path = entries_file(disk_dir, FP)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert os.stat(path).st_blocks * 512 < 10 * ENTRY  # sparse: places never written take no space


@pytest.mark.parametrize("damage, reason", [
    (lambda path: flip_byte(path, HEADER_BYTES + 10), "checksum"),
    (lambda path: flip_byte(path, 0), "not a kvtier entry"),
    (lambda path: flip_byte(path, 20), "foreign namespace"),
    (lambda path: flip_byte(path, 40), "other key"),
    (lambda path: _zero(path, 0, HEADER_BYTES), "not a kvtier entry"),  # never written
])
def test_damaged_entries_are_misses(disk_dir, damage, reason):
    store = DiskStore(disk_dir, FP, SLOT)
    store.write(key(1), memoryview(payload(1)), 0)
    damage(entries_file(disk_dir, FP))
    why = read(store, 1, 0)[0]
    assert why.kind == BAD and reason in why.why  # a damaged entry is dropped, not a tier that failed


def test_a_write_cut_short_is_a_miss_not_a_block(disk_dir):
    """Whatever part of a rewrite of a place lands, the place fails its checksum: its old
    header over part of the new payload, or the new header over part of it."""
    store = DiskStore(disk_dir, FP, SLOT)
    store.write(key(1), memoryview(payload(1)), 0)
    fd = os.open(entries_file(disk_dir, FP), os.O_RDWR)
    os.pwrite(fd, payload(2)[: SLOT // 2].tobytes(), HEADER_BYTES)
    assert read(store, 1, 0)[0] == bad("checksum mismatch")
    store.write(key(2), memoryview(payload(2)), 1)
    new_header = os.pread(fd, HEADER_BYTES, ENTRY)
    os.pwrite(fd, new_header, 0)  # place 0: key 2's header over half of key 2's payload
    assert read(store, 2, 0)[0] == bad("checksum mismatch")
    assert read(store, 2, 1)[0] is None
    os.close(fd)


def test_a_job_is_written_in_runs_of_consecutive_places(disk_dir):
    """Consecutive places go in one vectored write, scattered ones apart; every entry, from any
    host slot, reads back byte-exact, and a run is cut at RUN_BYTES."""
    from kvtier.tiers import disk

    store = DiskStore(disk_dir, FP, SLOT)
    store.attach(np.stack([payload(i) for i in range(12)]))
    places = [3, 4, 5, 6, 9, 2, 10, 11, 0, 1, 7, 8]
    slots = [11, 0, 5, 2, 7, 1, 3, 9, 4, 6, 8, 10]  # scattered host slots, as a worker's are
    assert disk._runs(places, ENTRY) == [(0, 4), (4, 5), (5, 6), (6, 8), (8, 10), (10, 12)]
    assert disk._runs(list(range(10)), disk.RUN_BYTES // 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert disk._runs([5], 10 * disk.RUN_BYTES) == [(0, 1)]
    assert store.write_from([key(i) for i in range(12)], slots, places, 0) == [None] * 12
    for i, (slot, place) in enumerate(zip(slots, places)):
        why, out = read(store, i, place)
        assert why is None and np.array_equal(out, payload(slot))


def test_a_run_cut_by_a_file_size_limit_fails_with_efbig(disk_dir):
    """A vectored write that stops short is continued, so that a limit in the middle of a run
    raises its own errno (EFBIG past RLIMIT_FSIZE), never passes for a whole write. The entry of
    the run written whole before the limit is stored, and reads back with the one before the run."""
    code = ("import numpy as np, resource, signal, sys; from kvtier.tiers.disk import DiskStore;"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
            f"store = DiskStore(sys.argv[1], {FP!r}, {SLOT});"
            f"store.attach(np.full((4, {SLOT}), 7, np.uint8));"
            "keys = [i.to_bytes(16, 'little') for i in range(4)];"
            "assert store.write_from(keys[:1], [0], [0], 0) == [None];"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({ENTRY} * 2 + 100, {ENTRY} * 2 + 100));"
            "reasons = store.write_from(keys[1:], [1, 2, 3], [1, 2, 3], 0);"
            "assert reasons[0] is None and all('EFBIG' in r.why for r in reasons[1:]), reasons")
    subprocess.run([sys.executable, "-c", code, disk_dir], check=True)
    for place in (0, 1):
        why, out = read(DiskStore(disk_dir, FP, SLOT), place, place)
        assert why is None and (out == 7).all()


def test_a_new_process_finds_the_entries_again(disk_dir):
    code = ("import numpy as np, sys; from kvtier.tiers.disk import DiskIndex, DiskStore;"
            f"index = DiskIndex(sys.argv[1], 10 * {ENTRY}, {SLOT}, [{FP!r}]);"
            f"store = DiskStore(sys.argv[1], {FP!r}, {SLOT});"
            "keys = [i.to_bytes(16, 'little') for i in range(5)];"
            "places = index.prepare_store(keys);"
            f"[store.write(k, memoryview(np.full({SLOT}, i, np.uint8)), places[k]) for i, k in enumerate(keys)]")
    subprocess.run([sys.executable, "-c", code, disk_dir], check=True)
    flip_byte(entries_file(disk_dir, FP), 3 * ENTRY)  # place 3's header is damaged: not found
    index = DiskIndex(disk_dir, 10 * ENTRY, SLOT, [FP])
    assert index.lookup([key(i) for i in range(5)]) == [True, True, True, False, True]
    why, out = read(DiskStore(disk_dir, FP, SLOT), 4, index.prepare_load([key(4)])[0])
    assert why is None and (out == 4).all()
    places = index.prepare_store([key(7)])
    assert list(places) == [key(7)] and places[key(7)] not in (0, 1, 2, 4)


def test_instances_on_one_directory_each_take_a_file_and_a_restart_takes_one_back(disk_dir):
    """Two instances with the same disk_dir (vLLM servers of one node, default settings)
    never write each other's places; after a restart each finds its entries again."""
    first, second = DiskIndex(disk_dir, 10 * ENTRY, SLOT, [FP]), DiskIndex(disk_dir, 10 * ENTRY, SLOT, [FP])
    assert (first.file_number, second.file_number) == (0, 1)
    store = DiskStore(disk_dir, FP, SLOT)
    places = {}
    for index, i in ((first, 1), (second, 2)):
        places.update(index.prepare_store([key(i)]))
        store.write(key(i), memoryview(payload(i)), places[key(i)])
        index.complete_store([key(i)])
    assert places[key(1)] != places[key(2)]
    first.close()
    again = DiskIndex(disk_dir, 10 * ENTRY, SLOT, [FP])  # file 0 is free again; file 1 is still held
    assert again.file_number == 0 and again.lookup([key(1), key(2)]) == [True, False]
    assert read(store, 1, again.prepare_load([key(1)])[0])[0] is None
    second.close()
    again.close()


def test_capacity_evicts_least_recently_used_unpinned(disk_dir):
    store = DiskStore(disk_dir, FP, SLOT)
    index = DiskIndex(disk_dir, 2 * ENTRY, SLOT, [FP])
    places = {}
    for i in (1, 2):
        places.update(index.prepare_store([key(i)]))
        store.write(key(i), memoryview(payload(i)), places[key(i)])
        index.complete_store([key(i)])
    index.prepare_load([key(1)])  # pinned: must survive
    third = index.prepare_store([key(3)])
    assert list(third) == [key(3)]
    assert index.lookup([key(1), key(2)]) == [True, False] and index.num_evictions == 1
    assert third[key(3)] == places[key(2)] != places[key(1)]  # 2's place went to 3
    assert index.prepare_store([key(4)]) == {}  # 1 pinned + 3 being written: no room
    index.complete_load([key(1)])


def test_discard_frees_a_corrupt_entrys_place(disk_dir):
    index = DiskIndex(disk_dir, 1 * ENTRY, SLOT, [FP])
    index.prepare_store([key(1)])
    index.complete_store([key(1)])
    index.discard(key(1))
    assert index.lookup([key(1)]) == [False]
    assert list(index.prepare_store([key(2)])) == [key(2)] and index.num_evictions == 0


def test_entry_files_round_trip_and_leave_no_temporary_file(tmp_path):
    files = EntryFiles(tmp_path, FP, SLOT)
    files.write(key(1), memoryview(payload(1)))
    out = np.zeros(SLOT, np.uint8)
    assert files.read(key(1), memoryview(out)) is None and np.array_equal(out, payload(1))
    assert stat.S_IMODE(os.stat(files.path(key(1))).st_mode) == 0o600
    assert not list(tmp_path.rglob("*.tmp"))
    os.truncate(files.path(key(1)), HEADER_BYTES + SLOT // 2)
    assert "wrong size" in files.read(key(1), memoryview(out)).why


def _zero(path, offset, size):
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(bytes(size))
