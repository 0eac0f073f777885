"""The collector's server limits through a real ``wattwatch collector`` process, on SQLite and PostgreSQL:
connections that never finish their headers or body are closed by the read deadlines, and beyond the
connection limit a new connection is answered 503 with Retry-After, while a valid agent keeps landing
batches."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from procs import wait_for
from test_auth_e2e import env_for, run, stop
from test_front_door_e2e import ingest, start_collector

pytestmark = pytest.mark.e2e

HALF_OPEN = 3000
HEADER_TIMEOUT_S = 1.0


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (a read gives EOF or a reset), without blocking."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _open(url: str, n: int, first_bytes: bytes) -> list[socket.socket]:
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if first_bytes:
            sock.sendall(first_bytes)
        socks.append(sock)
    return socks


@pytest.fixture
def limited(db_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    home = tmp_path / "home"
    token = run(["token", "create", "--db", db_url, "--role", "agent", "--host", "h1"], env_for(home)).stdout.strip()
    proc, url = start_collector(
        db_url,
        home,
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
        "--body-timeout",
        str(HEADER_TIMEOUT_S),
        "--max-connections",
        str(HALF_OPEN + 100),
    )
    try:
        yield url, token
    finally:
        stop(proc)


def test_half_open_connections_are_closed_by_the_header_timeout(limited: tuple[str, str]) -> None:
    url, token = limited
    socks = _open(url, HALF_OPEN, b"POST /api/v1/ingest HTTP/1.1\r\nHost: collector\r\n")
    try:
        opened_s = time.monotonic()
        assert ingest(url, token, seq=1).status_code == 200  # a valid agent, while they hang
        # Each is closed once its headers are HEADER_TIMEOUT_S late; the bound adds the time to close 3,000.
        wait_for(lambda: all(_closed_by_peer(s) for s in socks), 10 * HEADER_TIMEOUT_S + 10, "the server to close them")
        assert time.monotonic() - opened_s >= HEADER_TIMEOUT_S
        assert ingest(url, token, seq=2).status_code == 200
    finally:
        for s in socks:
            s.close()


def test_a_body_that_stops_arriving_is_closed_by_the_body_timeout(limited: tuple[str, str]) -> None:
    url, token = limited
    head = (
        f"POST /api/v1/ingest HTTP/1.1\r\nHost: collector\r\nAuthorization: Bearer {token}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    ).encode()
    (sock,) = _open(url, 1, head)
    try:
        wait_for(lambda: _closed_by_peer(sock), 5 * HEADER_TIMEOUT_S + 5, "the server to close it")
    finally:
        sock.close()
    assert ingest(url, token, seq=1).status_code == 200


def test_beyond_the_connection_limit_a_new_connection_gets_503_with_retry_after(
    sqlite_url: str, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    proc, url = start_collector(sqlite_url, home, "--open", "--max-connections", "20", "--header-timeout", "60")
    try:
        idle = _open(url, 20, b"")
        try:
            wait_for(lambda: httpx.get(f"{url}/healthz", timeout=5).status_code == 503, 10, "the limit to be reached")
            r = httpx.get(f"{url}/healthz", timeout=5)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["field"] is None and "Retry-After" in r.json()["error"]
        finally:
            for s in idle:
                s.close()
        wait_for(lambda: httpx.get(f"{url}/healthz", timeout=5).status_code == 200, 10, "room again")
    finally:
        stop(proc)
