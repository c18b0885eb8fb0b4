"""Start a local Mooncake master or Redis server on loopback (tests, demos, the documented commands).

``kvtier serve mooncake`` and ``kvtier serve redis`` run one in the foreground;
``local_mooncake()`` / ``local_redis()`` / ``local_redis_cluster()`` are context managers that
start one on free ports and stop it on exit, yielding the ``remote_url`` to give kvtier.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def _binary(name: str) -> str:
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found (make setup installs it)")
    return found


def mooncake_command(rpc_port: int) -> list[str]:
    """The master, its RPC and metrics ports on loopback; metadata is served apart (below),
    since the master's own metadata server listens on every interface whatever it is told."""
    return [_binary("mooncake_master"), f"--rpc_port={rpc_port}", "--rpc_address=127.0.0.1",
            f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1"]


def mooncake_metadata_command(metadata_port: int) -> list[str]:
    return [_binary("mooncake_http_metadata_server"), "--host", "127.0.0.1", "--port", str(metadata_port),
            "--log-level", "WARNING"]


def redis_command(port: int, password: str | None = None, maxmemory: str = "1gb",
                  policy: str = "allkeys-lru") -> list[str]:
    """A cache, not a database: bounded memory, least recently used entries evicted (and said so), nothing saved."""
    command = [_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--maxmemory", maxmemory, "--maxmemory-policy", policy,
               "--notify-keyspace-events", "Eex"]  # evictions and expiries published: kvtier tells routers
    return command + (["--requirepass", password] if password else [])


def mooncake_storage_command(rpc_port: int, metadata_port: int, port: int, size: str) -> list[str]:
    """A storage node: a Mooncake client that only lends memory to the pool."""
    return [_binary("mooncake_client"), "--host=127.0.0.1", f"--port={port}", f"--global_segment_size={size}",
            f"--master_server_address=127.0.0.1:{rpc_port}",
            f"--metadata_server=http://127.0.0.1:{metadata_port}/metadata", "--protocol=tcp"]


def mooncake_url(rpc_port: int, metadata_port: int, segment: str = "0") -> str:
    """``segment``: memory an instance lends to the pool itself (0: the storage nodes hold everything)."""
    return f"mooncake://127.0.0.1:{rpc_port}?metadata=http://127.0.0.1:{metadata_port}/metadata&segment={segment}"


class LocalServer:
    """A server process of ours; ``stop()`` and ``start()`` again keep its ports."""

    def __init__(self, commands: list[tuple[list[str], int]], url: str, name: str, log_path: str | None = None):
        self.commands, self.url, self.name = commands, url, name  # (command, port it listens on), in start order
        self.port = commands[0][1]
        self.log_path = log_path or os.devnull
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "LocalServer":
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}  # loopback only
        try:
            for command, port in self.commands:
                log = open(self.log_path, "a")
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=env)
                log.close()
                self.procs.append(proc)
                _wait_for_port(port, proc, os.path.basename(command[0]))
        except BaseException:  # one that did not come up: those started before it are stopped, not left running
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs = []


