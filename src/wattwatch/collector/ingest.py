"""``POST /api/v1/ingest``: what storing an agent batch takes, and a raw ASGI path to it in front of FastAPI.

``IngestHandler`` decodes, checks and stores one batch of an authenticated caller (``collector.guard``
authenticated it, before the body was read); the FastAPI route (``routes.py``,
which also gives the OpenAPI document its operation) and ``IngestFastPath`` both call it. The fast path
answers the same requests with the same bodies: every error is answered by the app's own exception
handlers (a 4xx or 503 with ``{"error", "field"}``), anything else propagates to the middleware that
answers a JSON 500. What it skips is FastAPI's routing, dependency injection and response encoding:
under load (benchmarks/load.py) they were an eighth of the collector's CPU for a route whose work is
already done by hand (its body is read raw and decoded with msgspec, its headers read directly).
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from wattwatch.carbon import grid
from wattwatch.collector.auth import Authenticator, Principal, principal_of
from wattwatch.collector.context import Context
from wattwatch.collector.errors import ApiError, Handlers, answer_with_handler
from wattwatch.collector.group_commit import QueueFull
from wattwatch.protocol import limits, wire
from wattwatch.storage import repository
from wattwatch.storage.group_ingest import Pending

INGEST_PATH = "/api/v1/ingest"
# Far above a real batch (an agent pushes every few seconds), far below what would hurt the collector.
MAX_BATCH_BYTES = 64 << 20
# Bodies up to this size are decoded in the event loop (about 1,500 intervals, a few ms).
INLINE_BATCH_BYTES = 256 << 10


def gunzip(body: bytes, limit_bytes: int) -> bytes:
    """Gunzip with a ceiling: a few kilobytes of gzip can expand to gigabytes (a "zip bomb")."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit_bytes)
    except zlib.error as exc:
        raise wire.WireError("body", f"Content-Encoding is gzip but the body is not valid gzip: {exc}") from None
    if inflater.unconsumed_tail:
        raise ApiError(413, f"batch is over {limit_bytes >> 20} MiB uncompressed; push smaller batches", "body")
    if not inflater.eof:
        raise wire.WireError("body", "Content-Encoding is gzip but the body is truncated")
    return out


class IngestHandler:
    """Store one agent batch: ``await handler(who, body, content_encoding)`` is the answer's body,
    or raises what answers the request (ApiError, BoundError, AgentIdTaken/KeyReused as a 409 ApiError, a
    database error)."""

    def __init__(self, ctx: Context, auth: Authenticator) -> None:
        self._ctx = ctx
        self._auth = auth
        self._window = ctx.settings.time_window()

    async def __call__(self, who: Principal, body: bytes, content_encoding: str | None) -> dict[str, Any]:
        """Decode, check and store ``who``'s batch; ``{"accepted", "duplicate", "intervals"}``."""
        ctx = self._ctx
        # A request waiting for its group's commit holds no thread (a thousand agents would otherwise queue
        # behind the thread pool's 40). A typical batch is checked here, in the event loop: decoding holds
        # the GIL wherever it runs, and the hop to the thread pool cost more than decoding 50 intervals.
        # A large or compressed body (that would hold up every other connection) is checked on the pool.
        if len(body) <= INLINE_BATCH_BYTES and not content_encoding:
            pending = self.checked(who, body, content_encoding)
        else:
            pending = await run_in_threadpool(self.checked, who, body, content_encoding)
        try:
            result = await ctx.writer.store(pending)
        except (repository.AgentIdTaken, repository.KeyReused) as exc:
            ctx.ingest.errors.inc()
            raise conflict(exc) from None
        except QueueFull as exc:
            # The agent keeps the batch spooled and sends it again after Retry-After (with jitter).
            raise ApiError(503, f"the collector is behind ({exc}); retry after Retry-After seconds", None, 1) from None
        if result.duplicate:
            ctx.ingest.duplicates.inc()
        else:
            ctx.ingest.batches.inc()
            ctx.ingest.intervals.inc(result.n_intervals)
        return {"accepted": True, "duplicate": result.duplicate, "intervals": result.n_intervals}

    def checked(self, who: Principal, body: bytes, content_encoding: str | None) -> Pending:
        """The request's batch, its writer checked (403), decoded, checked (415, 413, 422) and hashed."""
        ctx = self._ctx
        who.require_write(None)
        encoding = (content_encoding or "identity").strip().lower()
        if encoding not in ("identity", "gzip"):
            ctx.ingest.errors.inc()
            raise ApiError(
                415, f"Content-Encoding {encoding!r} is not supported; send identity or gzip", "Content-Encoding"
            )
        try:
            if len(body) > MAX_BATCH_BYTES:
                raise ApiError(413, f"batch is over {MAX_BATCH_BYTES >> 20} MiB; push smaller batches", "body")
            if encoding == "gzip":
                body = gunzip(body, MAX_BATCH_BYTES)
            batch = wire.decode_batch(body)
        except wire.WireError as exc:
            ctx.ingest.errors.inc()
            raise ApiError(422, exc.message, exc.field) from None
        except ApiError:
            ctx.ingest.errors.inc()
            raise
        who.require_write(batch.host, "host")
        if not isinstance(batch.grid_region, msgspec.UnsetType):
            try:
                canonical = grid.check_region(batch.grid_region)
            except grid.UnknownRegion as exc:
                ctx.ingest.errors.inc()
                raise ApiError(422, str(exc), "grid_region") from None
            exact = grid.exact_regions()
            if exact is not None and batch.grid_region not in exact:
                # Agents send the canonical spelling; the document lists exactly those (contract.py).
                ctx.ingest.errors.inc()
                raise ApiError(422, f"grid region {batch.grid_region!r}: send it as {canonical!r}", "grid_region")
        try:
            limits.check_batch_times(batch, ctx.clock(), self._window)  # a 422 naming the field: app.py
        except limits.BoundError:
            ctx.ingest.errors.inc()
            raise
        return Pending(batch, received_at_s=ctx.clock())


def conflict(exc: repository.AgentIdTaken | repository.KeyReused) -> ApiError:
    """The 409 for a batch refused for its identity."""
    if isinstance(exc, repository.AgentIdTaken):
        return ApiError(409, str(exc), "agent_id")
    return ApiError(409, str(exc), exc.field)


class IngestFastPath:
    """ASGI middleware: ``POST /api/v1/ingest`` straight to ``handler``; everything else to the app.

    It sits inside ``guard.WriteGuard``, which authenticated the request and bounds its body. ``handlers()``
    gives the app's exception handlers (``errors.answer_with_handler``); an exception none handles propagates.
    """

    def __init__(self, app: ASGIApp, *, handler: IngestHandler, auth: Authenticator, handlers: Handlers) -> None:
        self.app = app
        self._handler = handler
        self._auth = auth
        self._handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve an ingest POST; pass anything else on."""
        if (
            scope["type"] != "http"
            or scope["path"] != INGEST_PATH
            or scope["method"] != "POST"
            or scope.get("root_path")
        ):
            await self.app(scope, receive, send)
            return

        content_encoding = None
        for name, value in scope["headers"]:
            if name == b"content-encoding":  # the first, as Starlette's Headers.get
                content_encoding = value.decode("latin-1")
                break
        try:
            who = principal_of(scope) or self._auth.for_scope(scope)
            chunks = []
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client is gone: nobody to answer
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            del chunks
            answer = await self._handler(who, body, content_encoding)
        except Exception as exc:
            if not await answer_with_handler(self._handlers, exc, scope, receive, send):
                raise
            return
        payload = wire.encode(answer)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})
