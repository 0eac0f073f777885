"""The collector's HTTP server: uvicorn, with a deadline on reading each request and a connection limit.

uvicorn closes a connection idle between requests (``timeout_keep_alive``) but waits for ever on one that
never finishes its headers or its body, and its ``limit_concurrency`` answers 503 only once a request has
been read. Both let a caller hold the collector's sockets and memory without a token. ``GuardedProtocol``
is uvicorn's own httptools protocol with three additions at the connection's edge:

- the headers must arrive within ``header_timeout_s`` of the connection (or of the request's first byte
  on a kept-alive one), and the body within ``body_timeout_s`` of the headers; else the connection closes;
- beyond ``max_connections`` open at once, a new connection is answered 503 with ``Retry-After`` and closed
  before anything of it is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

# Agents push every few seconds over one kept-alive connection: uvicorn's default of 5 s would close it
# just as the next push (every 5 s by default) is sent.
KEEP_ALIVE_S = 75
# Seconds a busy collector asks an over-limit caller to wait (the agent adds jitter to it).
RETRY_AFTER_S = 1


def _busy_answer() -> bytes:
    body = json.dumps(
        {"error": "the collector has as many connections as it takes; retry after Retry-After seconds", "field": None}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        f"Retry-After: {RETRY_AFTER_S}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


_BUSY = _busy_answer()


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with read deadlines and a connection limit (the class attributes, set
    per server by ``protocol_class``)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Take the connection, or answer 503 and close it when the limit is reached."""
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_BUSY)
            transport.close()
            return
        self._arm(self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the deadline with the connection."""
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        """A request's first byte: its headers are due within ``header_timeout_s``."""
        super().on_message_begin()
        self._arm(self.header_timeout_s)

    def on_headers_complete(self) -> None:
        """Headers read: the body is due within ``body_timeout_s``."""
        super().on_headers_complete()
        self._arm(self.body_timeout_s)

    def on_message_complete(self) -> None:
        """The whole request read: no read deadline while the app answers."""
        self._disarm()
        super().on_message_complete()

    def _arm(self, timeout_s: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _read_timed_out(self) -> None:
        # A request not read in time holds a socket and a buffer for nothing: close it. An app reading the
        # body sees a disconnect; nothing was answered, so nothing is half sent.
        self._deadline = None
        if not self.transport.is_closing():
            log.debug("closing a connection whose request did not arrive in time")
            self.transport.close()


def protocol_class(*, header_timeout_s: float, body_timeout_s: float, max_connections: int) -> type[GuardedProtocol]:
    """A ``GuardedProtocol`` with these limits, for ``uvicorn.Config(http=...)``."""
    return type(
        "CollectorProtocol",
        (GuardedProtocol,),
        {
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "max_connections": max_connections,
        },
    )


# Descriptors kept for what is not a client connection: the database pool, log files, the agents' socket.
RESERVED_FDS = 256


def connection_limit(wanted: int) -> int:
    """The connection limit to serve with: ``wanted``, after raising the process's soft open-file limit
    towards its hard one to hold that many sockets; less (with a warning) where the hard limit is lower, so
    the server answers 503 instead of failing ``accept`` with EMFILE."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        fitted = max(1, soft - RESERVED_FDS)
        log.warning(
            "--max-connections %d needs %d open files but this process may open %d: serving at most %d "
            "connections; raise `ulimit -n` for more",
            wanted,
            needed,
            soft,
            fitted,
        )
        return fitted
    return wanted
