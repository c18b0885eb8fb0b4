"""A TCP relay on loopback between a client and a real server, for faults a store can have:
answers held back (a slow store), or passed on a byte at a time (a trickling one), once
the client sends a given command."""

from __future__ import annotations

import socket
import threading
import time


class Relay:
    """Forwards 127.0.0.1:<port> to ``upstream``. Once the client has sent bytes containing
    ``arm_on``, every later answer is held ``delay_s`` before it is passed on, then sent one byte
    per ``trickle_s`` (0: at once), and ``armed`` is set. ``client_gone`` is set once a client
    has closed its connection (a cut call)."""

    def __init__(self, upstream: tuple[str, int], arm_on: bytes | None = None, delay_s: float = 0.0,
                 trickle_s: float = 0.0):
        self.upstream, self.arm_on, self.delay_s, self.trickle_s = upstream, arm_on, delay_s, trickle_s
        self.armed = threading.Event()
        self.client_gone = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:  # the server is gone: so is this client's connection
                client.close()
                continue
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if from_client and self.arm_on is not None and self.arm_on in data:
                    self.armed.set()
                if not from_client and self.armed.is_set():
                    time.sleep(self.delay_s)
                    if self.trickle_s:
                        for i in range(len(data)):
                            sink.sendall(data[i:i + 1])
                            time.sleep(self.trickle_s)
                        continue
                sink.sendall(data)
        except OSError:
            pass
        finally:
            if from_client:
                self.client_gone.set()
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._sockets:
            s.close()
