"""The node cache server (``kvtier serve node``) as a real process, reached as the ``node://`` tier."""

import itertools
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import msgspec
import pytest
import torch
import zmq
# At collection: importing it keeps the importing frames alive, and with them a test's engines.
from vllm.distributed.kv_events import KVEventBatch

from kvtier.cli.servers import local_node
from kvtier.common.config import ConfigError, KVTierConfig
from kvtier.common.keys import Namespace
from kvtier.node import protocol as p
from kvtier.node.arena import Arena, Holder
from kvtier.scheduler.manager import TierManager
from kvtier.tiers.node import NodeClient
from kvtier.worker import TierWorker
from tests.test_remote import Instance, keys_of

NB, BS = 32, 4
NAMESPACE = Namespace("node-test", "bfloat16", "kv", (1, 8), 2, BS)


class Engine(Instance):
    """One engine's kvtier halves on a fresh KV cache, with its host pool and the node."""

    def __init__(self, node, namespace=NAMESPACE, track_holdings=False, **config):
        self.tensors = [torch.randint(-5000, 5000, (NB, 1, BS, 16), dtype=torch.int16).view(torch.bfloat16)
                        for _ in range(2)]
        self.config = KVTierConfig.from_sources({"host_bytes": 16 * 2 * BS * 16 * 2, "node_socket": node.socket_path,
                                                 "remote_timeout_s": 1.0, "remote_retry_s": 1.0, **config}, environ={})
        self.worker = TierWorker(self.config, self.tensors, NB, BS, namespace)
        self.manager = TierManager(self.config, self.worker.layout.slot_bytes, [self.worker.rank_fingerprint],
                                   track_holdings=track_holdings)

    def store(self, ids, blocks):
        return self.run(self.manager.plan_store("s", keys_of(ids), blocks), self.worker.submit_store)


def stats(node) -> dict:
    client = NodeClient(node.socket_path, 5.0)
    try:
        return client.stats()
    finally:
        client.close()


def metrics(node) -> str:
    return urllib.request.urlopen(node.metrics_url, timeout=5).read().decode()


def answered_at_once(engine, keys, hits: int, timeout=10.0) -> bool:
    """Whether the engine's node index comes to answer a lookup of ``keys`` with ``hits`` leading hits at
    once, without a check sent to the node (a new request each time): once the node has told it what it
    holds. (The index alone: a block the engine loaded is a hit in its own host pool too.)"""
    index, deadline = engine.manager.tiers[0], time.monotonic() + timeout
    for attempt in itertools.count():
        checks = index.num_checks
        found = index.lookup(keys, f"once-{attempt}")
        if found is not None and (found + [False]).index(False) == hits and index.num_checks == checks:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.fixture
def node(tmp_path):
    with local_node(str(tmp_path), log_path=str(tmp_path / "node.log")) as server:
        yield server


def test_what_one_engine_stores_is_a_byte_exact_hit_for_another_and_never_for_another_namespace(node):
    a, b = Engine(node), Engine(node)
    blocks = [3, 4, 9]
    assert a.store([1, 2, 3], blocks).success
    assert answered_at_once(b, keys_of([1, 2, 3, 4]), 3)  # as soon as the node told B's index
    assert b.lookup(keys_of([1, 2, 3, 4])) == 3
    job = b.manager.plan_load("r", keys_of([1, 2, 3]), [20, 21, 22])
    assert job.fill_from == ["node"] * 3
    assert b.run(job, b.worker.submit_load).success
    for x, y in zip(a.tensors, b.tensors):
        assert torch.equal(x[blocks].view(torch.int16), y[[20, 21, 22]].view(torch.int16))
    other = Engine(node, Namespace("another-model", "bfloat16", "kv", (1, 8), 2, BS))
    assert other.lookup(keys_of([1, 2, 3])) == 0  # the same keys of another namespace: nothing shared
    state = stats(node)
    (space,) = state["namespaces"].values()
    assert space["entries"] == 3 and space["hits"] == 3 and space["pages_pinned"] == 0
    assert 'kvtier_node_entries{namespace="' in metrics(node)
    for engine in (a, b, other):
        engine.close()


