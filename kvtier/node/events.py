"""KV events once per node: the node server publishes what its pool holds, for every engine at once.

An engine that publishes KV events does not announce the blocks it keeps in the node: it sends the
server, for each entry it stored there, its own encoded event that the block is stored and the one
that it is removed (``protocol.Announce``; an engine encodes them with its engine's classes, so the
server needs none). The server publishes an entry's stored event the first time an engine announces
it while the node holds it, and its removed event when the node no longer holds it (evicted from
memory and not on its disk, or deleted from its disk and not in memory). Eight engines storing one
system prompt are one copy to a router, owned by the node.

Events go out as vLLM's publisher sends them (a ZMQ PUB socket; frames: topic, an 8-byte big-endian
sequence number, a msgpack batch ``[timestamp, [event, ...]]``), so a router that reads engines'
events reads the node's. The socket is used by one thread only, fed through a bounded queue: the
server's threads never wait for it (a batch that finds the queue full is dropped, and counted).
With a replay endpoint (a ZMQ ROUTER socket, vLLM's replay protocol), that thread keeps the last
batches it published: a router that connects late, or lost some, asks for those from a sequence
number on, and gets them, then an end marker (sequence -1, empty topic and payload).

With a node disk, what the server announced is journaled beside its entries (``events.journal``,
msgpack records: ``kvtier.scheduler.announcements.DiskJournal``): a server that restarts announces
again the entries its disk still holds, as soon as it has read the journal.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec

from kvtier.scheduler.announcements import DiskJournal

logger = logging.getLogger("kvtier.node")

QUEUE_BATCHES = 4096  # batches waiting for the socket; past them a batch is dropped (a router misses it)
RESUBSCRIBE_S = 2.0  # how long a restarted server waits for its subscribers before it announces its disk
MAX_EVENT = 64 << 10  # one block's encoded event; a longer one is no event of an engine's
REPLAY_BATCHES = 10_000  # published batches kept for replay by default (vLLM's publisher keeps as many)
# How often the publishing thread, waiting for a batch, looks for a replay request: a router's replay
# waits at most this long, and an idle server wakes no more often than this.
REPLAY_POLL_S = 0.05
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame set, as vLLM's publisher ends one


class NodeEvents:
    """Which entries were announced (name -> the removed event to publish when it goes); the
    caller holds the server's ``lock`` around ``announce`` and ``gone``, so that an entry's removal is
    never published before its storage. ``held(name)``: whether the node holds an entry (under
    ``lock``); ``journal``: where to journal, with the names the node's disk held at start."""

    def __init__(self, endpoint: str, lock: threading.Lock, held, journal: tuple[str, list[str]] | None = None,
                 topic: str = "", replay_endpoint: str | None = None, buffer_batches: int | None = None):
        try:
            import zmq
        except ImportError:
            raise ValueError("--kv-events-endpoint needs pyzmq (pip install pyzmq)") from None
        self._removed: dict[str, bytes] = {}
        self._lock, self._held = lock, held
        self._queue: queue.Queue = queue.Queue(QUEUE_BATCHES)
        self._topic = topic.encode()
        self.counters = {"events_published": 0, "events_dropped": 0, "replays": 0, "replays_refused": 0}
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError as error:
            self._pub.close(linger=0)
            raise ValueError(f"--kv-events-endpoint {endpoint}: {error}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay, self.replay_endpoint = None, None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)  # drops what a gone or slow client cannot take
            try:
                self._replay.bind(replay_endpoint)
            except zmq.ZMQError as error:
                self._replay.close(linger=0)
                self._pub.close(linger=0)
                raise ValueError(f"--kv-events-replay-endpoint {replay_endpoint}: {error}") from None
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        # (seq, payload) of the last batches published, for replay
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches or REPLAY_BATCHES)
        threading.Thread(target=self._publish_all, daemon=True, name="kvtier-node-events").start()
        self._journal = None
        if journal is not None:
            path, names = journal
            self._journal = DiskJournal(path, {name.encode() for name in names}, meta_of=_record)
            threading.Thread(target=self._announce_journaled, daemon=True, name="kvtier-node-events-journal").start()

    def announce(self, told, journal: bool = True) -> None:
        """Engines' events of entries they stored, ``well_formed``; published once per entry the node holds."""
        batch = []
        for name, on_store, on_remove in told:
            if name in self._removed or not self._held(name):
                continue
            self._removed[name] = on_remove = bytes(on_remove)
            batch.append(on_store := bytes(on_store))
            if journal and self._journal is not None:
                self._journal.append(name.encode(), (on_store, on_remove))
        self._put(batch)

    def gone(self, names) -> None:
        """Entries the node no longer holds: their removal, for those announced."""
        events = []
        for name in names:
            if (event := self._removed.pop(name, None)) is not None:
                events.append(event)
                if self._journal is not None:
                    self._journal.drop(name.encode())
        self._put(events)

    def _announce_journaled(self) -> None:
        """What the disk held at start and a previous server had announced: announced again."""
        self._journal.loaded.wait()
        # Subscribers that were connected before a restart connect again on their own (ZMQ, every
        # 100 ms by default); what is published before they have is lost to them.
        time.sleep(RESUBSCRIBE_S)
        while found := self._journal.take_found():
            with self._lock:
                self.announce([(key.decode(), on_store, on_remove) for key, (on_store, on_remove) in found],
                              journal=False)

    @staticmethod
    def well_formed(names, stored, removed) -> list[tuple[str, bytes, bytes]]:
        """The (name, stored, removed) whose events are each one msgpack value of at most ``MAX_EVENT``
        bytes: a batch with any other would not decode for any subscriber."""
        told = []
        for name, on_store, on_remove in zip(names, stored, removed):
            try:
                if len(on_store) <= MAX_EVENT and len(on_remove) <= MAX_EVENT:
                    msgspec.msgpack.decode(on_store), msgspec.msgpack.decode(on_remove)
                    told.append((name, on_store, on_remove))
            except msgspec.DecodeError:
                pass
        return told

    def stats(self) -> dict:
        """Called under the server's lock, which guards what is announced."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "announced": len(self._removed),
                **self.counters}

    def _put(self, events: list[bytes]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.counters["events_dropped"] += len(events)

    def _publish_all(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        wait_s = REPLAY_POLL_S if self._replay is not None else None
        while True:
            if self._replay is not None:
                try:
                    if self._replay.poll(0):
                        self._serve_replay()
                except Exception as error:  # a replay's fault: that router's, never the events' or the server's
                    self.counters["replays_refused"] += 1
                    logger.warning("kvtier node server: a KV events replay failed (%s)", error)
            try:  # also what paces this loop: a replay socket that keeps failing never makes it spin
                events = self._queue.get(timeout=wait_s)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = encoder.encode([time.time(), [msgspec.Raw(event) for event in events]])
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception as error:  # the socket's fault ends the events, never the server
                logger.warning("kvtier node server: KV events stopped (%s)", error)
                return
            self._buffer.append((seq, payload))
            seq += 1
            self.counters["events_published"] += len(events)

    def _serve_replay(self) -> None:
        """One replay request (client id, empty, 8-byte start sequence): the kept batches from it on."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            self.counters["replays_refused"] += 1
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        self.counters["replays"] += 1

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:  # the publisher is behind: it is a daemon thread, and goes with the process
            pass
        if self._journal is not None:
            self._journal.close()


def _record(fields: list) -> tuple[bytes, bytes] | None:
    """A journal record's fields: (stored event, removed event); None for a record of another shape."""
    if len(fields) == 2 and all(isinstance(f, bytes) for f in fields):
        return fields[0], fields[1]
    return None
