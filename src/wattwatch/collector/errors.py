"""The one exception routes raise to answer with an error (app.py turns it into JSON), the way raw ASGI code
in front of FastAPI answers an exception with the app's own handlers, and the middleware that answers every
other exception with a JSON 500."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# An app's exception handlers by exception class (FastAPI's ``app.exception_handlers``).
Handlers = Callable[[], dict[Any, Callable[..., Any]]]

log = logging.getLogger(__name__)


class ApiError(Exception):
    """Answer ``status`` with ``{"error": message, "field": field}``."""

    def __init__(self, status: int, message: str, field: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        # A 429 or 503 the caller should retry: sent as Retry-After.
        self.retry_after_s = retry_after_s


def error_response(exc: ApiError) -> JSONResponse:
    """``exc`` as its JSON answer; a 401 says which scheme to use (``WWW-Authenticate: Bearer``), a busy
    answer when to come back (``Retry-After``)."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    return JSONResponse({"error": exc.message, "field": exc.field}, status_code=exc.status, headers=headers or None)


async def answer_with_handler(handlers: Handlers, exc: Exception, scope: Scope, receive: Receive, send: Send) -> bool:
    """Answer ``exc`` with the app's handler for its class or a base, as Starlette looks them up; False when
    none takes it (Exception's handler, if any, answers 500s: the outer middleware's job)."""
    table = handlers()
    for cls in type(exc).__mro__:
        if cls is Exception:
            return False
        handle = table.get(cls)
        if handle is None:
            continue
        request = Request(scope, receive)
        if asyncio.iscoroutinefunction(handle):
            response = await handle(request, exc)
        else:
            response = await run_in_threadpool(handle, request, exc)
        await response(scope, receive, send)
        return True
    return False


class InternalErrorMiddleware:
    """Answers an exception no handler took with ``{"error": ..., "field": null}`` and status 500.

    The traceback goes to the collector's log, never to the client. And the request ends normally:
    Starlette's own last-resort handler re-raises after answering, and the server then closes the
    connection, so a client's next request on that keep-alive connection would be reset.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; answer a JSON 500 for an exception raised before the response started."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if started:
                raise  # part of a response is out: nothing sound can follow it on this connection
            body = {"error": "internal error; the collector's log has the details", "field": None}
            await JSONResponse(body, status_code=500)(scope, receive, send)
