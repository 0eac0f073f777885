"""One HTTP/1.1 GET for the command line's read commands (``report --server``, ``jobs``, ``top``, ``run``'s
summary): a bearer token out, a status and a JSON body back.

The standard library's ``urllib.request`` brings ``http.client`` and the ``email`` package with it, about
25 ms of a ``wattwatch report --server`` whose whole budget is 200 ms (``benchmarks/report_startup.py``).
These commands need none of it, so the request is written on a socket; ``ssl`` is imported only for https.
Where a proxy is configured in the environment (``HTTP_PROXY`` and friends), ``urllib.request`` is used
after all, since it knows the proxy rules (``NO_PROXY`` included).
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

if TYPE_CHECKING:
    import ssl

_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
_REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 5


class HttpError(OSError):
    """The server's answer could not be read (a malformed or cut-off response)."""


def get(
    url: str, headers: dict[str, str], *, timeout_s: float, context: ssl.SSLContext | None = None
) -> tuple[int, bytes]:
    """GET ``url`` with ``headers``: ``(status, body)`` for any status the server answers, redirects within
    the same origin followed. No answer at all raises OSError (ssl's errors included), like
    ``urllib.request`` does."""
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return _get_via_urllib(url, headers, timeout_s=timeout_s, context=context)
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        status, head, body = _get_once(url, headers, deadline=deadline, context=context)
        location = head.get("location")
        if status not in _REDIRECTS or not location:
            return status, body
        target = urljoin(url, location)
        if _origin(target) != _origin(url):
            # The token goes only where it was sent: a redirect elsewhere (another host, or https to http)
            # is answered as it came, and the caller names the status.
            return status, body
        url = target
    raise HttpError(f"more than {MAX_REDIRECTS} redirects")


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _get_once(
    url: str, headers: dict[str, str], *, deadline: float, context: ssl.SSLContext | None
) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url}")
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # Host from the name and port alone: never the URL's user:password part.
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    host += f":{parts.port}" if parts.port else ""
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}", "Accept: application/json", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    # An ASCII name as bytes: a str is IDNA-encoded first, and the idna codec's import (with stringprep)
    # is 1-2 ms of `report --server`'s start-up.
    name = parts.hostname.encode("ascii") if parts.hostname.isascii() else parts.hostname
    sock = socket.create_connection((name, port), timeout=_left(deadline))  # type: ignore[arg-type]
    try:
        if https:
            import ssl

            sock = (context or ssl.create_default_context()).wrap_socket(sock, server_hostname=parts.hostname)
        sock.sendall(request)
        raw = bytearray()
        framing: tuple[str, int, int] | None = None  # (how the answer ends, its length, where its body starts)
        while True:
            sock.settimeout(_left(deadline))
            data = sock.recv(1 << 16)
            if not data:
                break
            raw += data
            # Asked to close, a server ends the stream after its answer; one that keeps it open is done
            # when the answer is whole by its own framing (its Content-Length, or the last chunk).
            framing = framing or _framing(bytes(raw))
            if framing is not None and _whole(raw, framing):
                break
    finally:
        sock.close()
    return _parse(bytes(raw))


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _split_head(raw: bytes) -> tuple[bytes, bytes] | None:
    """(head, rest) of a response, the head ended by a blank line (CRLF or, from lax servers, bare LF)."""
    for sep in (b"\r\n\r\n", b"\n\n"):
        head, found, rest = raw.partition(sep)
        if found:
            return head, rest
    return None


def _final(raw: bytes) -> tuple[str, list[str], bytes] | None:
    """The final response's status line, header lines and body so far, past any 1xx interim answers."""
    while True:
        split = _split_head(raw)
        if split is None:
            return None
        head, rest = split
        status_line, *header_lines = [line.rstrip("\r") for line in head.decode("latin-1").split("\n")]
        code = status_line.partition(" ")[2][:3]
        if not (code.isdigit() and 100 <= int(code) < 200):
            return status_line, header_lines, rest
        raw = rest  # 100 Continue and the like: the real answer follows


def _fields(header_lines: list[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    return fields


def _framing(raw: bytes) -> tuple[str, int, int] | None:
    """How the final answer in ``raw`` ends: ("length", n, body start), ("chunked", 0, body start) or
    ("close", 0, body start); None until its head is in."""
    final = _final(raw)
    if final is None:
        return None
    _, header_lines, body = final
    fields = _fields(header_lines)
    start = len(raw) - len(body)
    if "chunked" in fields.get("transfer-encoding", "").lower():
        return "chunked", 0, start
    length = fields.get("content-length", "")
    return ("length", int(length), start) if length.isdigit() else ("close", 0, start)


def _whole(raw: bytearray, framing: tuple[str, int, int]) -> bool:
    """Whether ``raw`` holds the whole answer by its framing (never for one that ends with the stream)."""
    how, length, start = framing
    if how == "length":
        return len(raw) - start >= length
    if how == "chunked" and raw.endswith(b"0\r\n\r\n"):
        try:
            _dechunk(bytes(raw[start:]))
        except HttpError:
            return False
        return True
    return False


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one whole HTTP/1.x response."""
    final = _final(raw)
    if final is None:
        raise HttpError("the answer ended before its headers did")
    status_line, header_lines, body = final
    proto, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not proto.startswith("HTTP/1.") or not code.isdigit():
        raise HttpError(f"not an HTTP answer: {status_line[:80]!r}")
    fields = _fields(header_lines)
    if "chunked" in fields.get("transfer-encoding", "").lower():
        body = _dechunk(body)
    elif "content-length" in fields:
        length = int(fields["content-length"])
        if len(body) < length:
            raise HttpError(f"the answer was cut off ({len(body)} of {length} bytes)")
        body = body[:length]
    return int(code), fields, body


def _dechunk(data: bytes) -> bytes:
    out: list[bytes] = []
    pos = 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            raise HttpError("the answer was cut off (chunked)")
        try:
            size = int(data[pos:end].split(b";")[0], 16)
        except ValueError:
            raise HttpError("a chunk size that is not a number") from None
        if size == 0:
            return b"".join(out)
        start = end + 2
        if len(data) < start + size:
            raise HttpError("the answer was cut off (chunked)")
        out.append(data[start : start + size])
        pos = start + size + 2


def _get_via_urllib(
    url: str, headers: dict[str, str], *, timeout_s: float, context: ssl.SSLContext | None
) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())
    except urllib.error.URLError as exc:
        reason = exc.reason
        raise reason if isinstance(reason, OSError) else OSError(str(reason)) from exc