def test_three_engines_sharing_a_system_prompt_hold_it_once_in_memory_and_once_on_disk(node):
    engines = [Engine(node) for _ in range(3)]
    for engine in engines:  # each stores the same prompt's blocks, as each would compute it once
        assert engine.store(range(10, 16), list(range(6))).success
    deadline = time.monotonic() + 10
    while (state := stats(node))["on_disk"]["entries"] < 6:  # written through by the server's own writers
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (space,) = state["namespaces"].values()
    assert space["entries"] == 6 and space["stores"] == 6  # the second and third stores found them held
    assert state["on_disk"]["entries"] == 6
    disk_files = [f for _, _, files in os.walk(os.path.dirname(node.socket_path) + "/node-disk") for f in files]
    assert len(disk_files) == 6
    for engine in engines:
        engine.close()


def test_a_client_maps_an_arena_on_huge_pages_whole_as_it_connects(node):
    """Where the server put its arena on huge pages, a client maps all of it at once, an entry per 2 MiB
    (an engine's first hits fault nothing in); elsewhere it maps the pages as it first reads them.
    Its copies, across pages and from buffers of any kind, are byte-exact."""
    from kvtier.io.pages import huge_bytes

    client = NodeClient(node.socket_path, 5.0)
    assert huge_bytes(client._arena) == (client.arena_bytes if client.huge else 0)
    payloads = [os.urandom(n) for n in (1, client.page_bytes - 64, client.page_bytes, 3 * client.page_bytes + 5)]
    names = [f"kvtier/bb/{i:02x}" for i in range(len(payloads))]
    assert client.put(names, [bytes(range(64))] * len(names), payloads) == [True] * len(names)  # read-only bytes
    heads = [bytearray(64) for _ in names]
    bodies = [bytearray(len(payload)) for payload in payloads]
    assert client.get_into(names + ["kvtier/bb/ff"], heads + [bytearray(64)], bodies + [bytearray(1)]) == \
        [True] * len(names) + [None]
    assert heads == [bytearray(range(64))] * len(names) and [bytes(b) for b in bodies] == payloads
    with pytest.raises(ValueError, match="writable"):  # nothing is copied into memory it may not write
        client.get_into(names[:1], [bytes(64)], [bytes(1)])
    client.close()


def test_arena_pins_writes_and_release_follow_their_holders():
    arena = Arena(8, 100)
    a, b = Holder("a"), Holder("b")
    assert arena.reserve(a, ["x", "y"], [250, 100]) == [[0, 1, 2], [3]]
    assert arena.pin(b, ["x"]) == [None]  # being written: nobody sees it
    assert arena.reserve(b, ["x"], [250]) == [None]  # nor writes it twice
    assert arena.commit(a, ["x", "y"], [True, False]) == ["x"]
    assert arena.reserve(b, ["x"], [250]) == [[]]  # held: nothing to write
    assert arena.pin(b, ["x"]) == [(250, [0, 1, 2])]
    assert arena.reserve(a, ["z"], [600]) == [None]  # x is pinned: 5 pages free, 6 needed
    assert arena.release(b) == 1
    assert arena.reserve(a, ["z"], [600]) == [[0, 1, 2, 3, 4, 5]]  # x evicted once unpinned
    assert arena.take_evicted() == ["x"] and not arena.holds("x")
    assert arena.release(a) == 1 and arena.num_pinned_pages == 0 and not arena.holds("z")
    assert arena.stats()["free_pages"] == 8