@contextlib.contextmanager
def local_mooncake(log_path: str | None = None, storage: str = "1GB"):
    """A Mooncake HTTP metadata server, a master and one storage node."""
    rpc_port, metadata_port, storage_port = free_port(), free_port(), free_port()
    server = LocalServer([(mooncake_metadata_command(metadata_port), metadata_port),
                          (mooncake_command(rpc_port), rpc_port),
                          (mooncake_storage_command(rpc_port, metadata_port, storage_port, storage), storage_port)],
                         mooncake_url(rpc_port, metadata_port), "mooncake", log_path)
    server.port = rpc_port
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def local_redis(log_path: str | None = None, password: str | None = None, maxmemory: str = "1gb",
                policy: str = "allkeys-lru"):
    port = free_port()
    auth = f":{password}@" if password else ""
    server = LocalServer([(redis_command(port, password, maxmemory, policy), port)],
                         f"redis://{auth}127.0.0.1:{port}/0", "redis", log_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


REDIS_CLUSTER_SLOTS = 16384


@contextlib.contextmanager
def local_redis_cluster(folder: str, log_path: str | None = None, masters: int = 3, maxmemory: str = "1gb"):
    """A Redis Cluster of ``masters`` nodes (no replicas) on loopback, its state in ``folder``: each node
    is given an equal share of the hash slots, the nodes meet, and it is yielded once every node says
    the cluster is ok. Its ``url`` is ``redis+cluster://`` of the first node (the client finds the rest)."""
    import redis

    ports = [free_port() for _ in range(masters)]
    buses = [free_port() for _ in range(masters)]  # not the default, port + 10000: past 65535 for a high free port
    commands = [(redis_command(port, maxmemory=maxmemory) + [
        "--cluster-enabled", "yes", "--cluster-config-file", os.path.join(folder, f"redis-cluster-{port}.conf"),
        "--cluster-port", str(bus), "--cluster-node-timeout", "5000"], port)  # a node stopped is failed in 5 s
        for port, bus in zip(ports, buses)]
    server = LocalServer(commands, f"redis+cluster://127.0.0.1:{ports[0]}", "redis-cluster", log_path)
    server.ports = ports
    server.start()
    nodes = [redis.Redis(host="127.0.0.1", port=port, socket_timeout=10) for port in ports]
    try:
        for i, node in enumerate(nodes):
            first, last = REDIS_CLUSTER_SLOTS * i // masters, REDIS_CLUSTER_SLOTS * (i + 1) // masters
            node.execute_command("CLUSTER ADDSLOTS", *range(first, last))
        for port, bus in zip(ports[1:], buses[1:]):
            nodes[0].execute_command("CLUSTER MEET", "127.0.0.1", port, bus)
        deadline = time.monotonic() + 30
        while not all(node.execute_command("CLUSTER INFO").get("cluster_state") == "ok" for node in nodes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Redis Cluster on ports {ports} did not come up within 30 s")
            time.sleep(0.1)
        for node in nodes:
            node.close()
        yield server
    finally:
        for node in nodes:  # closed already, or the cluster did not come up
            node.close()
        server.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve(kind: str, memory: str = "1GB") -> None:
    """Run a local pool in the foreground until interrupted; prints its remote_url.

    SIGTERM stops it like Ctrl-C: its servers run in sessions of their own, so only
    this process can stop them, on the way out of ``with``."""
    signal.signal(signal.SIGTERM, _interrupt)
    # Set even where SIGINT came in ignored (a job started in the background by a shell without job
    # control), in which case Python raises no KeyboardInterrupt: a SIGINT sent to it must stop it.
    signal.signal(signal.SIGINT, _interrupt)
    context = local_mooncake(storage=memory) if kind == "mooncake" else local_redis(maxmemory=memory.lower())
    with context as server:
        print(f"remote_url: {server.url}", flush=True)
        try:
            while all(proc.poll() is None for proc in server.procs):
                time.sleep(1)
        except KeyboardInterrupt:
            pass


class LocalNode:
    """A ``kvtier serve node`` process of ours; ``stop()`` (SIGKILL) and ``start()`` again keep its socket,
    its disk and its metrics port."""

    def __init__(self, socket_path: str, host_bytes: str = "64MiB", disk_dir: str | None = None,
                 page_bytes: str = "64KiB", log_path: str | None = None, disk_bytes: str = "1GiB",
                 events_endpoint: str | None = None, events_replay: str | None = None):
        self.socket_path, self.log_path = socket_path, log_path or os.devnull
        self.metrics_port = free_port()
        self.command = [sys.executable, "-m", "kvtier.cli", "serve", "node", "--socket", socket_path,
                        "--host-bytes", host_bytes, "--page-bytes", page_bytes, "--disk-bytes", disk_bytes,
                        "--metrics-port", str(self.metrics_port)] + (["--disk-dir", disk_dir] if disk_dir else []) + \
            (["--kv-events-endpoint", events_endpoint] if events_endpoint else []) + \
            (["--kv-events-replay-endpoint", events_replay] if events_replay else [])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"node://{self.socket_path}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 30.0) -> "LocalNode":
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve node exited with code {self.proc.returncode}")
            with socket.socket() as probe:
                if os.path.exists(self.socket_path) and probe.connect_ex(("127.0.0.1", self.metrics_port)) == 0:
                    return self
            time.sleep(0.05)
        raise TimeoutError(f"kvtier serve node did not listen on {self.socket_path} within {timeout} s")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            self.proc.wait()
            self.proc = None


@contextlib.contextmanager
def local_node(folder: str, host_bytes: str = "64MiB", disk: bool = True, **options):
    """A node server with its socket (and its disk) in ``folder``."""
    node = LocalNode(os.path.join(folder, "node.sock"), host_bytes,
                     os.path.join(folder, "node-disk") if disk else None, **options)
    node.start()
    try:
        yield node
    finally:
        node.stop()
