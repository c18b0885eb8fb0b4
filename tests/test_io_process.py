"""kvtier's I/O process: storage I/O off the engine's interpreter, crash isolation,
progress without engine steps, flushing at shutdown, and nothing left behind."""

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.common.entry import checksum
from kvtier.common.outcomes import BAD, FULL, GONE, UNAVAILABLE, Miss, bad
from kvtier.tiers.disk import DiskStore, entries_in
from tests.test_tiering import Engine, keys_of, layouts, randomize

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive: it only waits to be reaped
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped. The signal stops each thread
    as it next runs, one after another: a thread that a job's arrival wakes before the stop reaches
    it could still run that job."""
    os.kill(pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{pid}/task")
    assert _wait_until(lambda: all((task / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT"
                                   for task in tasks.iterdir()), 10)


def _entries(disk_dir: str, fingerprint: bytes, keys) -> list[bool]:
    """Which keys' entries are on disk (a place's header is written after its payload)."""
    on_disk = {key for path, _, key, _, _ in entries_in(disk_dir) if path.parent.name == fingerprint.hex()}
    return [key in on_disk for key in keys]


def test_storage_io_runs_in_a_process_of_its_own(disk_dir):
    engine = Engine(layouts()[0][1], disk_dir)
    pid = engine.worker.io.pid
    assert pid != os.getpid() and _alive(pid)
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"kvtier.io.process"]
    engine.close()
    assert _wait_until(lambda: not _alive(pid), 5)


def test_a_closed_worker_unmaps_its_host_pool_without_the_cyclic_garbage_collector(disk_dir):
    """One engine after another in one process: each one's pool is unmapped when its worker is
    dropped, not whenever the garbage collector next looks for cycles."""
    engine = Engine(layouts()[0][1], disk_dir)
    start = f"{engine.worker.host_buffer.data_ptr():x}-"
    mapped = lambda: any(line.startswith(start) for line in Path("/proc/self/maps").read_text().splitlines())
    assert mapped()
    gc.disable()
    try:
        engine.close()
        del engine
        assert not mapped()
    finally:
        gc.enable()


def test_a_store_reaches_disk_with_no_poll_and_no_engine_step(disk_dir):
    """Write-through advances on kvtier's own threads: nobody calls poll() here."""
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=16)
    randomize(tensors)
    keys = keys_of(range(8))
    job = engine.manager.plan_store("r", keys, list(range(1, 9)))
    began = time.monotonic()
    engine.worker.submit_store(job)
    assert _wait_until(lambda: all(_entries(disk_dir, engine.worker.rank_fingerprint, keys)), 1.0)
    assert time.monotonic() - began < 1.0
    engine.run([], None)  # nothing else outstanding
    engine.close()


def kill_the_io_process_mid_load(engine) -> int:
    """Store blocks 1-4 (then 5-8, which push them to disk only), start their load into 20-23 with
    the I/O process stopped, and kill it: the load must fail at once, with every pin released.
    Returns the dead process's pid."""
    engine.store(keys_of(range(4)), [1, 2, 3, 4])
    engine.store(keys_of(range(10, 14)), [5, 6, 7, 8])  # the first four are on disk only now
    old = engine.worker.io.pid
    _stop(old)  # the read below is certainly in flight when the process dies
    job = engine.manager.plan_load("r", keys_of(range(4)), [20, 21, 22, 23])
    assert len(job.fill_block_ids) == 4
    engine.worker.submit_load(job)
    time.sleep(0.1)
    began = time.monotonic()
    os.kill(old, signal.SIGKILL)
    reports = engine.run([], None, expect=1)
    assert time.monotonic() - began < 5  # no hang: the dead process's jobs fail at once
    assert sorted(reports[0].failed_block_ids) == [20, 21, 22, 23] and not reports[0].success
    assert engine.manager.host.num_pins == 0 and engine.manager.num_held == 0
    assert engine.manager.tier("disk").num_pins == 0 and engine.manager.num_pending == 0
    assert _wait_until(lambda: engine.worker.io.ready and engine.worker.io.pid != old, 30)
    return old


def test_the_io_process_killed_mid_load_gives_a_recompute_and_a_new_process(disk_dir, caplog):
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=4)
    randomize(tensors)
    with caplog.at_level(logging.ERROR, logger="kvtier.io"):
        kill_the_io_process_mid_load(engine)
    assert any("I/O process exited" in r.message for r in caplog.records)
    # The new process serves the same blocks: nothing was lost but the one load.
    for t in tensors:
        t[20:24].zero_()
    _, report = engine.load(keys_of(range(4)), [20, 21, 22, 23])
    assert report.success
    engine.close()


