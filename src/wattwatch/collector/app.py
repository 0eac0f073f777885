"""``create_app(settings)``: the collector as a FastAPI app. No module-level app or state.

Errors reach clients as JSON ``{"error": "...", "field": "..."}``: 422 for a body or parameter that
does not fit (``field`` is its dotted path), 413 for a body over its route's limit (``collector.guard``),
401 for a missing or unknown token, 403 for a token whose
role or host may not do this (``collector.auth``), 404 for an unknown job, 409 for an idempotency key
used with other content or an agent id of another host, 503 when the database is unreachable or
unmigrated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from wattwatch.collector import contract
from wattwatch.collector.auth import DEFAULT_REFRESH_S, Anonymous, Authenticator
from wattwatch.collector.bodies import OPENAPI_BODIES
from wattwatch.collector.context import Context
from wattwatch.collector.errors import ApiError, InternalErrorMiddleware, error_response
from wattwatch.collector.group_commit import GroupCommitter
from wattwatch.collector.guard import WriteGuard
from wattwatch.collector.ingest import IngestFastPath, IngestHandler
from wattwatch.collector.leader import MetricsLeader
from wattwatch.collector.load import InFlightLimit
from wattwatch.collector.metrics import build_registry
from wattwatch.collector.retention_scheduler import RetentionScheduler
from wattwatch.collector.routes import build_router
from wattwatch.collector.silent_scheduler import SilentHostScheduler
from wattwatch.collector.span_scheduler import DEFAULT_INTERVAL_S, SpanEnergyScheduler
from wattwatch.config import Settings
from wattwatch.errors import StorageError
from wattwatch.protocol.limits import BoundError
from wattwatch.storage.engine import check_schema, make_engine
from wattwatch.storage.span_energy import DEFAULT_SETTLE_S

log = logging.getLogger(__name__)

API_VERSION = "1"


def create_app(
    settings: Settings,
    engine: Engine | None = None,
    *,
    clock: Callable[[], float] = time.time,
    span_energy_interval_s: float | None = DEFAULT_INTERVAL_S,
    span_energy_settle_s: float = DEFAULT_SETTLE_S,
    local_token: str = "",
    anonymous: Anonymous = "anyone",
    token_refresh_s: float = DEFAULT_REFRESH_S,
    periodic: bool = True,
    fast_ingest: bool = True,
) -> FastAPI:
    """The collector app for ``settings``; stores into ``engine`` (default: one for ``settings.resolved_db_url``).

    The database must already be migrated (``wattwatch db upgrade``); ``/readyz`` says whether it is.
    ``clock`` (epoch seconds) is injectable so tests control "now" (receive times, metrics retention).
    While the app runs (its lifespan), per-span energies are computed every ``span_energy_interval_s``
    for data older than ``span_energy_settle_s``, and once more at shutdown; ``None`` turns that off
    (``app.state.wattwatch.span_energy.run_once()`` still computes on demand). Running jobs of hosts
    silent for ``settings.host_silent_after_s`` are ended by a periodic pass too
    (``app.state.silent_hosts``, a ``SilentHostScheduler``), and rows past ``settings.retention_days`` are
    pruned every 10 minutes (``app.state.retention``, a ``RetentionScheduler``; ``storage.retention``).

    Identity (``collector.auth``): ``settings.token`` is a static admin token, ``local_token`` the
    in-process agent's of ``wattwatch up``; ``anonymous`` says who may call without a token while none was
    ever configured: ``nobody`` (what ``wattwatch collector`` runs), ``loopback`` (``--open``: requests from
    this machine not through a proxy) or ``anyone`` (this function's default, for an app embedded in-process,
    as tests build it). The database's tokens are re-read every ``token_refresh_s``. Every write is
    authenticated and its body bounded before anything reads it (``collector.guard``: 401/403 unread, 413 for
    a body over 64 MiB, ``ingest.MAX_BATCH_BYTES``).

    ``fast_ingest=False`` leaves ``POST /api/v1/ingest`` to the FastAPI route (tests compare the two).

    ``periodic=False`` runs no periodic pass (span energy, silent hosts, retention): the other worker processes
    of ``wattwatch collector --workers N`` leave them to worker 0.
    """
    owns_engine = engine is None
    db = make_engine(settings.resolved_db_url) if engine is None else engine
    leader = MetricsLeader(db)
    registry, ingest_metrics = build_registry(db, settings, clock, leader)
    span_energy = SpanEnergyScheduler(db, clock=clock, interval_s=span_energy_interval_s, settle_s=span_energy_settle_s)
    silent_hosts = SilentHostScheduler(db, clock=clock, silent_after_s=settings.host_silent_after_s)
    retention = RetentionScheduler(db, settings, clock=clock, leader=leader)
    writer = GroupCommitter(db)
    ctx = Context(
        settings=settings,
        engine=db,
        registry=registry,
        ingest=ingest_metrics,
        clock=clock,
        span_energy=span_energy,
        writer=writer,
    )

    auth = Authenticator(
        db, static_token=settings.token, local_token=local_token, anonymous=anonymous, refresh_s=token_refresh_s
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(auth.preload)
        if periodic:
            span_energy.start()
            silent_hosts.start()
            retention.start()
        try:
            yield
        finally:
            # Off the event loop: the last pass talks to the database and may take a moment.
            await asyncio.to_thread(writer.stop)
            await asyncio.to_thread(silent_hosts.stop)
            await asyncio.to_thread(retention.stop)
            await asyncio.to_thread(span_energy.stop)
            leader.close()
            if owns_engine:
                db.dispose()

    app = FastAPI(
        title="wattwatch collector",
        version=API_VERSION,
        description="Energy of AI workloads: agents push measured intervals; reports and /metrics read rollups.",
        lifespan=lifespan,
        # Served below behind authentication: once tokens exist only /healthz and /readyz are open.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.wattwatch = ctx
    app.state.metrics_leader = leader
    app.state.silent_hosts = silent_hosts
    app.state.retention = retention
    app.state.auth = auth
    ingest = IngestHandler(ctx, auth)
    app.include_router(build_router(ctx, auth, ingest))
    _install_error_handlers(app, db)
    # Agent batches skip FastAPI's routing and dependency injection (collector.ingest); inside
    # InternalErrorMiddleware, so an exception no handler takes is answered the same JSON 500.
    if fast_ingest:
        app.add_middleware(IngestFastPath, handler=ingest, auth=auth, handlers=lambda: app.exception_handlers)
    # In front of both: a write's token and body size are checked before anything reads the body.
    app.add_middleware(WriteGuard, auth=auth, handlers=lambda: app.exception_handlers)
    app.add_middleware(InternalErrorMiddleware)
    # Outermost: a crowd is answered 429 before any token is checked or body read (collector.load).
    app.add_middleware(InFlightLimit, max_reads=int(settings.max_reads), max_writes=int(settings.max_writes))
    contract.install(app, OPENAPI_BODIES)
    _serve_docs(app, auth)
    return app


def _serve_docs(app: FastAPI, auth: Authenticator) -> None:
    """/openapi.json and /docs for any authenticated caller (everyone while the collector is open)."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(auth)])
    def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=[Depends(auth)])
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - API")


