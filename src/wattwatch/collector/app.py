"""``create_app(settings)``: the collector as a FastAPI app. No module-level app or state.

Errors reach clients as JSON ``{"error": "...", "field": "..."}``: 422 for a body or parameter that
does not fit (``field`` is its dotted path), 401 for a missing token, 404 for an unknown job, 503
when the database is unreachable or unmigrated.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from wattwatch.collector.bodies import OPENAPI_BODIES
from wattwatch.collector.errors import ApiError
from wattwatch.collector.leader import MetricsLeader
from wattwatch.collector.metrics import build_registry
from wattwatch.collector.routes import Context, build_router
from wattwatch.collector.silent_scheduler import SilentHostScheduler
from wattwatch.collector.span_scheduler import DEFAULT_INTERVAL_S, SpanEnergyScheduler
from wattwatch.config import Settings
from wattwatch.errors import StorageError
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
) -> FastAPI:
    """The collector app for ``settings``; stores into ``engine`` (default: one for ``settings.resolved_db_url``).

    The database must already be migrated (``wattwatch db upgrade``); ``/readyz`` says whether it is.
    ``clock`` (epoch seconds) is injectable so tests control "now" (receive times, metrics retention).
    While the app runs (its lifespan), per-span energies are computed every ``span_energy_interval_s``
    for data older than ``span_energy_settle_s``, and once more at shutdown; ``None`` turns that off
    (``app.state.wattwatch.span_energy.run_once()`` still computes on demand). Running jobs of hosts
    silent for ``settings.host_silent_after_s`` are ended by a periodic pass too
    (``app.state.silent_hosts``, a ``SilentHostScheduler``).
    """
    owns_engine = engine is None
    db = make_engine(settings.resolved_db_url) if engine is None else engine
    leader = MetricsLeader(db)
    registry, ingest_metrics = build_registry(db, settings, clock, leader)
    span_energy = SpanEnergyScheduler(db, clock=clock, interval_s=span_energy_interval_s, settle_s=span_energy_settle_s)
    silent_hosts = SilentHostScheduler(db, clock=clock, silent_after_s=settings.host_silent_after_s)
    ctx = Context(
        settings=settings, engine=db, registry=registry, ingest=ingest_metrics, clock=clock, span_energy=span_energy
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        span_energy.start()
        silent_hosts.start()
        try:
            yield
        finally:
            # Off the event loop: the last pass talks to the database and may take a moment.
            await asyncio.to_thread(silent_hosts.stop)
            await asyncio.to_thread(span_energy.stop)
            leader.close()
            if owns_engine:
                db.dispose()

    app = FastAPI(
        title="wattwatch collector",
        version=API_VERSION,
        description="Energy of AI workloads: agents push measured intervals; reports and /metrics read rollups.",
        lifespan=lifespan,
    )
    app.state.wattwatch = ctx
    app.state.metrics_leader = leader
    app.state.silent_hosts = silent_hosts
    app.include_router(build_router(ctx, _bearer_auth(settings.token)))
    _install_error_handlers(app, db)
    _document_bodies(app)
    return app


def _bearer_auth(token: str) -> Callable[[Request], None]:
    """A dependency that requires ``Authorization: Bearer <token>`` when a token is configured."""
    expected = f"Bearer {token}".encode()

    def require_token(request: Request) -> None:
        if not token:
            return
        given = request.headers.get("authorization", "").encode()
        # Constant-time compare: the token is the only thing between the internet and the database.
        if not hmac.compare_digest(given, expected):
            raise ApiError(
                401,
                "missing or wrong bearer token; send `Authorization: Bearer <token>` (the collector's WATTWATCH_TOKEN)",
                "Authorization",
            )

    return require_token


def _install_error_handlers(app: FastAPI, engine: Engine) -> None:
    async def api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"error": exc.message, "field": exc.field}, status_code=exc.status, headers=headers)

    async def validation_error(_request: Request, exc: Exception) -> JSONResponse:
        # FastAPI's own parameter checks (e.g. limit=-1), reshaped like every other 422 here.
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": ("request",), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body", "header")]
        field = ".".join(loc) or "request"
        return JSONResponse({"error": f"{field}: {first.get('msg', 'invalid')}", "field": field}, status_code=422)

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

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(SQLAlchemyError, database_error)
    app.add_exception_handler(StorageError, storage_error)


def _document_bodies(app: FastAPI) -> None:
    """Put msgspec's JSON Schemas of the request bodies into /openapi.json's components."""
    _, components = msgspec.json.schema_components(
        list(OPENAPI_BODIES.values()), ref_template="#/components/schemas/{name}"
    )

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
