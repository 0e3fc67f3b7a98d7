"""The outage the store's and the gateway's fault tests stage (``tests/outage_proxy.py``) is the one they claim: a cut
resets a connection that is waiting for its answer at once, refuses new ones, and a restore forwards again.

A held connection used to hear nothing at a cut (a close from another thread does not end a socket a thread is blocked
reading, on Linux): a long poll then waited out its client's timeout, a minute of the remote scenario spent on a
silently dropping network instead of the failing one it names.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from outage_proxy import OutageProxy


@pytest.fixture
def held_server():
    """A server that answers each connection's first bytes after ``hold`` seconds (a long poll)."""
    server = socket.create_server(("127.0.0.1", 0))
    hold = threading.Event()

    def serve() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    def answer(connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):  # (the proxy's side of a cut connection is gone)
            if connection.recv(64):
                hold.wait(30)
                connection.sendall(b"answer")

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1], hold
    hold.set()
    server.close()


def test_a_cut_resets_a_held_connection_at_once_refuses_new_ones_and_a_restore_forwards(held_server):
    port, hold = held_server
    proxy = OutageProxy("127.0.0.1", port)
    with contextlib.ExitStack() as sockets:

        def connect() -> socket.socket:
            client = sockets.enter_context(socket.create_connection(("127.0.0.1", proxy.port), timeout=10))
            client.sendall(b"poll")
            return client

        sockets.callback(proxy.close)
        held = connect()
        time.sleep(0.2)  # forwarded: the server holds it
        cut_at = time.monotonic()
        proxy.cut()
        with pytest.raises(ConnectionResetError):
            held.recv(64)
        assert time.monotonic() - cut_at < 2.0
        with pytest.raises(ConnectionResetError):
            connect().recv(64)  # a new connection during the outage
        proxy.restore()
        hold.set()
        assert connect().recv(64) == b"answer"
        assert proxy.resets >= 2
