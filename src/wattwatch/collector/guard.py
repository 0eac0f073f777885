"""The collector's front door: a write request is authenticated, and its body bounded, before anything reads it.

``WriteGuard`` is a pure ASGI middleware in front of FastAPI (and of ``ingest.IngestFastPath``). For a write
(any method but GET, HEAD and OPTIONS under ``/api/``) it:

1. authenticates from the headers alone (``Authenticator.for_scope``) and requires a role that writes:
   a 401 or 403 is answered while the body is still on the wire, never read;
2. refuses a ``Content-Length`` over the route's limit (``body_limit_bytes``) with 413, unread;
3. counts a body as it arrives (chunked or not) and cuts it at the limit with 413 (``BodyTooLarge``).

The server discards what a client sends after the answer, so a refused body is never held: not while
the request runs and not after it. The Principal found is left in the scope (``PRINCIPAL``) for the routes.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wattwatch.collector.auth import PRINCIPAL, Authenticator
from wattwatch.collector.errors import ApiError, Handlers, answer_with_handler
from wattwatch.collector.ingest import INGEST_PATH, MAX_BATCH_BYTES

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class BodyTooLarge(ApiError):
    """A 413: the body is over the route's limit (raised from ``receive`` while it arrives)."""

    def __init__(self, limit_bytes: int, hint: str) -> None:
        super().__init__(413, f"body is over the limit of {_size(limit_bytes)}; {hint}", "body")


def body_limit_bytes(path: str) -> tuple[int, str]:
    """The largest body a write to ``path`` may send (``MAX_BATCH_BYTES`` on every route: a body over it
    is refused whatever it holds, one under it is checked field by field, a 422 naming what does not fit),
    and what to do instead of sending more."""
    if path == INGEST_PATH:
        return MAX_BATCH_BYTES, "push smaller batches"
    if path.startswith("/api/v1/jobs/") and path.endswith("/queries"):
        return MAX_BATCH_BYTES, "post fewer spans per call"
    return MAX_BATCH_BYTES, "send one job record per call"


def _size(n_bytes: int) -> str:
    return f"{n_bytes >> 20} MiB" if n_bytes >= 1 << 20 else f"{n_bytes} bytes"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            if not text.isdigit():
                raise ApiError(400, f"Content-Length: {text!r} is not a number of bytes", "Content-Length")
            return int(text)
    return None


class WriteGuard:
    """ASGI middleware: authenticate a write and bound its body before the app reads it (module docstring).

    ``handlers()`` gives the app's exception handlers, so a refusal is answered exactly as the routes answer
    it (``{"error", "field"}``; a database that cannot be read for tokens is a 503 saying why).
    """

    def __init__(self, app: ASGIApp, *, auth: Authenticator, handlers: Handlers) -> None:
        self.app = app
        self._auth = auth
        self._handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse a write with a bad token or an oversized body unread; pass anything else on."""
        if scope["type"] != "http" or scope["method"] in READ_METHODS or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        limit_bytes, hint = body_limit_bytes(scope["path"])
        try:
            # Reading the database's tokens (every refresh_s) is a blocking call: off the event loop.
            if self._auth.is_fresh():
                who = self._auth.for_scope(scope)
            else:
                who = await run_in_threadpool(self._auth.for_scope, scope)
            who.require_write(None)
            length = _content_length(scope)
            if length is not None and length > limit_bytes:
                raise ApiError(
                    413, f"body of {_size(length)} is over the limit of {_size(limit_bytes)}; {hint}", "body"
                )
        except Exception as exc:
            if not await answer_with_handler(self._handlers, exc, scope, receive, send):
                raise
            return
        received_bytes = 0

        async def bounded_receive() -> Message:
            nonlocal received_bytes
            message = await receive()
            if message["type"] == "http.request":
                received_bytes += len(message.get("body", b""))
                if received_bytes > limit_bytes:
                    raise BodyTooLarge(limit_bytes, hint)
            return message

        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app({**scope, PRINCIPAL: who}, bounded_receive, tracked_send)
        except BodyTooLarge as exc:
            # The app let it through (a route that does not answer ApiError itself): answer it here.
            if started:
                raise
            await answer_with_handler(self._handlers, exc, scope, receive, send)
