"""wattwatch.client against real HTTP servers on loopback: the token stays with its origin (redirects
to another port, or from https to http, are refused and never carry it; through a forwarding proxy too),
same-origin redirects are followed, failures are sorted and said in one line, and the agent's poster keeps
its connection alive."""

from __future__ import annotations

import datetime
import http.client
import http.server
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from wattwatch import client
from wattwatch.client import tls_for

Route = Callable[[http.server.BaseHTTPRequestHandler], tuple[int, dict[str, str], bytes]]


class Server:
    """A threaded HTTP server on loopback answering by ``route``; ``seen`` holds (path, Authorization,
    client port) of each request."""

    def __init__(self, route: Route, context: ssl.SSLContext | None = None) -> None:
        self.seen: list[tuple[str, str | None, int]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                owner.seen.append((self.path, self.headers.get("Authorization"), self.client_address[1]))
                status, headers, body = route(self)
                self.send_response(status)
                for name, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if context is not None:
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        scheme = "https" if context is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def ok(_: http.server.BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json"}, b'{"ok": true}'


def redirecting(location: str, status: int = 302, prefix: str = "/away") -> Route:
    """Redirect paths starting with ``prefix`` to ``location``; anything else is answered 200."""

    def route(h: http.server.BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        return (status, {"Location": location}, b"") if h.path.startswith(prefix) else ok(h)

    return route


@contextmanager
def forwarding_proxy() -> Iterator[Server]:
    """A plain-HTTP forward proxy: absolute-form requests are sent on to their origin, the answer relayed."""

    def route(h: http.server.BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        target = urlsplit(h.path)
        conn = http.client.HTTPConnection(target.hostname or "", target.port or 80, timeout=10)
        skip = {"proxy-connection", "connection", "host", "content-length"}
        conn.request(
            h.command, target.path or "/", headers={k: v for k, v in h.headers.items() if k.lower() not in skip}
        )
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        keep = {k: v for k, v in resp.getheaders() if k.lower() in ("location", "content-type")}
        return resp.status, keep, body

    with Server(route) as proxy:
        yield proxy


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


@pytest.mark.parametrize("status", [302, 307])
def test_the_token_reaches_its_origin_and_never_follows_a_redirect_to_another(
    no_proxy_env: pytest.MonkeyPatch, status: int
) -> None:
    with Server(ok) as b, Server(redirecting(f"{b.url}/stolen", status)) as a:
        with pytest.raises(client.RedirectRefused, match="another origin"):
            client.get(f"{a.url}/away", token="s3cret", timeout_s=10)
        assert a.seen[0][:2] == ("/away", "Bearer s3cret")
        assert b.seen == []


def test_a_redirect_within_the_origin_is_followed_with_the_token(no_proxy_env: pytest.MonkeyPatch) -> None:
    with Server(redirecting("/there", 307)) as a:
        reply = client.get(f"{a.url}/away", token="s3cret", timeout_s=10)
        assert (reply.status, reply.body) == (200, b'{"ok": true}')
        assert [s[:2] for s in a.seen] == [("/away", "Bearer s3cret"), ("/there", "Bearer s3cret")]


def test_a_redirect_loop_ends_in_one_error(no_proxy_env: pytest.MonkeyPatch) -> None:
    with Server(redirecting("/away")) as a, pytest.raises(client.Unreachable, match="redirected more than"):
        client.get(f"{a.url}/away", token="t", timeout_s=10)


def test_through_a_forwarding_proxy_the_token_stays_with_its_origin(no_proxy_env: pytest.MonkeyPatch) -> None:
    with Server(ok) as b, Server(redirecting(f"{b.url}/stolen")) as a, forwarding_proxy() as proxy:
        no_proxy_env.setenv("HTTP_PROXY", proxy.url)
        no_proxy_env.setenv("ALL_PROXY", proxy.url)
        assert client.get(f"{a.url}/fine", token="s3cret", timeout_s=10).status == 200
        with pytest.raises(client.RedirectRefused):
            client.get(f"{a.url}/away", token="s3cret", timeout_s=10)
        # Both requests went through the proxy, and neither the proxy nor B was asked for B.
        assert [s[:2] for s in proxy.seen] == [(f"{a.url}/fine", "Bearer s3cret"), (f"{a.url}/away", "Bearer s3cret")]
        assert [s[:2] for s in a.seen] == [("/fine", "Bearer s3cret"), ("/away", "Bearer s3cret")]
        assert b.seen == []


def test_no_proxy_sends_the_request_direct(no_proxy_env: pytest.MonkeyPatch) -> None:
    with Server(ok) as a:
        no_proxy_env.setenv("ALL_PROXY", "http://127.0.0.1:9")  # nothing listens there
        no_proxy_env.setenv("HTTP_PROXY", "http://127.0.0.1:9")
        no_proxy_env.setenv("NO_PROXY", "127.0.0.1")
        assert client.get(f"{a.url}/x", token="t", timeout_s=10).status == 200
        assert a.seen[0][:2] == ("/x", "Bearer t")


def _tls_pair(where: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A self-signed certificate for 127.0.0.1: (server context, client context trusting it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem, key_pem = where / "cert.pem", where / "key.pem"
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_pem, key_pem)
    return server, ssl.create_default_context(cafile=str(cert_pem))


def test_a_redirect_from_https_to_http_never_carries_the_token(
    no_proxy_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server_tls, trusting = _tls_pair(tmp_path)
    with Server(ok) as plain:
        port = urlsplit(plain.url).port
        with Server(redirecting(f"http://127.0.0.1:{port}/stolen"), server_tls) as secure:
            assert client.get(f"{secure.url}/fine", token="s3cret", timeout_s=10, verify=trusting).status == 200
            with pytest.raises(client.RedirectRefused):
                client.get(f"{secure.url}/away", token="s3cret", timeout_s=10, verify=trusting)
            assert plain.seen == []
            # Not trusted without the CA: a failed handshake, nothing sent.
            with pytest.raises(client.Unreachable) as caught:
                client.get(f"{secure.url}/fine", token="s3cret", timeout_s=10)
            from wattwatch.tls import untrusted_certificate

            assert untrusted_certificate(caught.value)
            assert len(secure.seen) == 2


@contextmanager
def connect_proxy() -> Iterator[tuple[str, list[bytes]]]:
    """An HTTPS_PROXY: answers CONNECT host:port and then relays bytes both ways; yields its URL and every
    byte it saw from the client (the CONNECT request, then the tunnel's), for searching."""
    seen: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    stopping = threading.Event()

    def pipe(src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    seen.append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            seen.append(head)
            host, _, port = head.split(b" ", 2)[1].decode().rpartition(":")
            upstream = socket.create_connection((host, int(port)))
            conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            threading.Thread(target=pipe, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, conn, False), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        stopping.set()
        thread.join()
        listener.close()


def test_a_proxy_never_sees_the_token_of_an_https_request(no_proxy_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    server_tls, trusting = _tls_pair(tmp_path)
    with Server(ok, server_tls) as secure, connect_proxy() as (proxy_url, seen):
        no_proxy_env.setenv("HTTPS_PROXY", proxy_url)
        no_proxy_env.setenv("HTTP_PROXY", proxy_url)
        assert client.get(f"{secure.url}/fine", token="s3cret-token", timeout_s=10, verify=trusting).status == 200
        # It went through the proxy, as a tunnel: the proxy saw CONNECT and ciphertext, never the token.
        assert seen and seen[0].startswith(f"CONNECT 127.0.0.1:{urlsplit(secure.url).port} ".encode())
        assert secure.seen and secure.seen[0][1] == "Bearer s3cret-token"
        relayed = b"".join(seen)
        assert b"s3cret-token" not in relayed and b"Authorization" not in relayed


def test_the_host_header_never_carries_url_credentials(no_proxy_env: pytest.MonkeyPatch) -> None:
    hosts: list[str] = []

    def route(h: http.server.BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        hosts.append(h.headers.get("Host", ""))
        return ok(h)

    with Server(route) as a:
        port = urlsplit(a.url).port
        assert client.get(f"http://user:pw@127.0.0.1:{port}/x", timeout_s=10).status == 200
        assert hosts == [f"127.0.0.1:{port}"]


def test_error_statuses_come_back_with_their_body(no_proxy_env: pytest.MonkeyPatch) -> None:
    with Server(lambda h: (422, {}, b'{"error": "bad"}')) as a:
        reply = client.get(f"{a.url}/x", timeout_s=10)
        assert (reply.status, reply.body, reply.headers["content-length"]) == (422, b'{"error": "bad"}', "16")


def test_failures_are_sorted() -> None:
    with pytest.raises(client.Unreachable):
        client.get("http://127.0.0.1:9/", timeout_s=5)  # nothing listens on the discard port
    with pytest.raises(client.Unreachable, match="no http"):
        client.get("ftp://example.invalid/", timeout_s=5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        with pytest.raises(client.SentTimeout, match=r"within 0\.3 s"):
            client.get(f"http://127.0.0.1:{silent.getsockname()[1]}/", timeout_s=0.3)


def test_the_poster_reuses_one_connection_and_survives_its_close(no_proxy_env: pytest.MonkeyPatch) -> None:
    with Server(lambda h: (204, {}, b"")) as a:
        poster = client.Poster(a.url, timeout_s=5)
        for _ in range(3):
            assert poster.post(f"{a.url}/api/v1/ingest", b"{}", {"Authorization": "Bearer t"}).status == 204
        assert len({s[2] for s in a.seen}) == 1  # one client port: one kept-alive connection
        poster.close()
        poster = client.Poster(a.url, timeout_s=5)
        assert poster.post(f"{a.url}/api/v1/ingest", b"{}", {}).status == 204
        poster.close()
    with pytest.raises(client.Unreachable, match="check --collector"):
        client.Poster("collector:8470").post("collector:8470/api/v1/ingest", b"", {})
    with pytest.raises(client.Unreachable):
        client.Poster("http://127.0.0.1:9").post("http://127.0.0.1:9/api/v1/ingest", b"", {})


def _report(server: str, token: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WATTWATCH_TOKEN": token}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "wattwatch.cli.main", "report", "--server", server],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_report_says_in_one_line_what_to_do() -> None:
    with Server(ok) as b, Server(redirecting(f"{b.url}/stolen", prefix="/")) as a:
        with Server(lambda h: (401, {}, b'{"error": "token missing"}')) as locked:
            refused = _report(f"{locked.url}", "t")
            assert refused.returncode == 2
            assert "give a reader token" in refused.stderr and "Traceback" not in refused.stderr
        moved = _report(a.url, "t")
        assert moved.returncode == 2
        assert "another origin" in moved.stderr and "Traceback" not in moved.stderr
        assert b.seen == []
    gone = _report("http://127.0.0.1:9", "t")
    assert gone.returncode != 0 and "unreachable" in gone.stderr and "Traceback" not in gone.stderr


def test_a_plain_http_request_loads_no_ca_and_any_tls_it_met_would_fail_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    ctx = tls_for("http://collector.internal:8470/api/v1/report", True)
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname and ctx.cert_store_stats()["x509_ca"] == 0
    # https, a CA file of the user's, or an https proxy in the way: verification exactly as asked.
    assert tls_for("https://collector.internal:8470/", True) is True
    own = ssl.create_default_context()
    assert tls_for("http://collector.internal:8470/", own) is own
    monkeypatch.setenv("HTTP_PROXY", "https://proxy.internal:3128")
    assert tls_for("http://collector.internal:8470/", True) is True


def test_a_collector_url_that_does_not_parse_is_said_at_each_push_never_raised_at_start() -> None:
    for url in ("http://[::1:8470", "http://127.0.0.1:port", "collector:8470"):
        poster = client.Poster(url)
        with pytest.raises(client.Unreachable, match="no http://HOST:PORT or https://HOST:PORT URL"):
            poster.post(url + "/api/v1/ingest", b"{}", {})
        poster.close()
