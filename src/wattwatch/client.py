"""wattwatch's one HTTP client, on httpx: the command line's reads from a collector (``report --server``,
the demo's progress line), the agent's pushes to its collector, its scrapes and its kubelet lookups.

Credentials stay with their origin. Redirects are never followed by httpx itself: ``get`` follows one only
while it stays on the origin it was sent to (scheme, host and port), and answers a redirect anywhere else
(another host or port, or https to http) with ``RedirectRefused``, the token never sent there. httpx
honours the proxy environment (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``) as
``trust_env`` has it, so the same rule holds through a proxy.

Failures are sorted into what callers act on: ``Unreachable`` (no connection, nothing was sent; a TLS
handshake that failed included), ``SentReset`` (the connection broke after the request went out),
``SentTimeout`` (no answer in time) and ``RedirectRefused``. ``Poster`` is the agent's shape: one
``httpx.Client`` whose pool keeps one keep-alive connection to the collector and opens a new one when the
collector closed it while idle (httpcore checks an idle connection before reusing it).
"""

from __future__ import annotations

import ssl
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)


class ClientError(Exception):
    """A request that got no usable HTTP answer; ``str()`` says why in one line."""


class Unreachable(ClientError):
    """No connection could be made (refused, no route, TLS handshake failed): nothing was sent."""


class SentReset(ClientError):
    """The connection broke after the request was (maybe partly) sent."""


class SentTimeout(ClientError):
    """The request was sent and no answer came in time."""


class RedirectRefused(ClientError):
    """The server redirected to another origin; the request (and its credentials) did not follow."""

    def __init__(self, url: str, location: str) -> None:
        super().__init__(f"{url} redirected to {location}, another origin; give that URL itself")
        self.url = url
        self.location = location


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, headers (lower-case names) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


def origin(url: str | httpx.URL) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``url``, the port filled in from the scheme when the URL has none."""
    parts = httpx.URL(str(url))
    scheme = parts.scheme.lower()
    return scheme, parts.host.lower(), parts.port or (443 if scheme == "https" else 80)


def bearer(token: str) -> dict[str, str]:
    """The Authorization header for ``token`` (none for an empty token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def make_client(*, timeout_s: float, verify: ssl.SSLContext | bool = True) -> httpx.Client:
    """An ``httpx.Client`` as wattwatch uses one: redirects not followed by httpx (``send`` decides), and
    ``verify`` as ``tls.client_verify`` gives it (the system's CAs, one CA file's context, or none)."""
    return httpx.Client(timeout=timeout_s, verify=verify, follow_redirects=False)


def tls_for(url: str, verify: ssl.SSLContext | bool) -> ssl.SSLContext | bool:
    """What a one-shot request to ``url`` verifies TLS with: ``verify``, except for a plain-http URL with no
    https proxy, which never meets TLS (a redirect is followed only within the origin, so never to https).
    There, a context that requires a verified certificate but trusts no CA stands in for the system's CA
    bundle, whose loading is 25-45 ms of a ``report --server`` start-up; any TLS it did meet would fail
    closed, never unverified."""
    if verify is not True or urlsplit(url).scheme.lower() != "http":
        return verify
    if any(str(proxy).lower().startswith("https:") for proxy in urllib.request.getproxies().values()):
        return verify
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname, no CA loaded


def _sorted(exc: httpx.HTTPError, url: str, timeout_s: float | None) -> ClientError:
    """The ``ClientError`` for an httpx failure, said in one line."""
    if isinstance(exc, httpx.UnsupportedProtocol):
        return Unreachable(f"{url!r} is no http:// or https:// URL")
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError)):
        return Unreachable(str(exc) or type(exc).__name__)
    if isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)):
        return SentTimeout(f"no answer from {url} within {timeout_s:g} s" if timeout_s else str(exc))
    if isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.CloseError)):
        return SentReset(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    return Unreachable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _reply(resp: httpx.Response) -> Reply:
    return Reply(resp.status_code, {k.lower(): v for k, v in resp.headers.items()}, resp.content)


def send(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    timeout_s: float | None = None,
) -> Reply:
    """``method`` ``url`` on ``client``; redirects followed only within ``url``'s origin (see the module
    docstring). Raises a ``ClientError`` when no answer comes, ``RedirectRefused`` for a redirect elsewhere."""
    try:
        request = client.build_request(method, url, headers=dict(headers or {}), content=body)
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise Unreachable(f"{url!r} is no http:// or https:// URL ({exc})") from None
    except httpx.LocalProtocolError:
        # Never the exception's text: a malformed header there would be the token.
        raise Unreachable("a request header is not valid HTTP (check the token)") from None
    home = origin(request.url)
    for _ in range(MAX_REDIRECTS + 1):
        try:
            resp = client.send(request)
        except httpx.LocalProtocolError:
            raise Unreachable("a request header is not valid HTTP (check the token)") from None
        except httpx.HTTPError as exc:
            raise _sorted(exc, url, timeout_s) from exc
        if resp.status_code not in _REDIRECTS or resp.next_request is None:
            return _reply(resp)
        target = resp.next_request
        resp.close()
        if origin(target.url) != home:
            raise RedirectRefused(url, str(target.url.copy_with(query=None, fragment=None)))
        request = target
    raise Unreachable(f"{url} redirected more than {MAX_REDIRECTS} times")


def get(
    url: str,
    *,
    token: str = "",
    timeout_s: float,
    verify: ssl.SSLContext | bool = True,
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """One GET of ``url`` with ``token`` as its bearer: the answer for any status the server gives."""
    with make_client(timeout_s=timeout_s, verify=tls_for(url, verify)) as client:
        return send(
            client,
            "GET",
            url,
            headers={"Accept": "application/json", **bearer(token), **(headers or {})},
            timeout_s=timeout_s,
        )


class Poster:
    """POSTs to one collector over a reused keep-alive connection, failures sorted as ``send`` sorts them.

    ``client``: an httpx-style client of the caller's (a test's in-process ASGI client); otherwise one is
    made for ``base_url`` with ``timeout_s`` and ``verify``."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 10.0,
        verify: ssl.SSLContext | bool = True,
        client: Any | None = None,
    ) -> None:
        self._bad = ""
        try:
            parts = urlsplit(base_url)  # raises on an unbalanced [IPv6 address
            parts.port  # noqa: B018 (raises on a port that is no number)
        except ValueError:
            parts = urlsplit("")
        if client is None and (parts.scheme not in ("http", "https") or not parts.hostname):
            # Said at each push, as a failed connection is: the agent still measures and spools.
            self._bad = f"{base_url!r} is no http://HOST:PORT or https://HOST:PORT URL; check --collector"
        self._timeout_s = timeout_s
        self._client: Any = client if client is not None else make_client(timeout_s=timeout_s, verify=verify)

    def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        """POST ``body`` to ``url`` (on this collector) and read the whole answer; no redirect followed."""
        if self._bad:
            raise Unreachable(self._bad)
        try:
            resp = self._client.post(url, content=body, headers=dict(headers))
        except httpx.LocalProtocolError:
            raise Unreachable("a request header is not valid HTTP (check the token)") from None
        except httpx.HTTPError as exc:
            raise _sorted(exc, url, self._timeout_s) from exc
        return _reply(resp)

    def close(self) -> None:
        """Close the client and its connection (a later POST on a new Poster opens one)."""
        self._client.close()