def test_a_load_past_load_timeout_s_is_recomputed_and_its_slots_wait_for_the_late_reads(disk_dir, monkeypatch):
    monkeypatch.setattr("kvtier.tiers.base.JOB_BYTES", 1)  # one I/O job per block
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=4, load_timeout_s=0.5)
    randomize(tensors)
    engine.store(keys_of(range(4)), [1, 2, 3, 4])
    engine.store(keys_of(range(10, 14)), [5, 6, 7, 8])  # the first four are on disk only now
    pid = engine.worker.io.pid
    _stop(pid)  # its reads hang
    try:
        job = engine.manager.plan_load("r", keys_of(range(4)), [20, 21, 22, 23])
        assert len(job.fill_block_ids) == 4
        reports = engine.run([job], engine.worker.submit_load)
        assert not reports[0].success and sorted(reports[0].failed_block_ids) == [20, 21, 22, 23]
        assert sorted(reports[0].held_slot_ids) == sorted(job.fill_slot_ids)  # a late read may still write them
        assert engine.manager.num_held == 4 and engine.manager.stats.abandoned_loads == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _wait_until(lambda: engine.manager.on_released(engine.worker.released_slots()) or
                       engine.manager.num_held == 0, 10)  # the late reads returned: the slots are free again
    assert engine.manager.host.num_pins == 0 and engine.worker.num_jobs_in_flight == 0
    assert engine.worker.io.pid == pid  # a slow process is not a dead one
    engine.close()


def test_a_store_is_written_in_chunks_side_by_side_and_loads_back_byte_for_byte(disk_dir, monkeypatch):
    """Writes go to the I/O process in jobs of about the tier's job_bytes, as loads do (here one block
    each); every chunk lands, and the blocks load back as they were."""
    monkeypatch.setattr("kvtier.tiers.base.JOB_BYTES", 1)
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=8)
    randomize(tensors)
    before = [t[1:9].clone() for t in tensors]
    first_job = next(engine.worker.io._job_ids)
    reports = engine.store(keys_of(range(8)), list(range(1, 9)))
    assert reports[0].success and not reports[0].failed_writes
    assert next(engine.worker.io._job_ids) - first_job == 1 + 8  # one write job per block
    assert all(_entries(disk_dir, engine.worker.rank_fingerprint, keys_of(range(8))))
    engine.store(keys_of(range(10, 18)), list(range(1, 9)))  # the first eight are on disk only now
    for t in tensors:
        t[20:28].zero_()
    _, report = engine.load(keys_of(range(8)), list(range(20, 28)))
    assert report.success
    assert all(torch.equal(t[20:28].view(torch.int16), b.view(torch.int16)) for t, b in zip(tensors, before))
    engine.close()


def test_a_chunked_store_whose_writes_hang_is_given_up_whole_and_its_slots_held(disk_dir, monkeypatch):
    """Every chunk of a store unanswered (its I/O process stopped): the store is reported at
    ``load_timeout_s + remote_timeout_s`` with all its writes failed, its slots held until the
    late writes return, then released."""
    monkeypatch.setattr("kvtier.tiers.base.JOB_BYTES", 1)
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=8, load_timeout_s=0.5, remote_timeout_s=0.5)
    randomize(tensors)
    pid = engine.worker.io.pid
    _stop(pid)
    try:
        began = time.monotonic()
        reports = engine.store(keys_of(range(4)), [1, 2, 3, 4])
        assert 0.9 < time.monotonic() - began < 10
        assert reports[0].failed_writes == {"disk": keys_of(range(4))}
        assert engine.manager.num_held == 4 and engine.manager.stats.abandoned_stores == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _wait_until(lambda: engine.manager.on_released(engine.worker.released_slots()) or
                       engine.manager.num_held == 0, 10)
    assert engine.manager.host.num_pins == 0 and engine.worker.num_jobs_in_flight == 0
    engine.close()