def test_each_engine_is_counted_for_what_it_stored_and_the_engines_gone_together():
    from kvtier.node.metrics import prometheus

    arena = Arena(4, 100)
    a, b = Holder("a"), Holder('b"\n')  # a label the text format must quote
    arena.reserve(a, ["x"], [100])
    arena.commit(a, ["x"], [True])
    assert arena.pin(b, ["x"]) == [(100, [0])] and arena.pin(a, ["x"]) == [(100, [0])]  # one hit of another's
    arena.unpin(a, ["x"])
    arena.unpin(b, ["x"])
    assert arena.reserve(b, ["y"], [400]) == [[0, 1, 2, 3]]  # x evicted for it
    arena.commit(b, ["y"], [True])
    by = arena.stats()["stored_by"]
    assert by["a"] == {"pages_used": 0, "stores": 1, "hits_served_to_others": 1, "evictions": 1}
    assert by['b"\n'] == {"pages_used": 4, "stores": 1, "hits_served_to_others": 0, "evictions": 0}
    counters = dict.fromkeys(("refused_uid", "refused_protocol", "disk_reads", "disk_skipped", "released_holds"), 0)
    text = prometheus({**arena.stats(), **counters, "engines": {}, "arena_bytes": 400})
    assert 'kvtier_node_engine_used_bytes{engine="b\\"\\n"} 400' in text
    assert 'kvtier_node_engine_hits_served_to_others_total{engine="a"} 1' in text
    arena.depart('b"\n')
    arena.depart("a")
    assert arena.stats()["stored_by"] == {"departed": {"pages_used": 4, "stores": 2, "hits_served_to_others": 1,
                                                       "evictions": 1}}


_KILLED_CLIENT = textwrap.dedent("""
    import os, signal, sys
    from kvtier.node import protocol as p
    from kvtier.tiers.node import NodeClient
    client = NodeClient(sys.argv[1], 5.0)
    if sys.argv[2] == "store":  # reserve, fill half, die before the commit
        (pages,) = client._ask(p.Reserve(["kvtier/aa/01"], [3 * client.page_bytes]), p.Reserved).pages
        p.entry_views(client._memory, client.page_bytes, 3 * client.page_bytes, pages)[0][:] = b"\\x07" * client.page_bytes
    else:  # pin and die before the copy ends
        assert client._ask(p.Pin(["kvtier/aa/02"]), p.Pinned).entries[0] is not None
    print("ready", flush=True)
    signal.pause()
""")


@pytest.mark.parametrize("during", ["store", "load"])
def test_a_client_killed_mid_store_or_mid_load_leaves_no_pin_and_no_half_entry(node, during):
    writer = NodeClient(node.socket_path, 5.0)
    payload = memoryview(bytearray(os.urandom(2 * writer.page_bytes)))
    assert writer.put(["kvtier/aa/02"], [memoryview(bytearray(64))], [payload]) == [True]
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, node.socket_path, during], stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"ready"
    # The 3 pages reserved (the entry of 64 + 2 pages' bytes takes 3 too), or those of the pinned entry.
    assert stats(node)["namespaces"]["aa"]["pages_pinned"] == 3
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 5
    while stats(node)["namespaces"]["aa"]["pages_pinned"]:
        assert time.monotonic() < deadline, "the killed client's pages stayed held"
        time.sleep(0.02)
    assert writer.exists(["kvtier/aa/01", "kvtier/aa/02"]) == [False, True]  # no half entry, the other intact
    head, body = memoryview(bytearray(64)), memoryview(bytearray(2 * writer.page_bytes))
    assert writer.get_into(["kvtier/aa/02"], [head], [body]) == [True] and bytes(body) == bytes(payload)
    assert stats(node)["released_holds"] == 1
    writer.close()


