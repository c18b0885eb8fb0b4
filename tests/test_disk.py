"""The local disk tier: entries in places of one preallocated file per rank."""

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from kvtier.entry import HEADER_BYTES
from kvtier.tiers.disk import DiskIndex, DiskStore, entries_file
from kvtier.tiers.entry_files import EntryFiles

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
    (place,) = [index.location(k) for k in index.prepare_store([key(1)])]
    store.write(key(1), memoryview(payload(1)), place)
    why, out = read(store, 1, place)
    assert why is None and np.array_equal(out, payload(1))
    path = entries_file(disk_dir, FP)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert os.stat(path).st_blocks * 512 < 10 * ENTRY  # sparse: places never written take no space


@pytest.mark.parametrize("damage, reason", [
    (lambda path: _flip_byte(path, HEADER_BYTES + 10), "checksum"),
    (lambda path: _flip_byte(path, 0), "not a kvtier entry"),
    (lambda path: _flip_byte(path, 20), "foreign namespace"),
    (lambda path: _flip_byte(path, 40), "other key"),
    (lambda path: _zero(path, 0, HEADER_BYTES), "not a kvtier entry"),  # never written
])
def test_damaged_entries_are_misses(disk_dir, damage, reason):
    store = DiskStore(disk_dir, FP, SLOT)
    store.write(key(1), memoryview(payload(1)), 0)
    damage(entries_file(disk_dir, FP))
    assert reason in read(store, 1, 0)[0]


def test_a_write_cut_short_is_a_miss_not_a_block(disk_dir):
    """The payload goes first and the header last: a place with a new payload under its old
    header, or with part of a new payload, fails its checksum."""
    store = DiskStore(disk_dir, FP, SLOT)
    store.write(key(1), memoryview(payload(1)), 0)
    os.pwrite(os.open(entries_file(disk_dir, FP), os.O_WRONLY), payload(2)[: SLOT // 2].tobytes(), HEADER_BYTES)
    assert "checksum" in read(store, 1, 0)[0]


def test_a_new_process_finds_the_entries_again(disk_dir):
    code = ("import numpy as np, sys; from kvtier.tiers.disk import DiskIndex, DiskStore;"
            f"index = DiskIndex(sys.argv[1], 10 * {ENTRY}, {SLOT}, [{FP!r}]);"
            f"store = DiskStore(sys.argv[1], {FP!r}, {SLOT});"
            "keys = [i.to_bytes(16, 'little') for i in range(5)];"
            "index.prepare_store(keys);"
            f"[store.write(k, memoryview(np.full({SLOT}, i, np.uint8)), index.location(k)) for i, k in enumerate(keys)]")
    subprocess.run([sys.executable, "-c", code, disk_dir], check=True)
    _flip_byte(entries_file(disk_dir, FP), 3 * ENTRY)  # place 3's header is damaged: not found
    index = DiskIndex(disk_dir, 10 * ENTRY, SLOT, [FP])
    assert index.lookup([key(i) for i in range(5)]) == [True, True, True, False, True]
    why, out = read(DiskStore(disk_dir, FP, SLOT), 4, index.location(key(4)))
    assert why is None and (out == 4).all()
    assert index.prepare_store([key(7)]) == [key(7)] and index.location(key(7)) not in (0, 1, 2, 4)


def test_instances_on_one_directory_each_take_a_file_and_a_restart_takes_one_back(disk_dir):
    """Two instances with the same disk_dir (vLLM servers of one node, default settings)
    never write each other's places; after a restart each finds its entries again."""
    first, second = DiskIndex(disk_dir, 10 * ENTRY, SLOT, [FP]), DiskIndex(disk_dir, 10 * ENTRY, SLOT, [FP])
    assert (first.file_number, second.file_number) == (0, 1)
    store = DiskStore(disk_dir, FP, SLOT)
    for index, i in ((first, 1), (second, 2)):
        index.prepare_store([key(i)])
        store.write(key(i), memoryview(payload(i)), index.location(key(i)))
        index.complete_store([key(i)])
    assert first.location(key(1)) != second.location(key(2))
    first.close()
    again = DiskIndex(disk_dir, 10 * ENTRY, SLOT, [FP])  # file 0 is free again; file 1 is still held
    assert again.file_number == 0 and again.lookup([key(1), key(2)]) == [True, False]
    assert read(store, 1, again.location(key(1)))[0] is None
    second.close()
    again.close()


def test_capacity_evicts_least_recently_used_unpinned(disk_dir):
    store = DiskStore(disk_dir, FP, SLOT)
    index = DiskIndex(disk_dir, 2 * ENTRY, SLOT, [FP])
    for i in (1, 2):
        index.prepare_store([key(i)])
        store.write(key(i), memoryview(payload(i)), index.location(key(i)))
        index.complete_store([key(i)])
    index.prepare_load([key(1)])  # pinned: must survive
    assert index.prepare_store([key(3)]) == [key(3)]
    assert index.lookup([key(1), key(2)]) == [True, False] and index.num_evictions == 1
    assert index.location(key(3)) != index.location(key(1))  # 2's place went to 3
    assert index.prepare_store([key(4)]) == []  # 1 pinned + 3 being written: no room
    index.complete_load([key(1)])


def test_discard_frees_a_corrupt_entrys_place(disk_dir):
    index = DiskIndex(disk_dir, 1 * ENTRY, SLOT, [FP])
    index.prepare_store([key(1)])
    index.complete_store([key(1)])
    index.discard(key(1))
    assert index.lookup([key(1)]) == [False]
    assert index.prepare_store([key(2)]) == [key(2)] and index.num_evictions == 0


def test_entry_files_round_trip_and_leave_no_temporary_file(tmp_path):
    files = EntryFiles(tmp_path, FP, SLOT)
    files.write(key(1), memoryview(payload(1)))
    out = np.zeros(SLOT, np.uint8)
    assert files.read(key(1), memoryview(out)) is None and np.array_equal(out, payload(1))
    assert stat.S_IMODE(os.stat(files.path(key(1))).st_mode) == 0o600
    assert not list(tmp_path.rglob("*.tmp"))
    os.truncate(files.path(key(1)), HEADER_BYTES + SLOT // 2)
    assert "wrong size" in files.read(key(1), memoryview(out))


def _flip_byte(path, offset):
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def _zero(path, offset, size):
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(bytes(size))
