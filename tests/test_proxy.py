"""``kvtier proxy`` as a process of its own, against backends that fail for real: an address
nothing listens on, servers that accept connections and never answer, and servers whose event
streams end short of ``[DONE]`` or are cut mid-chunk."""

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvtier.cli.servers import free_port
from tests.e2e.servers import kvtier_proxy as proxy
from tests.e2e.servers import stream_completion

EVENT = b'data: {"choices": [{"text": "w1 "}]}\n\n'


class BlackHole:
    """Accepts every connection and never answers (a hung instance); counts connections."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.accepted.append(self.listener.accept()[0])
            except OSError:
                return

    def close(self):
        self.listener.close()
        for conn in self.accepted:
            conn.close()


class ScriptedStream:
    """An instance whose answer to every request is a chunked event stream: ``chunks``, then
    the last chunk (``ending="whole"``), or a chunk cut short and the connection closed
    (``ending="cut"``)."""

    def __init__(self, chunks: list[bytes], ending: str):
        self.chunks, self.ending = chunks, ending
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn = self.listener.accept()[0]
            except OSError:
                return
            with conn, contextlib.suppress(OSError):  # the proxy may close it first
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, body = request.split(b"\r\n\r\n", 1)
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
                for chunk in self.chunks:
                    conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    time.sleep(0.05)
                conn.sendall(b"0\r\n\r\n" if self.ending == "whole" else b"100\r\ndata: {\"choi")

    def close(self):
        self.listener.close()


def post(url: str, body: bytes, timeout: float = 30) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_body_that_is_not_json_is_a_400_and_a_dead_decode_a_502(tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with proxy(nowhere, nowhere, tmp_path / "proxy.log") as url:
        status, answer = post(url + "/v1/completions", b"{not json")
        assert status == 400 and answer["error"]["type"] == "invalid_request_error"
        status, answer = post(url + "/v1/completions", b"[1, 2]")
        assert status == 400 and "JSON object" in answer["error"]["message"]
        status, answer = post(url + "/v1/completions", json.dumps({"model": "m", "prompt": "hi"}).encode())
        assert status == 502 and answer["error"]["type"] == "upstream_error"  # prefill and decode both down
    log = (tmp_path / "proxy.log").read_text()
    assert "decode computes the prompt itself" in log  # prefill's failure did not end the request


def test_hung_instances_never_queue_the_requests_behind_them(tmp_path):
    """150 requests at once to instances that never answer: every one of them reaches an
    instance at once (a fixed pool of 100 connections made the 101st wait), and a large body
    (2 MiB) is forwarded, not refused with 413."""
    hole = BlackHole()
    with proxy(hole.url, hole.url, tmp_path / "proxy.log") as url:
        body = json.dumps({"model": "m", "prompt": "w3 " * 700_000}).encode()  # about 2 MiB
        senders = []
        for i in range(150):
            request = urllib.request.Request(url + "/v1/completions", data=body if i == 0 else b'{"prompt": "x"}',
                                             headers={"Content-Type": "application/json"})
            sender = threading.Thread(target=lambda r=request: _ignore(urllib.request.urlopen, r, timeout=60),
                                      daemon=True)
            sender.start()
            senders.append(sender)
        deadline = time.monotonic() + 20
        while len(hole.accepted) < 150:
            assert time.monotonic() < deadline, f"only {len(hole.accepted)} of 150 requests reached an instance"
            time.sleep(0.1)
        hole.close()  # the instances go away: the proxy's requests end, and so does the proxy


def _ignore(function, *args, **kwargs):
    try:
        function(*args, **kwargs)
    except OSError:
        pass


def test_a_stream_is_relayed_whole_only_when_it_ends_with_done(tmp_path):
    """Decode's stream relayed: whole, with ``[DONE]`` split over two chunks, it reaches the client
    as it is; ended cleanly but without ``[DONE]``, or cut in the middle of a chunk, the client gets
    the text so far, an error event and no ``[DONE]``, never a silent truncation."""
    nowhere = f"http://127.0.0.1:{free_port()}"  # no prefill: decode computes the prompt itself
    request = {"model": "m", "prompt": "hi", "stream": True}
    answers = {}
    for name, chunks, ending in (("whole", [EVENT, EVENT + b"data: [DO", b"NE]\n\n"], "whole"),
                                 ("no_done", [EVENT, EVENT], "whole"),
                                 ("cut", [EVENT, EVENT], "cut")):
        decode = ScriptedStream(chunks, ending)
        try:
            with proxy(nowhere, decode.url, tmp_path / f"proxy-{name}.log") as url:
                answers[name] = stream_completion(url, request, timeout=30)
        finally:
            decode.close()
    assert answers["whole"] == {"text": "w1 w1 ", "done": True, "errors": []}
    for name in ("no_done", "cut"):
        assert answers[name]["text"] == "w1 w1 " and not answers[name]["done"], answers[name]
        assert [error["type"] for error in answers[name]["errors"]] == ["upstream_error"], answers[name]


def test_a_client_that_leaves_mid_stream_is_no_decode_failure(tmp_path):
    """The client closes its connection after the first event: the proxy drops decode's stream
    without calling it a decode failure, and serves the next request whole."""
    decode = ScriptedStream([EVENT] * 40 + [b"data: [DONE]\n\n"], "whole")
    nowhere = f"http://127.0.0.1:{free_port()}"
    try:
        with proxy(nowhere, decode.url, tmp_path / "proxy.log") as url:
            request = urllib.request.Request(url + "/v1/completions", data=b'{"stream": true}',
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert reply.read1(65536).startswith(b"data: ")
            time.sleep(1)  # the proxy writes the next events into a closed connection
            after = stream_completion(url, {"stream": True}, timeout=30)
    finally:
        decode.close()
    assert after == {"text": "w1 " * 40, "done": True, "errors": []}
    log = (tmp_path / "proxy.log").read_text()
    assert f"decode {decode.url} failed" not in log and "Traceback" not in log, log


def test_the_stream_reader_of_the_tests_raises_on_a_connection_cut_short():
    """``stream_completion`` (what the end-to-end tests read streams with) tells a cut connection
    from a whole stream: iterating over the lines of ``urlopen`` ends silently on both."""
    cut = ScriptedStream([EVENT], "cut")
    try:
        with pytest.raises(http.client.IncompleteRead):
            stream_completion(cut.url, {"stream": True}, timeout=30)
    finally:
        cut.close()