@pytest.fixture
def open_folder():
    """A folder any user can pass through (pytest's own are its owner's only)."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="kvtier-node-")
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_only_the_owner_gets_in(open_folder):
    with local_node(open_folder) as node:
        assert stat.S_IMODE(os.stat(node.socket_path).st_mode) == 0o600
        os.chmod(node.socket_path, 0o666)  # past the file's own guard: the server's check still refuses
        assert _connect_as_another_user(node) == ["Refused", False]  # and no descriptor came with the answer
        assert stats(node)["refused_uid"] == 1


def _connect_as_another_user(node):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # another user
        os.close(read)
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(node.socket_path)
            try:
                p.send(sock, p.Hello(p.VERSION, "intruder"))
            except BrokenPipeError:  # refused as it connected, before it spoke: the answer is still there to read
                pass
            answer, fd = p.receive_welcome(sock)
            os.write(write, json.dumps([type(answer).__name__, fd is not None]).encode())
        except BaseException as error:
            os.write(write, json.dumps([repr(error), False]).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    return json.loads(os.read(read, 1000))


def test_a_thousand_malformed_messages_leave_the_server_up(node):
    rng = random.Random(7)
    frames = [b"\xff\xff\xff\xff", b"\x05\x00\x00\x00hello", p.encode(p.Welcome(1, 1, 1)),
              p.encode(p.Hello(99, "old")), p.encode(p.Pin(["x"]))]
    good_hello = p.encode(p.Hello(p.VERSION, "fuzz"))
    after_hello = [p.encode(p.Reserve(["a", "b"], [1])), p.encode(p.Commit(["a"], [])),
                   p.encode(p.Reserve(["a"], [-5])), p.encode(p.Exists(["n"] * (p.MAX_BATCH + 1))),
                   p.encode(p.Found([True])), p.encode(p.Pin(["x" * 600]))]
    for i in range(1000):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(node.socket_path)
            kind = i % 3
            if kind == 0:
                sock.sendall(rng.choice(frames) if rng.random() < 0.5 else os.urandom(rng.randrange(1, 200)))
            else:
                sock.sendall(good_hello)
                os.close(p.receive_welcome(sock)[1])
                sock.sendall(rng.choice(after_hello) if kind == 1 else
                             p.encode(p.Exists(["ok"]))[:4] + os.urandom(rng.randrange(1, 100)))
            sock.shutdown(socket.SHUT_WR)  # a frame cut short ends here, as a client that died would leave it
            try:
                sock.recv(100)  # Refused, or the close
            except OSError:
                pass
    assert node.proc.poll() is None
    client = NodeClient(node.socket_path, 5.0)
    assert client.put(["kvtier/bb/01"], [memoryview(bytearray(64))], [memoryview(bytearray(100))]) == [True]
    state = client.stats()
    assert state["refused_protocol"] >= 500  # told why, then closed (a frame cut short: closed)
    assert list(state["engines"]) == [str(os.getppid())]  # this client alone: no fuzzing connection lingers
    client.close()


def test_a_client_that_stops_reading_stalls_no_other(node):
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.connect(node.socket_path)
    p.send(stuck, p.Hello(p.VERSION, "stuck"))
    p.receive_welcome(stuck)
    stuck.settimeout(2.0)
    request = p.encode(p.Exists(["kvtier/cc/" + "0" * 400] * 1000))
    with pytest.raises(TimeoutError):
        for _ in range(2000):  # asks and never reads an answer: its socket fills both ways
            stuck.sendall(request)
    began = time.monotonic()
    other = NodeClient(node.socket_path, 5.0)
    assert other.put(["kvtier/cc/01"], [memoryview(bytearray(64))], [memoryview(bytearray(10))]) == [True]
    assert other.exists(["kvtier/cc/01"]) == [True]
    assert time.monotonic() - began < 5
    other.close()
    stuck.close()


def test_engines_serve_through_a_node_server_outage_and_use_it_again_once_it_is_back(node, capfd):
    a = Engine(node)
    assert a.store([1], [1]).success
    node.stop()
    began = time.monotonic()
    assert a.lookup(keys_of([2])) == 0  # a miss, within the timeout: never a wait
    report = a.store([5], [5])
    assert report.failed_writes == {"node": keys_of([5])}  # counted, recomputed later, never raised
    assert time.monotonic() - began < 5
    node.start()
    time.sleep(1.1)  # remote_retry_s: then kvtier connects again
    assert a.store([6], [6]).success
    b = Engine(node)
    assert b.lookup(keys_of([6])) == 1
    lines = [line for line in capfd.readouterr().err.splitlines() if "node.sock" in line]
    assert any("failed" in line for line in lines) and any("is back" in line for line in lines)
    a.close()
    b.close()


def test_a_node_server_restarted_reads_its_disk_back_into_memory(node):
    a = Engine(node)
    assert a.store(range(20, 24), [0, 1, 2, 3]).success
    deadline = time.monotonic() + 10
    while stats(node)["on_disk"]["entries"] < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    a.close()
    node.stop()
    node.start()  # memory is gone with the process, the node's disk is not
    b = Engine(node)
    assert b.lookup(keys_of(range(20, 24))) == 4
    job = b.manager.plan_load("r", keys_of(range(20, 24)), [10, 11, 12, 13])
    assert b.run(job, b.worker.submit_load).success
    for x, y in zip(a.tensors, b.tensors):
        assert torch.equal(x[[0, 1, 2, 3]].view(torch.int16), y[[10, 11, 12, 13]].view(torch.int16))
    assert stats(node)["disk_reads"] == 4
    b.close()


def test_node_socket_is_validated_and_stands_for_the_node_tier(tmp_path):
    config = KVTierConfig.from_sources({"node_socket": "/run/kvtier/node.sock"}, environ={})
    assert [entry.url for entry in config.tier_entries()] == ["node:///run/kvtier/node.sock"]
    with pytest.raises(ConfigError, match="'node_socket'"):
        KVTierConfig.from_sources({"node_socket": "relative.sock"}, environ={})
    with pytest.raises(ConfigError, match="'disk_dir'"):
        KVTierConfig.from_sources({"node_socket": "/run/kvtier/node.sock", "disk_dir": str(tmp_path)}, environ={})
    alone = KVTierConfig.from_sources({"node_socket": "/n.sock", "disk_dir": None}, environ={})  # no disk: allowed
    assert [entry.url for entry in alone.tier_entries()] == ["node:///n.sock"]
    with pytest.raises(ConfigError, match="'node_socket'"):
        KVTierConfig.from_sources({"node_socket": "/a.sock", "tiers": ["disk:///x"]}, environ={})
    with pytest.raises(ConfigError, match="node:// URL"):
        from kvtier.tiers.registry import tier_specs
        tier_specs(KVTierConfig.from_sources({"tiers": ["node://host/x.sock"]}, environ={}))


def test_what_the_node_evicts_from_memory_without_a_disk_its_engines_hear_at_once(tmp_path):
    with local_node(str(tmp_path), host_bytes="1MiB", disk=False) as node:  # 16 pages: 16 entries
        engine = Engine(node)
        index = engine.manager.tiers[0]
        engine.lookup(keys_of([999]))  # the index's lookup process is up, and listens for removals
        for start in (0, 12):
            assert engine.store(range(start, start + 12), list(range(start, start + 12))).success
        deadline = time.monotonic() + 10
        while True:
            index.absorb_news()
            if index.num_told_gone >= 8:
                break
            assert time.monotonic() < deadline, "no eviction was told"
            time.sleep(0.05)
        state = stats(node)
        assert sum(s["evictions"] for s in state["namespaces"].values()) == 8 == index.num_told_gone
        engine.close()


def test_an_engine_answers_lookups_from_what_the_node_tells_it_holds_and_asks_again_once_the_node_is_gone(tmp_path):
    with local_node(str(tmp_path), host_bytes="1MiB", disk=False) as node:  # 16 pages: 16 entries
        a, b = Engine(node), Engine(node)
        assert a.store(range(0, 12), list(range(12))).success
        assert answered_at_once(b, keys_of(range(0, 14)), 12)  # A's entries, then the misses
        assert answered_at_once(b, keys_of([500]), 0)
        assert b.manager.lookup(keys_of(range(0, 12)), "r") == 12
        job = b.manager.plan_load("r", keys_of(range(0, 12)), list(range(20, 32)))
        assert job.fill_from == ["node"] * 12 and b.run(job, b.worker.submit_load).success
        for x, y in zip(a.tensors, b.tensors):
            assert torch.equal(x[:12].view(torch.int16), y[20:32].view(torch.int16))
        assert a.store(range(12, 24), list(range(12))).success  # the node evicts the 8 oldest
        assert answered_at_once(b, keys_of(range(8, 24)), 16) and answered_at_once(b, keys_of([0]), 0)
        node.stop()
        index, deadline = b.manager.tiers[0], time.monotonic() + 10
        for attempt in itertools.count():  # what the node told stands only while it is up: then it is asked
            if index.lookup(keys_of([10]), f"after-{attempt}") is None:
                break
            assert time.monotonic() < deadline, "the lost node was never noticed"
            time.sleep(0.05)
        assert b.manager.host.num_pins == 0
        for engine in (a, b):
            engine.close()


def test_an_engine_slow_to_finish_its_start_loses_nothing_the_node_told_it_meanwhile(tmp_path, monkeypatch):
    """The lookup process tells what the node holds as soon as it is up. Here the engine's thread is held
    after building it until that whole list has arrived: none of it may be lost on the way (a list heard
    only at its end would stand for "the node holds nothing", every lookup a miss)."""
    from kvtier.io import client
    from kvtier.io.messages import Held

    told = threading.Event()
    dispatch, build = client.IOProcess._dispatch, client.IOProcess.__init__

    def dispatched(self, messages):
        dispatch(self, messages)
        if any(isinstance(m, Held) and m.complete for m in messages):
            told.set()

    def built(self, memory_fd, *args, **kwargs):
        build(self, memory_fd, *args, **kwargs)
        if memory_fd is None:  # a lookup process: its list heard in full before its builder goes on
            assert told.wait(10.0), "the node never told the lookup process what it holds"

    monkeypatch.setattr(client.IOProcess, "_dispatch", dispatched)
    monkeypatch.setattr(client.IOProcess, "__init__", built)
    with local_node(str(tmp_path), disk=False) as node:
        a = Engine(node)
        assert a.store(range(0, 12), list(range(12))).success
        told.clear()  # A's own list came before it stored
        b = Engine(node)
        assert answered_at_once(b, keys_of(range(0, 14)), 12, timeout=3.0)
        for engine in (a, b):
            engine.close()


def test_a_list_of_what_the_node_holds_heard_from_its_middle_on_answers_nothing():
    """A watch's first notice resets what was told; "complete" without it (its start lost) is no list of
    all the node holds: a lookup is then asked of the server, never answered "held nowhere"."""
    from kvtier.tiers.pool import _Held, pool_key

    rank, key = bytes(16), keys_of([7])[0]
    held = _Held([rank])
    held.told([], complete=True)
    assert held.answer([key]) is None
    held.told(None, False)
    held.told([pool_key(rank, key)], complete=False)
    held.told([], complete=True)
    assert held.answer([key, keys_of([8])[0]]) == [True, False]


class Published:
    """A ZMQ subscriber to the node's KV events, decoded by vLLM's own ``KVEventBatch``."""

    def __init__(self, endpoint: str):
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        time.sleep(0.5)  # a ZMQ subscriber hears only what is published once its subscription has arrived

    def take(self, kind: str, count: int, timeout: float = 15.0) -> list:
        """The events of ``kind`` published until ``count`` of them came, or ``timeout``."""
        seen, deadline = [], time.monotonic() + timeout
        while len(seen) < count and self.socket.poll(max(0, int(1000 * (deadline - time.monotonic())))):
            _, seq, payload = self.socket.recv_multipart()
            seen += [e for e in self.decoder.decode(payload).events if type(e).__name__ == kind]
        return seen


def announced_store(engine, metas: dict) -> list:
    """``engine`` stores ``metas``' blocks (keys 1, 2, 3) with vLLM's KV events on; what it publishes itself."""
    from kvtier.integrations.vllm.events import KVEvents

    events = KVEvents.of(engine.manager)
    for key, meta in metas.items():
        events.held.remember(key, meta)
    assert engine.store([1, 2, 3], [3, 4, 5]).success
    own = events.take(engine.manager.ledger, BS)
    events.close()  # what it handed over is sent first
    return own


def block_metas() -> dict:
    from kvtier.integrations.vllm.events import BlockMeta

    return {key: BlockMeta(os.urandom(32), None, tuple(range(i * BS, (i + 1) * BS)), None, None, None)
            for i, key in enumerate(keys_of([1, 2, 3]))}


def test_the_node_publishes_each_entrys_kv_events_once_for_all_its_engines(tmp_path):
    """Three engines store one prompt and hand the node their events: the node publishes each block's
    storage once (vLLM's format and framing), the engines publish none for the node, and each
    removal goes out when the node evicts the block. Events that do not decode are never published."""
    from kvtier.cli.servers import free_port
    from kvtier.tiers.node import connect
    from kvtier.tiers.pool import pool_key

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with local_node(str(tmp_path), host_bytes="1MiB", disk=False, events_endpoint=endpoint) as node:  # 16 entries
        published = Published(endpoint)
        engines = [Engine(node, track_holdings=True) for _ in range(3)]
        metas = block_metas()
        assert engines[0].store([1], [3]).success
        sock, _, fd = connect(node.socket_path, 5.0)  # events that are not one msgpack value each, or of a block not held
        os.close(fd)
        name = pool_key(engines[0].worker.rank_fingerprint, keys_of([1])[0])
        p.send(sock, p.Announce([name, name + "0"], [b"\xc1", b"\x01"], [b"\x01\x02", b"\x01"]))
        p.send(sock, p.Stats())  # answered once the Announce before it was taken
        assert isinstance(p.receive(sock), p.StatsReply)
        sock.close()
        for engine in engines:
            own = announced_store(engine, metas)
            assert own and all(e.medium == "CPU" and e.ownership == "kvtier:host" for e in own), own
        stored = published.take("BlockStored", 4, timeout=5.0)  # a fourth would be a second copy: none comes
        assert sorted(e.block_hashes[0] for e in stored) == sorted(m.block_hash for m in metas.values())
        assert all(e.ownership.startswith("kvtier:node:") and e.token_ids == list(metas[k].token_ids)
                   for k in metas for e in stored if e.block_hashes[0] == metas[k].block_hash)
        assert stats(node)["events"]["announced"] == 3
        for start in (10, 22):  # 24 other entries: the first three are evicted
            assert engines[0].store(range(start, start + 12), list(range(12))).success
        removed = published.take("BlockRemoved", 3)
        assert sorted(e.block_hashes[0] for e in removed) == sorted(m.block_hash for m in metas.values())
        state = stats(node)
        assert state["events"]["events_published"] == 6 and state["events"]["announced"] == 0
        assert "kvtier_node_events_published_total 6" in metrics(node)
        for engine in engines:
            engine.close()


def test_a_restarted_node_server_announces_what_its_disk_still_holds(tmp_path):
    """A node server with a disk is killed after its entries were announced; started again, it
    announces them from its journal before any engine stores anything."""
    from kvtier.cli.servers import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with local_node(str(tmp_path), events_endpoint=endpoint) as node:
        published = Published(endpoint)
        engine, metas = Engine(node, track_holdings=True), block_metas()
        announced_store(engine, metas)
        assert len(published.take("BlockStored", 3)) == 3
        journal = tmp_path / "node-disk" / "events.journal"
        deadline = time.monotonic() + 10
        while not (stats(node)["on_disk"]["entries"] == 3 and journal.exists() and journal.stat().st_size > 0):
            assert time.monotonic() < deadline, "the disk or the journal did not catch up"
            time.sleep(0.05)
        node.stop()
        node.start()
        again = published.take("BlockStored", 4, timeout=10.0)
        assert sorted(e.block_hashes[0] for e in again) == sorted(m.block_hash for m in metas.values())
        assert stats(node)["events"]["announced"] == 3
        engine.close()


def replayed(endpoint: str, start_seq: int, timeout: float = 10.0) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol, as a router speaks it: (seq, payload) of the batches from ``start_seq``."""

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    try:
        socket.send_multipart((b"", start_seq.to_bytes(8, "big")))
        batches = []
        while socket.poll(int(timeout * 1000)):
            _, topic, seq, payload = socket.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert topic == payload == b""
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
        raise AssertionError(f"no end of the replay came; {len(batches)} batches")
    finally:
        socket.close(linger=0)


def test_a_router_that_connects_late_has_the_node_replay_its_events(tmp_path):
    """Nobody listens while an engine stores three blocks; a router that comes later asks the replay
    endpoint for everything from sequence 0 and reads each block's storage, as vLLM's replay protocol
    hands it (a later start sequence, only what followed); a malformed request gets no answer and
    leaves the endpoint serving."""
    from kvtier.cli.servers import free_port

    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    with local_node(str(tmp_path), disk=False, events_endpoint=endpoint, events_replay=replay) as node:
        engine, metas = Engine(node, track_holdings=True), block_metas()
        announced_store(engine, metas)
        deadline = time.monotonic() + 10
        while stats(node)["events"]["events_published"] < 3:
            assert time.monotonic() < deadline, "the node published nothing"
            time.sleep(0.05)
        junk = zmq.Context.instance().socket(zmq.DEALER)
        junk.connect(replay)
        junk.send_multipart((b"", b"not a sequence number"))
        batches = replayed(replay, 0)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        events = [e for _, payload in batches for e in decoder.decode(payload).events]
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        assert sorted(e.block_hashes[0] for e in events if type(e).__name__ == "BlockStored") == \
            sorted(m.block_hash for m in metas.values())
        assert replayed(replay, len(batches)) == []
        assert replayed(replay, len(batches) - 1) == batches[-1:]
        deadline = time.monotonic() + 10
        while stats(node)["events"]["replays_refused"] < 1:  # its own connection: it may come last
            assert time.monotonic() < deadline, "the malformed request was never taken"
            time.sleep(0.05)
        junk.close(linger=0)
        state = stats(node)["events"]
        assert state["replays"] == 3 and state["replays_refused"] == 1 and state["replay_endpoint"] == replay
        assert "kvtier_node_events_replays_total 3" in metrics(node)
        # ``kvtier doctor --node-socket`` says where the node's events go and what it announced.
        done = subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor", "--json", "--node-socket", node.socket_path,
                               "--kv-transfer-config", json.dumps({"kv_connector_extra_config": {"disk_dir": None}})],
                              capture_output=True, text=True, timeout=120)
        report = json.loads(done.stdout[done.stdout.index("{"):])
        (check,) = [c for c in report["checks"] if c["name"] == "node server"]
        assert check["ok"] and f"KV events: on {endpoint}, replayed on {replay}, 3 blocks announced" in check["detail"]
        engine.close()


def test_a_replay_endpoint_without_an_events_endpoint_is_refused_at_start(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "node", "--socket", str(tmp_path / "n.sock"),
                           "--kv-events-replay-endpoint", "tcp://127.0.0.1:1"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "--kv-events-replay-endpoint" in done.stderr and "--kv-events-endpoint" in done.stderr


def test_the_node_metrics_listen_on_loopback_unless_an_address_is_given():
    from kvtier.node.metrics import serve_metrics

    for host, expected in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
        http = serve_metrics(0, lambda: "kvtier_node_up 1\n", **({} if host is None else {"host": host}))
        try:
            address, port = http.server_address[:2]
            assert address == expected
            assert urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read() == b"kvtier_node_up 1\n"
        finally:
            http.shutdown()
            http.server_close()
