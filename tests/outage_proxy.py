"""A TCP proxy in front of a real server, to make the server unreachable for a while and then reachable again.

A moto S3 server that is stopped and started again loses its buckets and objects, so an outage is made on the
connection instead: while it is :meth:`OutageProxy.cut`, the proxy resets every new connection and every open one
(a refused or dropped connection, as a client sees a failing network or endpoint); :meth:`OutageProxy.restore`
forwards again. Threads only; nothing of the server or the client is touched.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class OutageProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; :meth:`cut` and :meth:`restore` switch the outage."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._up = threading.Event()
        self._up.set()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        #: connections reset because of an outage (new or open ones): shows the outage was met
        self.resets = 0
        threading.Thread(target=self._accept, name="outage-proxy", daemon=True).start()

    @classmethod
    def in_front_of(cls, endpoint: str) -> OutageProxy:
        """A proxy for the HTTP endpoint ``http://host:port``."""
        host, port = endpoint.removeprefix("http://").split(":")
        return cls(host, int(port))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        """From now on, reset every connection, open or new."""
        self._up.clear()
        with self._lock:
            doomed, self._open = list(self._open), set()
        for sock in doomed:
            self._reset(sock)

    def restore(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _reset(self, sock: socket.socket) -> None:
        self.resets += 1
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
        # a close alone does not end a connection a pump thread is blocked reading (Linux defers it until that read
        # returns): the peer would hear nothing, and a held request would wait out its client's timeout, a network
        # silently dropping packets rather than the failing one this proxy stands for. Shutting the reading side
        # wakes that read (sending nothing), and the close then resets the connection.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)
        with contextlib.suppress(OSError):
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                self._reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                self._reset(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(1 << 16):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with self._lock:
                    self._open.discard(sock)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