def _install_error_handlers(app: FastAPI, engine: Engine) -> None:
    async def api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def validation_error(_request: Request, exc: Exception) -> JSONResponse:
        # FastAPI's own parameter checks (e.g. limit=-1), reshaped like every other 422 here.
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": ("request",), "msg": "invalid request"}
        where = list(first.get("loc", ()))
        loc = [str(p) for p in where if p not in ("query", "path", "body", "header")]
        if where[:1] in (["query"], ["header"]):
            loc = loc[:1]  # a repeated parameter (label=…&label=…) is named, not numbered
        field = ".".join(loc) or "request"
        message = f"{field}: {first.get('msg', 'invalid')}"
        if first.get("type") == "string_pattern_mismatch" and field in contract.PATTERN_HINTS:
            # A regular expression tells a person little; say what a good value looks like.
            message = f"{field}: {first.get('input')!r} is not {contract.PATTERN_HINTS[field]}"
        return JSONResponse({"error": message, "field": field}, status_code=422)

    def database_error(_request: Request, exc: Exception) -> JSONResponse:
        # Sync handler: FastAPI runs it in the thread pool, and check_schema talks to the database.
        log.error("database error: %s", exc)
        try:
            check_schema(engine)
            message = "the database failed this request; see the collector's log"
        except StorageError as storage_exc:
            message = str(storage_exc)
        return JSONResponse({"error": message, "field": None}, status_code=503)

    async def storage_error(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc), "field": None}, status_code=503)

    async def bound_error(_request: Request, exc: Exception) -> JSONResponse:
        # A value outside wattwatch.protocol.limits that a route checked after decoding (a time outside the window,
        # a job end before its start): 422 naming the field, like a body that does not decode.
        assert isinstance(exc, BoundError)
        return JSONResponse({"error": exc.message, "field": exc.field}, status_code=422)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(BoundError, bound_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(SQLAlchemyError, database_error)
    app.add_exception_handler(StorageError, storage_error)
