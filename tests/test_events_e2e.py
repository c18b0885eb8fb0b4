"""kvtier's tiers in vLLM's KV cache events: a real vLLM publishing on ZMQ (loopback), a plain
ZMQ subscriber, and vLLM's own ``KVEventBatch`` decoder."""

import random
import threading
import time

import msgspec
import pytest
import zmq

from kvtier.cli.servers import free_port, local_mooncake, local_node, local_redis
from tests.e2e import apps

pytestmark = pytest.mark.vllm

BLOCK = 32
ENGINE = {"dtype": "float32", "max_model_len": 4096, "max_num_seqs": 8, "prefix_caching": True}
PROMPTS = [[random.Random(seed).randrange(3, 2000) for _ in range(12 * BLOCK + 5)] for seed in (1, 2)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("events_e2e")


@pytest.fixture(scope="module")
def model(workdir):
    from kvtier.cli.demo.model import make_model
    return str(make_model(workdir / "model", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=1))


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"kv"):
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.batches, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            if self.socket.poll(100):
                _, _, payload = self.socket.recv_multipart()
                self.batches.append(decoder.decode(payload))

    def events(self):
        self._stop.set()
        self._thread.join()
        self.socket.close()
        return [event for batch in self.batches for event in batch.events]


@pytest.mark.parametrize("layout", ["in_process", "multiprocess"])
def test_every_tier_is_announced_under_vllms_own_block_hashes(workdir, model, layout, tmp_path):
    """Two prompts of 12 full blocks each, a host pool of 20 blocks and a disk tier: vLLM's
    device events and kvtier's carry the same hashes, parents and tokens; every block is
    announced in the host pool (CPU, LOCAL), on disk (STORAGE, LOCAL) and in a Redis pool (STORAGE,
    REMOTE); the host pool's evictions are announced as removals of exactly the blocks that left
    it, and the pool's own expiries (``remote_ttl_s``: 1 s) as removals of the first prompt's,
    which no load asked for."""
    port = free_port()
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)
    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        extra = {"host_bytes": 20 * 49152, "disk_dir": str(tmp_path / "disk"),  # 49152 bytes a block
                 "remote_url": server.url, "remote_ttl_s": 1}
        apps.run_app(workdir, f"events-{layout}", {
            "model": model, "connector": "kvtier", "extra": extra, "layout": layout, "warmup": False,
            "engine": {**ENGINE, "kv_events_endpoint": f"tcp://*:{port}"},
            "phases": [{"prompts": [PROMPTS[0]], "max_tokens": 1, "idle_s": 3},  # its pool entries expire
                       {"prompts": [PROMPTS[1]], "max_tokens": 1, "idle_s": 1}]})
    time.sleep(1.0)
    events = subscriber.events()
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    device = [e for e in stored if e.medium not in ("CPU", "STORAGE")]
    by_hash = {h: (e, i) for e in device for i, h in enumerate(e.block_hashes)}
    assert len(by_hash) >= 24  # vLLM's own announcement of both prompts' full blocks

    def tier(events, medium, ownership):
        return [e for e in events if e.medium == medium and e.ownership == ownership]

    host, disk = tier(stored, "CPU", "kvtier:host"), tier(stored, "STORAGE", "kvtier:disk")
    for announced in (host, disk):
        hashes = [e.block_hashes[0] for e in announced]
        assert len(hashes) == 24 and set(hashes) <= set(by_hash)
        for event in announced:  # the same block as vLLM's: its parent, its tokens, its size
            own, i = by_hash[event.block_hashes[0]]
            parent = own.block_hashes[i - 1] if i else own.parent_block_hash
            assert event.parent_block_hash == parent and event.block_size == BLOCK
            assert event.token_ids == own.token_ids[i * BLOCK:(i + 1) * BLOCK]
    assert {e.locality for e in host + disk} == {"LOCAL"}
    evicted = [h for e in tier(removed, "CPU", "kvtier:host") for h in e.block_hashes]
    first = {e.block_hashes[0] for e in host[:12]}
    assert len(evicted) == 24 - 20 and set(evicted) <= first  # the oldest left the 20 slots
    assert not tier(removed, "STORAGE", "kvtier:disk")  # the disk holds them all
    pool = f"kvtier:redis:127.0.0.1:{server.port}/0"
    pooled = tier(stored, "STORAGE", pool)
    assert sorted(e.block_hashes[0] for e in pooled) == sorted(e.block_hashes[0] for e in disk)
    assert {e.locality for e in pooled} == {"REMOTE"}
    expired = [h for e in tier(removed, "STORAGE", pool) for h in e.block_hashes]
    assert sorted(expired) == sorted(e.block_hashes[0] for e in pooled[:12])  # the first prompt's, told unasked


