import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from kvtier.entry import HEADER_BYTES
from kvtier.tiers.disk import DiskIndex, DiskStore

FP = b"\x11" * 16
SLOT = 1000  # deliberately not a multiple of 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)


def test_write_read_round_trip_and_owner_only_permissions(disk_dir):
    store = DiskStore(disk_dir, FP, SLOT)
    store.write(key(1), memoryview(payload(1)))
    out = np.zeros(SLOT, np.uint8)
    assert store.read(key(1), memoryview(out)) is None
    assert np.array_equal(out, payload(1))
    mode = stat.S_IMODE(os.stat(store.path(key(1))).st_mode)
    assert mode == 0o600
    assert stat.S_IMODE(os.stat(store.path(key(1)).parent).st_mode) == 0o700


@pytest.mark.parametrize("damage, reason", [
    (lambda path: _flip_byte(path, HEADER_BYTES + 10), "checksum"),
    (lambda path: _truncate(path, HEADER_BYTES + SLOT // 2), "truncated"),
    (lambda path: _flip_byte(path, 0), "not a kvtier entry"),
    (lambda path: _flip_byte(path, 20), "foreign namespace"),
    (lambda path: os.unlink(path), "missing"),
])
def test_damaged_entries_are_misses(disk_dir, damage, reason):
    store = DiskStore(disk_dir, FP, SLOT)
    store.write(key(1), memoryview(payload(1)))
    damage(store.path(key(1)))
    assert reason in store.read(key(1), memoryview(np.zeros(SLOT, np.uint8)))


def test_an_entry_of_another_namespace_is_a_miss(disk_dir):
    DiskStore(disk_dir, b"\x22" * 16, SLOT).write(key(1), memoryview(payload(1)))
    store = DiskStore(disk_dir, FP, SLOT)
    os.makedirs(store.path(key(1)).parent, exist_ok=True)
    os.replace(DiskStore(disk_dir, b"\x22" * 16, SLOT).path(key(1)), store.path(key(1)))
    assert store.read(key(1), memoryview(np.zeros(SLOT, np.uint8))) == "foreign namespace"


def test_a_new_process_finds_the_entries_again(disk_dir):
    code = ("import numpy as np, sys; from kvtier.tiers.disk import DiskStore;"
            f"s = DiskStore(sys.argv[1], {FP!r}, {SLOT});"
            f"[s.write(i.to_bytes(16, 'little'), memoryview(np.full({SLOT}, i, np.uint8))) for i in range(5)]")
    subprocess.run([sys.executable, "-c", code, disk_dir], check=True)
    _truncate(DiskStore(disk_dir, FP, SLOT).path(key(3)), 10)  # a torn file is not found
    index = DiskIndex(disk_dir, 10 * (HEADER_BYTES + SLOT), SLOT, [FP])
    assert index.lookup([key(i) for i in range(5)]) == [True, True, True, False, True]
    out = np.zeros(SLOT, np.uint8)
    assert DiskStore(disk_dir, FP, SLOT).read(key(4), memoryview(out)) is None and (out == 4).all()


def test_leftover_temporary_files_are_removed(disk_dir):
    store = DiskStore(disk_dir, FP, SLOT)
    store.write(key(1), memoryview(payload(1)))
    leftover = str(store.path(key(1))) + ".123.456.tmp"
    open(leftover, "wb").write(b"half")
    DiskIndex(disk_dir, 1 << 20, SLOT, [FP])
    assert not os.path.exists(leftover)


def test_capacity_evicts_least_recently_used_unpinned(disk_dir):
    store = DiskStore(disk_dir, FP, SLOT)
    index = DiskIndex(disk_dir, 2 * (HEADER_BYTES + SLOT), SLOT, [FP])
    for i in (1, 2):
        index.prepare_store([key(i)])
        store.write(key(i), memoryview(payload(i)))
        index.complete_store([key(i)])
    index.prepare_load([key(1)])  # pinned: must survive
    assert index.prepare_store([key(3)]) == [key(3)]
    assert index.lookup([key(1), key(2)]) == [True, False]
    assert not store.path(key(2)).exists() and index.num_evictions == 1
    assert index.prepare_store([key(4)]) == []  # 1 pinned + 3 being written: no room
    index.complete_load([key(1)])


def test_discard_removes_a_corrupt_entry(disk_dir):
    store = DiskStore(disk_dir, FP, SLOT)
    index = DiskIndex(disk_dir, 1 << 20, SLOT, [FP])
    index.prepare_store([key(1)])
    store.write(key(1), memoryview(payload(1)))
    index.complete_store([key(1)])
    index.discard(key(1))
    assert index.lookup([key(1)]) == [False] and not store.path(key(1)).exists()


def _flip_byte(path, offset):
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path, size):
    os.truncate(path, size)
