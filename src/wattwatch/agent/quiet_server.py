"""Socket servers that sleep while nobody calls: the agent's local API and its /metrics.

``socketserver``'s loop wakes every poll interval (0.5 s by default) only to check whether it should
stop; an agent with two servers woke four times a second for nothing, a tenth of a millisecond of CPU
each second of an idle host. Here the loop waits up to ``IDLE_POLL_S`` for a connection, and stopping
wakes it at once by connecting to it (``stop``).
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from typing import Any

IDLE_POLL_S = 60.0  # the loop's wait for a connection; stop() does not wait for it
_POKE_EVERY_S = 0.05


def serve(server: socketserver.BaseServer, name: str) -> threading.Thread:
    """Serve ``server`` from a daemon thread named ``name``; returns the thread."""
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": IDLE_POLL_S}, name=name, daemon=True
    )
    thread.start()
    return thread


def stop(server: socketserver.BaseServer, thread: threading.Thread | None, timeout_s: float = 5.0) -> None:
    """Stop serving and close the listening socket: the loop is asked to end and woken by a connection
    (again, every ``_POKE_EVERY_S``, until it has ended: the first may come before it was asked)."""
    stopper = threading.Thread(target=server.shutdown, name="wattwatch-server-stop", daemon=True)
    stopper.start()
    deadline = time.monotonic() + timeout_s
    while stopper.is_alive() and time.monotonic() < deadline:
        _poke(server)
        stopper.join(_POKE_EVERY_S)
    server.server_close()
    if thread is not None:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _poke(server: socketserver.BaseServer) -> None:
    """Connect to ``server`` and hang up: its loop wakes."""
    sock = getattr(server, "socket", None)
    if sock is None:
        return
    family = sock.family
    address: Any = server.server_address
    if family in (socket.AF_INET, socket.AF_INET6):
        host, port = address[0], address[1]
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        address = (host, port)
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as client:
        client.settimeout(0.5)
        client.connect(address)