@pytest.mark.parametrize("layout", ["in_process", "multiprocess"])
def test_what_mooncake_drops_in_silence_is_announced_as_removed(workdir, model, layout, tmp_path):
    """Mooncake publishes no evictions. The first prompt's entries are removed from the pool behind
    the engine's back (as an eviction would) between two requests; the audit (``remote_audit_s``)
    finds them gone while the second runs, and they are announced as removed from the pool: exactly
    the first prompt's blocks, with no load asking for them."""
    from kvtier.tiers.mooncake import MooncakeClient

    port = free_port()
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)
    out, go = workdir / f"silent-{layout}.out.json", tmp_path / "removed"
    with local_mooncake(log_path=str(tmp_path / "mooncake.log")) as server:
        extra = {"host_bytes": "64MiB", "disk_dir": None, "remote_url": server.url, "remote_audit_s": 0.05}
        run = threading.Thread(target=apps.run_app, args=(workdir, f"silent-{layout}", {
            "model": model, "connector": "kvtier", "extra": extra, "layout": layout, "warmup": False,
            "engine": {**ENGINE, "kv_events_endpoint": f"tcp://*:{port}"},
            "phases": [{"prompts": [PROMPTS[0]], "max_tokens": 1},
                       # Steps for a second or more: audits every 0.05 s meanwhile (an answer the first
                       # phase left in flight, from before the removal, is taken in its first step).
                       {"prompts": [PROMPTS[1]], "max_tokens": 400, "wait_for": str(go), "idle_s": 1}]}))
        run.start()
        apps.wait_for_file(f"{out}.phase0.done")
        raw, removed, deadline = MooncakeClient(server.url, 10.0), 0, time.monotonic() + 60
        while removed < 12:  # the first prompt's entries, removed as they land (on an idle engine too)
            assert time.monotonic() < deadline, f"{removed} of the first prompt's 12 entries reached the pool"
            removed += max(0, raw._store.remove_by_regex("^kvtier/", True))
            time.sleep(0.05)
        raw.close()
        go.touch()
        run.join()
    time.sleep(1.0)
    events = subscriber.events()
    pooled = [e for e in events if type(e).__name__ == "BlockStored" and (e.ownership or "").startswith("kvtier:mooncake")]
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE"
               for h in e.block_hashes]
    assert len(pooled) > 12 + 12 and {e.locality for e in pooled} == {"REMOTE"}  # the second's, with its answer
    assert sorted(removed) == sorted(e.block_hashes[0] for e in pooled[:12])  # the first prompt's, once each


def test_a_restart_announces_what_the_disk_tier_already_holds(workdir, model, tmp_path):
    """A first run stores a prompt on disk; a second process on the same disk_dir announces
    those blocks (STORAGE, kvtier:disk, vLLM's hashes) with its first steps, before any
    request asks for them."""
    extra = {"host_bytes": "64MiB", "disk_dir": str(tmp_path / "disk")}
    spec = {"model": model, "connector": "kvtier", "extra": extra, "warmup": False, "layout": "in_process"}
    port = free_port()
    first_run = Subscriber(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)
    apps.run_app(workdir, "announce-a", {**spec, "engine": {**ENGINE, "kv_events_endpoint": f"tcp://*:{port}"},
                                         "phases": [{"prompts": [PROMPTS[0]], "max_tokens": 1, "idle_s": 1}]})
    time.sleep(1.0)
    stored_first = {e.block_hashes[0] for e in first_run.events()
                    if type(e).__name__ == "BlockStored" and e.ownership == "kvtier:disk"}
    port = free_port()
    second_run = Subscriber(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)
    apps.run_app(workdir, "announce-b", {**spec, "engine": {**ENGINE, "kv_events_endpoint": f"tcp://*:{port}"},
                                         "phases": [{"prompts": [[7, 8, 9]], "max_tokens": 1, "idle_s": 1}]})
    time.sleep(1.0)
    announced = [e for e in second_run.events() if type(e).__name__ == "BlockStored" and e.ownership == "kvtier:disk"]
    assert len(stored_first) == 12 and {e.block_hashes[0] for e in announced} == stored_first
    assert all(e.medium == "STORAGE" and e.locality == "LOCAL" and len(e.token_ids) == BLOCK for e in announced)


def test_a_node_server_announces_its_blocks_once_for_all_its_engines(workdir, model, tmp_path):
    """Engines A (vLLM's one-process layout) and B (the default layout) serve one prompt through a
    node server: the node publishes each full block once (CPU, REMOTE, owned by the node, under vLLM's
    hashes and tokens), and neither engine publishes any of the node's blocks itself."""
    ports = {name: free_port() for name in ("a", "b", "node")}
    subscribers = {name: Subscriber(f"tcp://127.0.0.1:{port}", b"" if name == "node" else b"kv")
                   for name, port in ports.items()}
    time.sleep(0.5)
    with local_node(str(tmp_path), events_endpoint=f"tcp://127.0.0.1:{ports['node']}") as node:
        for name, layout in (("a", "in_process"), ("b", "multiprocess")):
            apps.run_app(workdir, f"node-events-{name}", {
                "model": model, "connector": "kvtier", "layout": layout, "warmup": False,
                "extra": {"node_socket": node.socket_path, "host_bytes": "16MiB"},
                "engine": {**ENGINE, "kv_events_endpoint": f"tcp://*:{ports[name]}"},
                "phases": [{"prompts": [PROMPTS[0]], "max_tokens": 1, "idle_s": 1}]})
        time.sleep(1.0)
    events = {name: subscriber.events() for name, subscriber in subscribers.items()}
    device = {h: (e, i) for e in events["a"] if type(e).__name__ == "BlockStored" and e.medium not in ("CPU", "STORAGE")
              for i, h in enumerate(e.block_hashes)}
    announced = [e for e in events["node"] if type(e).__name__ == "BlockStored"]
    assert len(announced) == 12 and {e.block_hashes[0] for e in announced} <= set(device)  # each once
    for event in announced:
        own, i = device[event.block_hashes[0]]
        assert event.token_ids == own.token_ids[i * BLOCK:(i + 1) * BLOCK] and event.block_size == BLOCK
        assert (event.medium, event.locality) == ("CPU", "REMOTE") and event.ownership.startswith("kvtier:node:")
    for name in ("a", "b"):
        assert not [e for e in events[name] if (getattr(e, "ownership", None) or "").startswith("kvtier:node")]
        assert [e for e in events[name] if getattr(e, "ownership", None) == "kvtier:host"]  # its own are told
