"""The command line's one GET (``http_get``) against real servers on loopback: what a collector, a reverse
proxy in front of it or a broken peer may answer. The collector itself is covered by the CLI tests
(``report --server``, ``jobs --server``, ``top``, TLS in test_auth_e2e)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from wattwatch import http_get

Answer = Callable[[bytes], bytes]


@contextmanager
def serve(answer: Answer, *, connections: int = 1, keep_open: bool = False) -> Iterator[str]:
    """A loopback server answering ``connections`` requests with ``answer(request head)``, then closing
    each connection (with ``keep_open``, only once the client has closed it); yields its base URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: list[bytes] = []

    def run() -> None:
        for _ in range(connections):
            conn, _addr = listener.accept()
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(4096)
                    if not data:
                        break
                    head += data
                seen.append(head)
                conn.sendall(answer(head))
                if keep_open:  # as a keep-alive server would: the client must see the answer is whole
                    conn.settimeout(60)
                    while conn.recv(4096):
                        pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        thread.join(timeout=10)
        listener.close()


def fixed(raw: bytes) -> Answer:
    return lambda _head: raw


def test_a_plain_answer_and_the_request_it_answers() -> None:
    heads: list[bytes] = []

    def answer(head: bytes) -> bytes:
        heads.append(head)
        return b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'

    with serve(answer) as base:
        status, body = http_get.get(f"{base}/api/v1/report?limit=5", {"Authorization": "Bearer t"}, timeout_s=10)
    assert (status, body) == (200, b'{"ok": true}')
    lines = heads[0].decode().split("\r\n")
    assert lines[0] == "GET /api/v1/report?limit=5 HTTP/1.1"
    assert "Authorization: Bearer t" in lines and any(line.startswith("Host: 127.0.0.1:") for line in lines)


def test_chunked_bodies_are_joined() -> None:
    raw = b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"a"\r\n5\r\n: 12}\r\n0\r\n\r\n'
    with serve(fixed(raw)) as base:
        assert http_get.get(base + "/x", {}, timeout_s=10) == (200, b'{"a": 12}')


def test_error_statuses_come_back_with_their_body() -> None:
    raw = b'HTTP/1.1 422 Unprocessable Entity\r\nContent-Length: 16\r\n\r\n{"error": "bad"}'
    with serve(fixed(raw)) as base:
        assert http_get.get(base + "/x", {}, timeout_s=10) == (422, b'{"error": "bad"}')


def test_interim_answers_are_skipped() -> None:
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    with serve(fixed(raw)) as base:
        assert http_get.get(base + "/x", {}, timeout_s=10) == (200, b"{}")


def test_bare_line_feeds_are_read() -> None:
    with serve(fixed(b"HTTP/1.1 200 OK\nContent-Length: 2\n\n{}")) as base:
        assert http_get.get(base + "/x", {}, timeout_s=10) == (200, b"{}")


@pytest.mark.parametrize(
    "raw",
    [
        b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"a": true}',
        b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nb\r\n{"a": true}\r\n0\r\n\r\n',
    ],
    ids=["content-length", "chunked"],
)
def test_a_server_keeping_the_connection_open_is_not_waited_for(raw: bytes) -> None:
    """The answer is whole by its framing: read to there, not to the timeout (30 s)."""
    with serve(fixed(raw), keep_open=True) as base:
        t0 = time.monotonic()
        assert http_get.get(base + "/x", {}, timeout_s=30) == (200, b'{"a": true}')
        assert time.monotonic() - t0 < 15


def test_the_host_header_never_carries_credentials() -> None:
    heads: list[bytes] = []

    def answer(head: bytes) -> bytes:
        heads.append(head)
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"

    with serve(answer) as base:
        port = base.rsplit(":", 1)[1]
        assert http_get.get(f"http://user:secret@127.0.0.1:{port}/x", {}, timeout_s=10) == (200, b"{}")
    assert b"secret" not in heads[0] and f"Host: 127.0.0.1:{port}\r\n".encode() in heads[0]


def test_redirects_are_followed() -> None:
    answers = iter(
        [
            b"HTTP/1.1 308 Permanent Redirect\r\nLocation: /moved\r\nContent-Length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        ]
    )
    paths: list[str] = []

    def answer(head: bytes) -> bytes:
        paths.append(head.split(b" ")[1].decode())
        return next(answers)

    with serve(answer, connections=2) as base:
        assert http_get.get(base + "/api", {}, timeout_s=10) == (200, b"{}")
    assert paths == ["/api", "/moved"]


def test_a_redirect_to_another_origin_is_not_followed() -> None:
    """The bearer token goes only where it was sent: a redirect to another host comes back as it is."""
    raw = b"HTTP/1.1 302 Found\r\nLocation: http://elsewhere.invalid/api\r\nContent-Length: 0\r\n\r\n"
    with serve(fixed(raw)) as base:
        assert http_get.get(base + "/api", {"Authorization": "Bearer t"}, timeout_s=10) == (302, b"")


@pytest.mark.parametrize(
    "raw",
    [
        b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"short"',  # cut off
        b"HTTP/1.1 200 OK\r\nContent-Len",  # ended in the headers
        b"SSH-2.0-OpenSSH_9.2\r\n\r\n",  # not HTTP at all
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc",  # a chunk cut off
    ],
    ids=["cut-off", "no-headers-end", "not-http", "chunk-cut-off"],
)
def test_a_broken_answer_is_an_oserror(raw: bytes) -> None:
    """The CLI turns an OSError into one line: the collector is unreachable or broken."""
    with serve(fixed(raw)) as base, pytest.raises(OSError):
        http_get.get(base + "/x", {}, timeout_s=10)


def test_no_server_is_an_oserror() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    with pytest.raises(ConnectionRefusedError):
        http_get.get(f"http://127.0.0.1:{port}/", {}, timeout_s=10)


def test_a_silent_server_times_out() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(TimeoutError):
            http_get.get(f"http://127.0.0.1:{listener.getsockname()[1]}/", {}, timeout_s=0.3)
    finally:
        listener.close()


def test_a_proxy_in_the_environment_goes_through_urllib(monkeypatch: pytest.MonkeyPatch) -> None:
    """With HTTP_PROXY set the request goes to the proxy, as urllib's rules say (absolute URI in the
    request line), and its answer comes back the same way."""
    heads: list[bytes] = []

    def answer(head: bytes) -> bytes:
        heads.append(head)
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]"

    with serve(answer) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert http_get.get("http://collector.invalid:8470/api/v1/live", {}, timeout_s=10) == (200, b"[]")
    assert heads[0].startswith(b"GET http://collector.invalid:8470/api/v1/live HTTP/1.1")