def test_the_io_process_maps_the_host_pool_without_changing_a_byte():
    """Both processes map the pool at a multiple of 2 MiB, the worker's pages made huge while it is
    new; the I/O process's mapping is made writable page by page at start (MADV_POPULATE_WRITE where
    the kernel has it): what the worker wrote stays, and what it writes the worker sees, in the huge
    pages and in the small ones past the last."""
    import ctypes
    import mmap

    from kvtier.io.pages import HUGE_PAGE, make_huge, map_for_writing, map_shared

    fd = os.memfd_create("kvtier-test-pool")
    try:
        size = 2 * HUGE_PAGE + 3 * mmap.PAGESIZE + 100
        os.ftruncate(fd, size)
        worker = map_shared(fd, size)
        make_huge(worker)
        pattern = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        np.frombuffer(worker, np.uint8)[:] = pattern
        io_side = map_for_writing(fd, size)
        assert ctypes.addressof(worker) % HUGE_PAGE == 0 and ctypes.addressof(io_side) % HUGE_PAGE == 0
        assert ctypes.addressof(worker) != ctypes.addressof(io_side)
        assert np.array_equal(np.frombuffer(io_side, np.uint8), pattern)
        np.frombuffer(io_side, np.uint8)[::mmap.PAGESIZE] ^= 0xFF
        pattern[::mmap.PAGESIZE] ^= 0xFF
        assert np.array_equal(np.frombuffer(worker, np.uint8), pattern)
    finally:
        os.close(fd)


def _host_pool_mapping(pid: int, address: int | None = None) -> dict[str, str]:
    """The smaps fields of process ``pid``'s mapping of the host pool (the one holding ``address``)."""
    def holds(line: str) -> bool:
        if "/memfd:kvtier-host-pool" not in line:
            return False
        low, high = (int(end, 16) for end in line.split()[0].split("-"))
        return address is None or low <= address < high

    lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if holds(line))
    fields = {}
    for line in lines[start + 1:]:
        name, _, value = line.partition(":")
        if " " in name:  # the next mapping's address line
            break
        fields[name] = value.strip()
    return fields


def _kernel_makes_huge_pages_on_request() -> bool:
    """MADV_COLLAPSE (Linux 6.1) on shared memory, which only shmem_enabled=deny refuses."""
    import platform

    release = tuple(int(part) for part in platform.release().split("-")[0].split(".")[:2])
    setting = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    return release >= (6, 1) and setting.exists() and "[deny]" not in setting.read_text()


def test_the_host_pool_is_on_huge_pages_in_the_worker_and_in_its_io_process(tmp_path):
    """Both mappings carry MADV_HUGEPAGE ("hg"). Where the kernel makes huge pages on request
    (MADV_COLLAPSE), whatever ``shmem_enabled`` says short of ``deny``, the pool's whole 2 MiB pages
    are huge in both processes, each mapped with one entry (ShmemPmdMapped); the bytes past the
    last whole one stay on small pages."""
    from kvtier.cli.bench.io_path import IOPath
    from kvtier.tiers.base import TierSpec

    spec = TierSpec("disk", "kvtier.tiers.disk", str(tmp_path), options={"write": True, "entry_key_file": None})
    path = IOPath(spec, 8, 1 << 20)  # 8 MiB and 8 heads of 64 bytes
    try:
        worker, io_side = _host_pool_mapping(os.getpid(), path.slots.ctypes.data), _host_pool_mapping(path.io.pid)
        assert "hg" in worker["VmFlags"].split() and "hg" in io_side["VmFlags"].split()
        if _kernel_makes_huge_pages_on_request():
            assert path.memory.huge_bytes == 8 << 20
            assert worker["ShmemPmdMapped"] == io_side["ShmemPmdMapped"] == "8192 kB"
        else:
            assert path.memory.huge_bytes in (0, 8 << 20)
    finally:
        path.close()


