"""A bound on the requests each kind of route works on at once, so a crowd gets a quick 429 instead of
everyone a slow answer.

Reads (reports, job lists, /metrics) run database queries on the thread pool: 300 concurrent readers
all admitted meant a p99 of 12 s for every one of them. ``InFlightLimit`` admits up to ``max_reads``
reads and ``max_writes`` writes at a time (``Settings.max_reads``, ``max_writes``); one more is answered
at once with 429, ``Retry-After`` and the JSON error body, before anything of it is read. Write bodies
are bounded by ``collector.guard``, and agent batches again by the ingest queue
(``group_commit.MAX_QUEUED_BATCHES``, a 503). /healthz and /readyz are never limited: a probe must see a
busy collector as alive.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from wattwatch.collector.errors import ApiError, error_response

RETRY_AFTER_S = 1
UNLIMITED_PATHS = frozenset({"/healthz", "/readyz"})
READ_METHODS = frozenset({"GET", "HEAD"})


class InFlightLimit:
    """ASGI middleware: at most ``max_reads`` reads and ``max_writes`` writes at once (module docstring)."""

    def __init__(self, app: ASGIApp, *, max_reads: int, max_writes: int) -> None:
        self.app = app
        self.limits = {"read": max_reads, "write": max_writes}
        # One event loop runs every request's entry and exit here: plain counters need no lock.
        self.in_flight = {"read": 0, "write": 0}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        kind = "read" if scope["method"] in READ_METHODS else "write"
        if self.in_flight[kind] >= self.limits[kind]:
            busy = ApiError(
                429,
                f"the collector is answering {self.in_flight[kind]} {kind}s already; retry after Retry-After seconds",
                None,
                RETRY_AFTER_S,
            )
            await error_response(busy)(scope, receive, send)
            return
        self.in_flight[kind] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[kind] -= 1
