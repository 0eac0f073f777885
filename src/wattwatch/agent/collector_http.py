"""The agent's HTTP POSTs to the collector: one keep-alive connection (``http.client``), reused across pushes.

A push every few seconds is one small request; a general HTTP client (connection pool, request and
response models, cookie jar, URL merging) costs the agent more CPU per push than building, compressing and
sending the batch itself. ``KeepAlive`` keeps one connection open and reconnects when the collector
closed it while idle (found before sending, so no request is lost to it). Failures are sorted into what
the pusher acts on: ``Unreachable`` (no connection: nothing was sent), ``SentReset`` (the connection
broke after the request went out: retried once, on a new connection) and ``SentTimeout`` (no answer in
time). ``HttpxPoster`` gives an httpx-style client (a test's ASGI client) the same shape.
"""

from __future__ import annotations

import http.client
import select
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit


class PostError(Exception):
    """A POST that got no HTTP answer; ``str()`` says why."""


class Unreachable(PostError):
    """No connection could be made (refused, no route, TLS handshake failed): nothing was sent."""


class SentReset(PostError):
    """The connection broke after the request was (maybe partly) sent."""


class SentTimeout(PostError):
    """The request was sent and no answer came in time."""


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, headers (lower-case names) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class Poster(Protocol):
    """Sends one POST and returns the answer, or raises a ``PostError``."""

    def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        """POST ``body`` to ``url``."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...


def tls_context(verify: ssl.SSLContext | bool) -> ssl.SSLContext:
    """The TLS context for ``verify`` as ``tls.client_verify`` gives it: its own context, the default
    CAs (certifi's bundle when installed, as httpx used, else the system's), or no verification."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    if not verify:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    try:
        import certifi
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


class KeepAlive:
    """POSTs to one collector over one reused HTTP/1.1 connection (see the module docstring)."""

    def __init__(self, base_url: str, *, timeout_s: float = 10.0, verify: ssl.SSLContext | bool = True) -> None:
        parts = urlsplit(base_url)
        self._bad = ""
        try:
            parts.port  # noqa: B018 (raises on a port that is no number)
        except ValueError:
            parts = urlsplit("")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # Said at each push, as a failed connection is: the agent still measures and spools.
            self._bad = f"{base_url!r} is no http://HOST:PORT or https://HOST:PORT URL; check --collector"
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._timeout_s = timeout_s
        self._context = tls_context(verify) if self._https else None
        self._conn: http.client.HTTPConnection | None = None

    def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        """POST ``body`` to ``url`` (on this collector) and read the whole answer."""
        if self._bad:
            raise Unreachable(self._bad)
        conn = self._connected()
        path = urlsplit(url)
        target = (path.path or "/") + (f"?{path.query}" if path.query else "")
        try:
            conn.request("POST", target, body=body, headers=dict(headers))
            resp = conn.getresponse()
            data = resp.read()
        except TimeoutError as exc:
            self.close()
            raise SentTimeout(f"no answer within {self._timeout_s:g} s") from exc
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise SentReset(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc
        if resp.will_close:
            self.close()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)

    def _connected(self) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is not None and conn.sock is not None and _closed_by_peer(conn.sock):
            self.close()  # the collector closed the idle connection (its keep-alive timeout): a new one
            conn = None
        if conn is None or conn.sock is None:
            if self._context is not None:
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout_s, context=self._context
                )
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
            try:
                conn.connect()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise Unreachable(str(exc) or type(exc).__name__) from exc
            self._conn = conn
        return conn

    def close(self) -> None:
        """Close the connection (the next POST opens one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _closed_by_peer(sock: Any) -> bool:
    """Whether an idle connection's socket is readable: the peer closed it (or sent something unasked,
    which makes it unusable too)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0.0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class HttpxPoster:
    """An httpx-style client (``post(url, content=, headers=)``) as a ``Poster``: tests hand the pusher
    an in-process ASGI client."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        """POST through the wrapped client, its errors sorted as ``KeepAlive``'s are."""
        import httpx

        try:
            resp = self._client.post(url, content=body, headers=dict(headers))
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
            raise SentReset(f"{type(exc).__name__}: {exc}") from exc
        except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:
            raise SentTimeout(f"{type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise Unreachable(str(exc)) from exc
        return Reply(resp.status_code, {k.lower(): v for k, v in resp.headers.items()}, resp.content)

    def close(self) -> None:
        """Close the wrapped client."""
        self._client.close()