_LEADER_SCRIPT = textwrap.dedent("""
    import dataclasses, os, socket, sys, threading, time
    import numpy as np
    from kvtier.common.host_slots import HostSlots
    from kvtier.io import process
    from kvtier.io.messages import Job, Outcome, Ready, Setup, receive, send
    from kvtier.tiers.base import TierSpec

    received, ran = {}, {}
    plain_receive, plain_run = process.receive, process._Server._run
    def receive_noting(sock):
        message = plain_receive(sock)
        if isinstance(message, Job):
            received[message.job_id] = threading.current_thread().name
        return message
    def run_noting(self, job):
        ran[job.job_id] = threading.current_thread().name
        plain_run(self, job)
    process.receive, process._Server._run = receive_noting, run_noting

    slots = HostSlots(4, 1 << 16, 64)
    memory_fd, answers_fd = os.memfd_create("pool"), os.memfd_create("answers")
    os.ftruncate(memory_fd, slots.num_bytes)
    os.ftruncate(answers_fd, 4096)
    spec = TierSpec("disk", "kvtier.tiers.disk", sys.argv[1], options={"write": True, "entry_key_file": None})
    worker, io_side = socket.socketpair()
    setup = Setup([dataclasses.asdict(spec)], b"f" * 16, slots.slot_bytes, slots.num_slots, slots.head_bytes,
                  os.getpid(), 30, 5.0)
    server = process._Server(io_side, memory_fd, setup, answers_fd)
    assert isinstance(receive(worker), Ready)
    threading.Thread(target=server.serve, daemon=True).start()
    host, _ = slots.views(server._mapping)
    host[:] = np.random.default_rng(0).integers(0, 256, host.shape, dtype=np.uint8)
    written = host.copy()
    for n in range(24):
        write = n % 2 == 0
        key = (n // 2).to_bytes(16, "little")
        if not write:
            host[n // 2 % 4] = 0
        send(worker, Job(n, "disk", write, [key], [n // 2 % 4], [n // 2], time.monotonic() + 30))
        outcome = receive(worker)
        assert isinstance(outcome, Outcome) and outcome.job_id == n and outcome.reasons == [None], outcome
        assert np.array_equal(host[n // 2 % 4], written[n // 2 % 4])
        time.sleep(0.05)  # the thread that answered is back, waiting for the socket
    for n in range(24):
        print(n, received[n], ran[n])
""")


def test_a_job_runs_on_the_tier_thread_that_received_it(tmp_path):
    """One job at a time: each is received by one of its tier's threads, which runs it itself (no
    hand-over through a queue), the other thread taking the socket meanwhile; bytes round-trip."""
    script = tmp_path / "leader.py"
    script.write_text(_LEADER_SCRIPT)
    (tmp_path / "disk").mkdir()
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "disk")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 24
    assert all(receiver == runner and runner.startswith("io-disk-") for _, receiver, runner in rows), rows
    assert len({runner for _, _, runner in rows}) == 2, rows  # the two threads take turns at the socket


def test_an_io_process_that_keeps_dying_switches_the_tiers_off_with_one_line(disk_dir, caplog):
    engine = Engine(layouts()[0][1], disk_dir, host_blocks=4)
    io = engine.worker.io
    with caplog.at_level(logging.ERROR, logger="kvtier.io"):
        for _ in range(4):
            assert _wait_until(lambda: io.ready, 30)
            pid = io.pid
            os.kill(pid, signal.SIGKILL)
            assert _wait_until(lambda: io.disabled or (io.ready and io.pid != pid), 30)
    assert io.disabled
    assert sum("are off in this process" in r.message for r in caplog.records) == 1
    reports = engine.store(keys_of([1]), [1])  # the host pool still works; the write fails at once
    assert reports[0].success and reports[0].failed_writes == {"disk": keys_of([1])}
    engine.close()


def test_a_clean_shutdown_flushes_queued_writes(disk_dir):
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=40, disk_blocks=64)
    randomize(tensors)
    keys = keys_of(range(40))
    job = engine.manager.plan_store("r", keys, list(range(1, 41)))
    engine.worker.submit_store(job)
    engine.close()  # at once: the copy, then the writes, finish before close returns
    assert all(_entries(disk_dir, engine.worker.rank_fingerprint, keys))


def test_a_shutdown_past_shutdown_flush_s_drops_and_says_so(disk_dir, caplog):
    tensors = layouts()[0][1]
    engine = Engine(tensors, disk_dir, host_blocks=8, shutdown_flush_s=0.5)
    job = engine.manager.plan_store("r", keys_of(range(8)), list(range(1, 9)))
    _stop(engine.worker.io.pid)  # a store that never answers
    engine.worker.submit_store(job)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING):
        engine.close()
    assert time.monotonic() - began < 10  # bounded by shutdown_flush_s, plus a grace to stop the process
    assert any("dropped" in r.message or "exited" in r.message for r in caplog.records)


