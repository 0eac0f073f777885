"""The agent's servers sleep while idle and still stop at once (``agent.quiet_server``)."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from pathlib import Path

import pytest

from wattwatch.agent import quiet_server


class Counting(socketserver.ThreadingTCPServer):
    """Counts its loop's turns (``service_actions`` runs once per turn)."""

    allow_reuse_address = True
    turns = 0

    def service_actions(self) -> None:
        self.turns += 1


class CountingUnix(socketserver.ThreadingUnixStreamServer):
    turns = 0

    def service_actions(self) -> None:
        self.turns += 1


def test_an_idle_server_does_not_wake_and_stops_at_once() -> None:
    server = Counting(("0.0.0.0", 0), socketserver.BaseRequestHandler)
    port = server.server_address[1]
    thread = quiet_server.serve(server, "test-quiet")
    time.sleep(1.2)  # socketserver's own loop turns twice in this time
    assert server.turns == 0
    started_s = time.monotonic()
    quiet_server.stop(server, thread)
    assert time.monotonic() - started_s < 2.0 and not thread.is_alive()
    with socket.socket() as again:  # the port is free again
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_a_unix_socket_server_answers_then_stops_at_once(tmp_path: Path) -> None:
    got: list[bytes] = []

    class Echo(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            line = self.rfile.readline()
            got.append(line)
            self.wfile.write(line)

    path = tmp_path / "s.sock"
    server = CountingUnix(str(path), Echo)
    thread = quiet_server.serve(server, "test-quiet-unix")
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(5.0)
        client.connect(str(path))
        client.sendall(b"hello\n")
        assert client.recv(100) == b"hello\n"
    started_s = time.monotonic()
    quiet_server.stop(server, thread)
    assert time.monotonic() - started_s < 2.0 and not thread.is_alive()
    assert got == [b"hello\n"]


@pytest.mark.parametrize("delay_s", [0.0, 0.3])
def test_stop_while_a_handler_is_busy_still_returns(delay_s: float) -> None:
    release = threading.Event()

    class Slow(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            release.wait(delay_s)

    server = Counting(("127.0.0.1", 0), Slow)
    thread = quiet_server.serve(server, "test-quiet-busy")
    with socket.create_connection(server.server_address[:2], timeout=5.0):
        started_s = time.monotonic()
        quiet_server.stop(server, thread)
    assert time.monotonic() - started_s < 2.0 and not thread.is_alive()
