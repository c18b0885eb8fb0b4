"""The channel over which workers, at their shutdown, run the scheduler side's last store plans
(``kvtier.integrations.vllm.shutdown_drain``): it never holds a worker or the engine past its bounds.
The lockstep drain itself runs in vLLM, one and two ranks, in ``test_tiers_e2e.py``."""

import os
import threading
import time

import pytest

from kvtier.integrations.vllm.shutdown_drain import DrainServer, drain_finished_requests


class NothingToStore:
    """A scheduler side with no finished request left to store (the drain's only question of it, until
    there is one)."""
    num_finishing = 0


class Rank:
    """What the drain asks of a worker side before the scheduler sends a step: its rank."""

    def __init__(self, rank: int):
        self.rank = rank


def test_the_servers_thread_ends_with_the_scheduler_side():
    server = DrainServer(NothingToStore(), threading.Lock(), num_ranks=2, budget_s=1.0)
    assert server._thread.is_alive()
    server.close()
    server._thread.join(2.0)
    assert not server._thread.is_alive()


def test_a_worker_whose_scheduler_side_is_gone_returns_at_once():
    server = DrainServer(NothingToStore(), threading.Lock(), num_ranks=1, budget_s=1.0)
    server.close()
    began = time.monotonic()
    drain_finished_requests(Rank(0), server.address, time.monotonic() + 10)
    assert time.monotonic() - began < 1.0


def test_a_rank_whose_peers_never_come_runs_nothing_and_is_let_go(caplog):
    """Each plan must run on every rank: one rank of two alone gets none, once the others are late."""
    server = DrainServer(NothingToStore(), threading.Lock(), num_ranks=2, budget_s=10.0, accept_s=0.3)
    began = time.monotonic()
    drain_finished_requests(Rank(0), server.address, time.monotonic() + 10)
    assert 0.3 <= time.monotonic() - began < 3.0
    assert server.num_steps == 0
    assert "1 of 2 workers asked for the last stores" in caplog.text
    server.close()


def test_every_rank_that_came_is_let_go_when_nothing_is_left_to_store():
    server = DrainServer(NothingToStore(), threading.Lock(), num_ranks=2, budget_s=10.0)
    ranks = [threading.Thread(target=drain_finished_requests, args=(Rank(r), server.address, time.monotonic() + 10))
             for r in range(2)]
    began = time.monotonic()
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(5.0)
    assert not any(rank.is_alive() for rank in ranks)
    assert time.monotonic() - began < 2.0 and server.num_steps == 0
    server.close()


def test_a_worker_never_waits_past_its_deadline_on_a_scheduler_side_that_does_not_answer():
    """The scheduler side's thread is held (its lock taken by a stuck engine thread, say): the worker
    goes on to flush what is queued once its deadline passes."""
    held = threading.Lock()
    held.acquire()

    class Finishing:
        """A finished request is left, but no tier that outlives the process: once the lock is free,
        the server lets the worker go without a plan."""
        num_finishing = 1

        class manager:
            tiers = []

    server = DrainServer(Finishing(), held, num_ranks=1, budget_s=10.0)
    began = time.monotonic()
    drain_finished_requests(Rank(0), server.address, time.monotonic() + 0.5)
    assert 0.5 <= time.monotonic() - began < 5.0  # the held lock would keep it forever: 5 s leaves room for a busy CI
    held.release()
    server._thread.join(2.0)
    assert not server._thread.is_alive() and server.num_steps == 0
    server.close()


def test_a_connection_that_is_no_worker_is_refused_and_the_workers_are_still_served():
    import socket

    server = DrainServer(NothingToStore(), threading.Lock(), num_ranks=1, budget_s=2.0)
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(server.address)
    stranger.sendall(b"\x04\x00\x00\x00junk")  # a frame that is no Hello
    began = time.monotonic()
    drain_finished_requests(Rank(0), server.address, time.monotonic() + 10)
    assert time.monotonic() - began < 2.0  # let go at once: nothing to store
    server._thread.join(2.0)
    assert not server._thread.is_alive() and server.num_steps == 0
    stranger.close()
    server.close()


@pytest.mark.skipif(os.getuid() != 0, reason="dropping to another user needs root (CI runs as root)")
def test_a_process_of_another_user_is_refused_and_the_workers_are_still_served():
    import socket

    server = DrainServer(NothingToStore(), threading.Lock(), num_ranks=1, budget_s=2.0)
    stranger = os.fork()
    if stranger == 0:  # the child: another user, who knows the name and sends a proper hello
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5.0)
            sock.connect(server.address)
            try:  # the server may close on it before the hello is even sent, or with it unread
                sock.sendall(_hello_frame())
                answer = sock.recv(1)
            except (BrokenPipeError, ConnectionResetError):
                answer = b""
            os._exit(0 if answer == b"" else 3)  # closed on it, never served
        except BaseException as error:
            os.write(2, f"stranger: {error!r}\n".encode())
            os._exit(4)
    _, status = os.waitpid(stranger, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    began = time.monotonic()
    drain_finished_requests(Rank(0), server.address, time.monotonic() + 10)
    assert time.monotonic() - began < 2.0
    server._thread.join(2.0)
    assert not server._thread.is_alive() and server.num_steps == 0
    server.close()


def _hello_frame() -> bytes:
    from kvtier.integrations.vllm.shutdown_drain import Hello, _encoder
    body = _encoder.encode(Hello(0))
    return len(body).to_bytes(4, "little") + body
