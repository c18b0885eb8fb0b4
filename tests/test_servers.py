"""``kvtier serve``: the local pool stops with its command, however it is stopped."""

import re
import signal
import socket
import subprocess
import sys
import time

import pytest


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("pool", ["redis", "mooncake"])
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_kvtier_serve_stopped_by_a_signal_leaves_no_server_running(pool, stop):
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", pool], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # remote_url: redis://127.0.0.1:PORT/0 or mooncake://127.0.0.1:PORT?...
        port = int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))
        assert _listening(port), line
        proc.send_signal(stop)
        assert proc.wait(timeout=30) is not None
        deadline = time.monotonic() + 10
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(port), f"the {pool} server outlived `kvtier serve` stopped by {stop.name}"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("kind", ["mooncake", "redis"])
def test_the_local_pools_servers_listen_on_loopback_only(kind, tmp_path):
    """The master, its metadata and metrics servers, and redis-server: every listening socket
    of theirs is on 127.0.0.1. (Mooncake's transfer engine, inside the storage node and each
    client, opens listeners on every interface that no setting moves: docs/operations.md says so.)"""
    from kvtier.cli.servers import local_mooncake, local_redis

    context = local_mooncake if kind == "mooncake" else local_redis
    with context(log_path=str(tmp_path / "pool.log")) as server:
        pids = {proc.pid for proc in server.procs[:2 if kind == "mooncake" else 1]}  # not the storage node
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    theirs = [line.split()[3] for line in listening.splitlines() if any(f"pid={pid}," in line for pid in pids)]
    assert len(theirs) >= (3 if kind == "mooncake" else 1)  # metadata, RPC, metrics
    assert all(address.startswith("127.0.0.1:") for address in theirs), theirs


def test_a_server_that_does_not_come_up_stops_those_started_before_it(tmp_path):
    """A pool of several processes (Mooncake's, a Redis Cluster's) whose second one exits at once:
    the first is stopped, not left listening."""
    from kvtier.cli.servers import LocalServer, free_port, redis_command

    port = free_port()
    server = LocalServer([(redis_command(port), port), ([sys.executable, "-c", "raise SystemExit(3)"], free_port())],
                         f"redis://127.0.0.1:{port}/0", "two", str(tmp_path / "log"))
    with pytest.raises(RuntimeError, match="exited with code 3"):
        server.start()
    assert server.procs == [] and not _listening(port)