_ENGINE_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {root!r})
    from tests.test_tiering import Engine, keys_of, layouts, randomize
    tensors = layouts()[0][1]
    engine = Engine(tensors, {disk_dir!r}, host_blocks=40, disk_blocks=100000)  # no place is reused
    randomize(tensors)
    print(engine.worker.io.pid, engine.worker.rank_fingerprint.hex(), flush=True)
    for round in range(100000):
        keys = keys_of(range(round * 40, round * 40 + 40))
        job = engine.manager.plan_store("r", keys, list(range(1, 41)))
        engine.run([job], engine.worker.submit_store)
""")


def test_sigkill_of_the_engine_takes_the_io_process_and_leaves_no_half_written_entry(tmp_path):
    """SIGKILL mid-writes: the I/O process finishes the writes it holds and exits (within
    shutdown_flush_s; here at once, it holds one job); every entry on disk is whole."""
    disk_dir = str(tmp_path / "disk")
    script = _ENGINE_SCRIPT.format(root=str(ROOT), disk_dir=disk_dir)
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    io_pid, fingerprint = engine.stdout.readline().split()
    time.sleep(2.0)  # writes under way
    engine.kill()
    engine.wait()
    assert _wait_until(lambda: not _alive(int(io_pid)), 5), "the I/O process outlived its engine"
    store = DiskStore(disk_dir, bytes.fromhex(fingerprint), layouts()[0][1][0][0].numel() * 2 * 3)
    entries = entries_in(disk_dir)
    assert entries, "the engine wrote nothing before it was killed"
    out = np.empty(store.slot_bytes, np.uint8)
    for _, _, key, _, location in entries:  # each entry present is whole and checks out
        assert store.read(key, memoryview(out), location) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**40), st.lists(st.one_of(st.none(), st.builds(
    Miss, st.sampled_from([BAD, GONE, UNAVAILABLE, FULL]), st.text(max_size=30))), max_size=20)),
                min_size=1, max_size=8),
       st.lists(st.integers(1, 200), min_size=1, max_size=40))
def test_frames_read_in_pieces_of_any_size_come_out_whole_and_in_order(outcomes, cuts):
    """The worker reads its I/O process's answers without blocking, in whatever pieces the
    socket gives (the engine's step and the receiver thread take turns)."""
    from kvtier.io.messages import FrameReader, Outcome, _LENGTH, _encoder

    messages = [Outcome(job_id, reasons) for job_id, reasons in outcomes]
    stream = b"".join(_LENGTH.pack(len(body)) + body for body in map(_encoder.encode, messages))
    reader, got, at = FrameReader(), [], 0
    for cut in cuts * (len(stream) // sum(cuts) + 1):
        got += reader.feed(stream[at:at + cut])
        at += cut
        if at >= len(stream):
            break
    assert got == messages


def test_a_read_is_taken_before_the_writes_queued_ahead_of_it(tmp_path):
    """Six large write jobs, then one read: the read waits only for a thread to come free, not for
    the writes queued before it (in arrival order it would come after five of them)."""
    import threading

    from kvtier.cli.bench.io_path import IOPath
    from kvtier.tiers.base import TierSpec

    spec = TierSpec("disk", "kvtier.tiers.disk", str(tmp_path), threads=2,
                    options={"write": True, "entry_key_file": None})
    blocks, slot_bytes = 24, 1 << 20
    path = IOPath(spec, 1 + 6 * blocks, slot_bytes)
    try:
        path.slots[:] = np.random.default_rng(3).integers(0, 256, path.slots.shape, dtype=np.uint8)
        stored = path.slots[0].copy()
        path.job(True, keys_of([10_000]), [0])
        path.slots[0] = 0
        answers, all_in = [], threading.Semaphore(0)

        def answered(name):
            def done(reasons):
                answers.append((name, reasons))
                all_in.release()
            return done

        # All seven jobs are in the process's socket before it takes the first: the order they are run
        # in is then its choice alone, not a race between its receiver and its first writes.
        _stop(path.io.pid)
        for job in range(6):
            slots = list(range(1 + job * blocks, 1 + (job + 1) * blocks))
            path.io.submit(spec.name, True, keys_of(slots), slots, slots, time.monotonic() + 60, answered(job))
        path.io.submit(spec.name, False, keys_of([10_000]), [0], [0], time.monotonic() + 60, answered("read"))
        os.kill(path.io.pid, signal.SIGCONT)
        for _ in range(7):
            assert all_in.acquire(timeout=60)
        assert all(reason is None for _, reasons in answers for reason in reasons)
        assert np.array_equal(path.slots[0], stored)
        order = [name for name, _ in answers]
        assert order.index("read") <= 2, order  # behind at most the two writes running when it came
    finally:
        path.close()


def test_a_pool_store_connects_when_its_process_starts_not_at_its_first_job():
    from redis import Redis

    from kvtier.cli.servers import local_redis
    from kvtier.io.client import IOProcess
    from kvtier.tiers.base import TierSpec

    with local_redis() as server:
        observer = Redis.from_url(server.url)
        before = len(observer.client_list())
        io = IOProcess(None, [TierSpec("redis", "kvtier.tiers.redis", server.url)], b"\x01" * 16, None)
        try:
            assert _wait_until(lambda: len(observer.client_list()) > before, 10), "no connection before a job"
        finally:
            io.close(5.0)
            observer.close()


def _job(path, write: bool, keys, slot_ids, checksums=None, check_in_copy=False):
    """One job through ``path``'s I/O process; its reasons, one per block (with ``check_in_copy``,
    and the checksums the store answered, or None)."""
    import threading

    answered, reasons, sums = threading.Event(), [], [None]

    def callback(answer, checksums=None):
        reasons.extend(answer)
        sums[0] = checksums
        answered.set()

    path.io.submit(path.tier, write, keys, slot_ids, slot_ids, time.monotonic() + 30, callback, checksums,
                   check_in_copy)
    assert answered.wait(30)
    return (reasons, sums[0]) if check_in_copy else reasons


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("tier", ["disk", "file", "redis", "mooncake"])
def test_writes_frame_their_entries_with_the_checksums_their_copy_took(tier, keyed, tmp_path):
    """A write job carries each slot's checksum, taken by the copy that filled the slot: every store
    frames its entries with it rather than reading the slot again. So a wrong one (slot 3's here)
    makes that entry fail its check when read back, a miss. With an entry key a store makes its own
    keyed tags, and every entry loads."""
    import contextlib

    from kvtier.cli.bench.io_path import IOPath
    from kvtier.cli.servers import local_mooncake, local_redis
    from kvtier.tiers.base import TierSpec
    from kvtier.tiers.registry import kind_of, module_of

    key_file = None
    if keyed:
        key_file = tmp_path / "entry.key"
        key_file.write_bytes(os.urandom(32))
        key_file.chmod(0o600)
    options = {"write": True, "entry_key_file": None if key_file is None else str(key_file)}
    server = {"redis": lambda: local_redis(log_path=str(tmp_path / "redis.log")),
              "mooncake": lambda: local_mooncake(log_path=str(tmp_path / "mooncake.log"))}.get(tier)
    rows = np.random.default_rng(3).integers(0, 256, (4, 3 * 4096 + 64), dtype=np.uint8)
    keys = [bytes([i]) * 16 for i in range(4)]
    with server() if server else contextlib.nullcontext() as running:
        if tier == "disk":
            spec = TierSpec("disk", "kvtier.tiers.disk", str(tmp_path / "disk"), options=options)
        else:
            url = running.url if running else f"file://{tmp_path / 'shared'}"
            spec = TierSpec(kind_of(url).name, module_of(url), url, timeout_s=10.0, retry_s=1.0, options=options)
        path = IOPath(spec, len(rows), rows.shape[1])
        try:
            sums = path.fill(rows)
            assert sums == [checksum(row) for row in rows]  # what the native copy took as it wrote
            sums[3] ^= 1
            assert _job(path, True, keys, [0, 1, 2, 3], sums) == [None] * 4
            path.slots[:] = 0
            reasons = _job(path, False, keys, [0, 1, 2, 3])
            assert np.array_equal(path.slots[:3], rows[:3])
            assert reasons == [None] * 4 if keyed else reasons[:3] == [None] * 3 and reasons[3] == bad("checksum mismatch")
            # A read whose checksums the load's copy checks: the store checks the rest and answers the
            # checksum each header holds (slot 3's wrong one too, for the copy to catch); a keyed store
            # checks its tags itself and answers none.
            path.slots[:] = 0
            reasons, answered = _job(path, False, keys, [0, 1, 2, 3], check_in_copy=True)
            assert reasons == [None] * 4 and np.array_equal(path.slots, rows)
            assert answered == [None] * 4 if keyed else answered == sums
        finally:
            path.close()
