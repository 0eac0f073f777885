"""The collector's front door through a real ``wattwatch collector`` process: closed by default, ``--open``
for this machine only, a revoked last token that never reopens it, and writes refused before their body is
read (a flood of large unauthenticated bodies leaves the process's memory where it was)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest

from procs import WATTWATCH, free_port, wait_for
from test_auth_e2e import _answers, env_for, host_names, run, stop
from test_storage import batch, iv
from wattwatch.protocol import wire

pytestmark = pytest.mark.e2e

MIB = 1 << 20


def fresh_batch(seq: int, host: str = "h1") -> bytes:
    """A small agent batch of now (inside the collector's default time window)."""
    now_s = time.time() - 60
    b = batch(seq, host=host, agent_id=f"a-{host}", intervals=[iv("gpu0", now_s + t, 100.0, {}) for t in range(3)])
    return wire.encode(msgspec.structs.replace(b, sent_at_s=now_s + 3))


def start_collector(db_url: str, home: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [*WATTWATCH, "collector", "--db", db_url, "--listen", f"127.0.0.1:{port}", *extra],
        env=env_for(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(f"{url}/healthz", proc), 30.0, "the collector to listen")
    return proc, url


def ingest(url: str, token: str | None = None, seq: int = 1, host: str = "h1", **headers: str) -> httpx.Response:
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{url}/api/v1/ingest", content=fresh_batch(seq, host), headers=headers, timeout=10)


def test_closed_by_default_and_revoking_the_last_token_never_reopens(db_url: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc, url = start_collector(db_url, home)
    try:
        r = ingest(url)
        assert (r.status_code, r.json()["field"]) == (401, "Authorization")
        assert "--open" in r.json()["error"] and "wattwatch token create" in r.json()["error"]
        assert httpx.get(f"{url}/api/v1/report").status_code == 401
    finally:
        stop(proc)
    proc, url = start_collector(db_url, home, "--open")
    try:
        assert ingest(url, seq=1).status_code == 200  # this machine, no token ever made: --open takes it
        r = ingest(url, seq=2, **{"X-Forwarded-For": "127.0.0.1"})  # through a proxy on this host
        assert (r.status_code, r.json()["field"]) == (401, "Authorization")
        r = ingest(url, seq=2, Forwarded="for=127.0.0.1")
        assert r.status_code == 401 and "this machine only" in r.json()["error"]
        made = run(["token", "create", "--db", db_url, "--role", "agent", "--host", "h1"], env_for(home))
        token = made.stdout.strip()
        closed = lambda: httpx.get(f"{url}/api/v1/report", timeout=10).status_code == 401  # noqa: E731
        wait_for(closed, 30.0, "the new token to close the collector")
        assert ingest(url, seq=2).status_code == 401
        assert ingest(url, token, seq=2).status_code == 200
        revoked = run(["token", "revoke", "--db", db_url, "1"], env_for(home))
        assert revoked.returncode == 0, revoked.stderr
        assert "no active tokens left: the collector refuses all writes" in revoked.stdout
        assert "until `wattwatch token create`" in revoked.stdout
        wait_for(lambda: ingest(url, token, seq=3).status_code == 401, 30.0, "the revoke to be read")
        r = ingest(url, seq=3)
        assert (r.status_code, r.json()["field"]) == (401, "Authorization"), r.text
        assert httpx.get(f"{url}/api/v1/report").status_code == 401
    finally:
        stop(proc)
    # Started again on that database, --open or not, it stays closed.
    proc, url = start_collector(db_url, home, "--open")
    try:
        assert ingest(url, seq=3).status_code == 401
    finally:
        stop(proc)


# --- bodies --------------------------------------------------------------------------------------------------

FLOOD = 20
FLOOD_BODY_BYTES = 50 * MIB
RSS_CEILING_BYTES = 200 * MIB
_CHUNK = b"x" * MIB


def _send_body(
    url: str, path: str, token: str | None, chunked: bool, total_bytes: int, send_bytes: int | None = None
) -> tuple[int, bytes]:
    """POST ``total_bytes`` on a raw socket, all of it (or the first ``send_bytes``), as a careless client
    would; the answer's status and what was read of it."""
    port = int(url.rsplit(":", 1)[1])
    head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json"]
    if token is not None:
        head.append(f"Authorization: Bearer {token}")
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {total_bytes}")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        sent = 0
        try:
            limit = total_bytes if send_bytes is None else send_bytes
            while sent < limit:
                piece = _CHUNK[: min(len(_CHUNK), limit - sent)]
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece)
                sent += len(piece)
            if chunked and send_bytes is None:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may close once it has answered; the answer is still in our receive buffer
        answer = b""
        while not answer.endswith(b"}"):  # every answer here is a JSON object
            got = sock.recv(65536)
            if not got:
                break
            answer += got
    return (int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else -1), answer


@pytest.fixture
def guarded_collector(db_url: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    home = tmp_path / "home"
    token = run(["token", "create", "--db", db_url, "--role", "agent", "--host", "h1"], env_for(home))
    proc, url = start_collector(db_url, home)
    try:
        yield proc, url, token.stdout.strip()
    finally:
        stop(proc)


def test_an_oversized_or_chunked_body_is_refused_413(guarded_collector: tuple[subprocess.Popen[str], str, str]) -> None:
    _proc, url, token = guarded_collector
    # Content-Length over the limit: refused unread, before any byte of it arrives.
    status, answer = _send_body(url, "/api/v1/ingest", token, False, 65 * MIB, send_bytes=0)
    assert status == 413, answer
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert error["field"] == "body" and "65 MiB is over the limit of 64 MiB" in error["error"]
    # A chunked body is counted as it arrives and cut at the limit, on every write route.
    for path, chunked, n_bytes in [
        ("/api/v1/ingest", True, 65 * MIB),
        ("/api/v1/jobs", True, 65 * MIB),
        ("/api/v1/jobs/j/queries", False, 65 * MIB),
    ]:
        status, answer = _send_body(url, path, token, chunked, n_bytes)
        assert status == 413 and b'"field":"body"' in answer, (path, answer)
    assert ingest(url, token, seq=1).status_code == 200


@pytest.mark.slow
def test_a_flood_of_unauthenticated_bodies_is_never_read(
    guarded_collector: tuple[subprocess.Popen[str], str, str], db_url: str
) -> None:
    proc, url, token = guarded_collector
    collector = psutil.Process(proc.pid)
    assert ingest(url, token, seq=1).status_code == 200
    peak_rss = [collector.memory_info().rss]
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(0.05):
            peak_rss.append(collector.memory_info().rss)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for chunked in (False, True):
            statuses: list[int] = []

            def one(i: int, chunked: bool = chunked, statuses: list[int] = statuses) -> None:
                bad = None if i % 2 else "ww_not-a-token"
                statuses.append(_send_body(url, "/api/v1/ingest", bad, chunked, FLOOD_BODY_BYTES)[0])

            senders = [threading.Thread(target=one, args=(i,)) for i in range(FLOOD)]
            for t in senders:
                t.start()
            # A valid agent's batch lands while the flood is on.
            assert ingest(url, token, seq=2 + chunked).status_code == 200
            for t in senders:
                t.join(timeout=300)
            assert len(statuses) == FLOOD and set(statuses) == {401}, statuses  # every sender got its answer
    finally:
        watching.set()
        watcher.join()
    assert ingest(url, token, seq=4, host="h1").status_code == 200
    assert "h1" in host_names(db_url)
    print(f"collector RSS: {peak_rss[0] / MIB:.0f} MiB at start, {max(peak_rss) / MIB:.0f} MiB at most")
    assert max(peak_rss) <= RSS_CEILING_BYTES, f"collector RSS peaked at {max(peak_rss) / MIB:.0f} MiB"
