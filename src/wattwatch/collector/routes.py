"""The collector's HTTP routes, built around one app's ``Context`` (no module-level state).

Routes that touch the database are plain ``def``: FastAPI runs them on its thread pool, so the
synchronous SQLAlchemy calls never block the event loop. Bodies are read raw and decoded with
msgspec (``wattwatch.protocol.wire``), which names the offending field of a bad body.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from wattwatch import vital
from wattwatch.carbon import policy as carbon_policy
from wattwatch.collector import contract
from wattwatch.collector.auth import Authenticator, Principal, principal_of
from wattwatch.collector.bodies import JobEnd, JobStart, QueriesIn
from wattwatch.collector.context import Context
from wattwatch.collector.errors import ApiError
from wattwatch.collector.ingest import MAX_BATCH_BYTES, IngestHandler, conflict, gunzip
from wattwatch.errors import StorageError
from wattwatch.protocol import limits, wire
from wattwatch.protocol.units import JOB_KINDS, iso_utc, parse_time_s
from wattwatch.storage import repository
from wattwatch.storage.engine import check_schema
from wattwatch.storage.job_refs import AmbiguousJob
from wattwatch.storage.reads import resolve_job

T = TypeVar("T")
# The last path segments of job routes that only POST serves.
POST_ONLY_ACTIONS = ("end", "queries")
JobId = contract.JobId
# Job ids may hold "/" (a wire Key: agents name Kubernetes jobs "ns/name"), so routes take the id as a
# ``path``: /api/v1/jobs/ns/name/end ends job "ns/name". The document still says ``{job_id}``.


async def _raw_body(request: Request) -> bytes:
    # Async so the endpoints can stay sync (thread pool) and still get the body.
    return await request.body()


RawBody = Annotated[bytes, Depends(_raw_body)]


def _body(schema: str, *, required: bool = True) -> dict[str, Any]:
    """openapi_extra documenting a raw body by its msgspec schema (see app._document_bodies)."""
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": ref}}}}


def _decode(body: bytes, typ: type[T]) -> T:
    try:
        return wire.decode_as(body, typ)
    except wire.WireError as exc:
        raise ApiError(422, exc.message, exc.field) from None


def _gunzip(body: bytes, limit_bytes: int) -> bytes:
    """Gunzip with a ceiling (``ingest.gunzip``)."""
    return gunzip(body, limit_bytes)


def _since_s(ctx: Context, since: str | None, field: str = "since") -> float | None:
    """``since`` / ``until`` as epoch seconds: the parser ``wattwatch report`` uses (``units.parse_time_s``)."""
    if since is None or since == "":
        return None
    try:
        return parse_time_s(since, ctx.clock())
    except ValueError as exc:
        raise ApiError(422, f"{field}: {exc}", field) from None


def _labels(items: list[str] | None) -> dict[str, str | None]:
    """``label=k=v`` (value must match) or ``label=k`` (key present), as ``wattwatch report --label``."""
    out: dict[str, str | None] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not key:
            raise ApiError(422, f"label: {item!r} is not KEY=VALUE or KEY", "label")
        out[key] = value if sep else None
    return out


def _kind(kind: str | None) -> str | None:
    if kind is None or kind == "":
        return None
    if kind not in JOB_KINDS:
        raise ApiError(422, f"kind: {kind!r} is not one of {', '.join(JOB_KINDS)}", "kind")
    return kind


# --- identity: who may call what -------------------------------------------------------------------------
# Reads (reports, jobs, /metrics) need a reader or admin token; writes an agent token for the host written
# (or admin): ``Principal.require_write`` checks the host where the route knows it. While no token exists
# the collector is open and everyone is allowed (``collector.auth``).
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=200,
        pattern=r"^[\x21-\x7e]+$",
        description="a retried post with the same key and spans is stored once",
    ),
]

# HTTP's own header, not an API parameter: the operations' descriptions and their 415 say what is taken.
ContentEncoding = Annotated[str | None, Header(alias="Content-Encoding", include_in_schema=False)]


def _writer(request: Request) -> Principal:
    # Module level, so the annotation below resolves. collector.guard authenticated the request before its
    # body was read and left the Principal in the scope; the app's Authenticator (its state) is the fallback.
    who = principal_of(request.scope)
    if who is not None:
        return who
    auth: Authenticator = request.app.state.auth
    return auth.writer(request)


Writer = Annotated[Principal, Depends(_writer)]


def _json(body: Any) -> Response:
    """``body`` (dicts, lists and scalars) as a JSON response, encoded by msgspec. FastAPI would walk it
    with jsonable_encoder first: 85 ms of a 100-job report page, more than building it."""
    return Response(content=wire.encode(body), media_type="application/json")


def _conflict(exc: repository.AgentIdTaken | repository.KeyReused) -> ApiError:
    return conflict(exc)


# --- end identity ------------------------------------------------------------------------------------------


def build_router(ctx: Context, auth: Authenticator, ingest_handler: IngestHandler) -> APIRouter:
    """Every route of the collector, bound to ``ctx``; ``auth`` guards all but the health checks;
    ``ingest_handler`` stores agent batches."""
    router = APIRouter()
    guarded = [Depends(auth.reader)]
    s = ctx.settings
    window = s.time_window()
    # Checked now, so a bad region, PUE or price stops the collector at start (ConfigError) with its name.
    carbon: dict[str, Any] = {"carbon": carbon_policy.from_settings(s)}

    @router.post(
        "/api/v1/ingest",
        openapi_extra=_body("Batch"),
        responses=contract.responses("IngestResult", 409, 413, 415, 422, 503),
        response_model=None,
        tags=["agents"],
    )
    async def ingest(who: Writer, body: RawBody, content_encoding: ContentEncoding = None) -> dict[str, Any]:
        """Store an agent batch (JSON, optionally gzip). Idempotent by (agent_id, seq); an agent id belongs to
        the first host that pushed it, and a key reused with other content is a 409."""
        # The app serves this path with ingest.IngestFastPath, in front of FastAPI, calling the same
        # handler; this route gives the OpenAPI document its operation and serves apps built without it.
        return await ingest_handler(who, body, content_encoding)

    @router.post(
        "/api/v1/jobs",
        openapi_extra=_body("JobStart"),
        responses=contract.responses("JobEntry", 422, 503),
        response_model=None,
        tags=["jobs"],
    )
    def start_job(who: Writer, body: RawBody) -> dict[str, Any]:
        """Record a job as one host sees it (sent at start, and again at end if the host likes)."""
        job = _decode(body, JobStart)
        who.require_write(job.host, "host")
        limits.check_job_times(job, ctx.clock(), window)
        repository.upsert_job(ctx.engine, job.host, job, now_s=ctx.clock())
        return _job_or_404(ctx, job.id, carbon)

    @router.post(
        "/api/v1/jobs/{job_id:path}/end",
        openapi_extra=_body("JobEnd", required=False),
        responses=contract.responses("JobEntry", 404, 409, 422, 503),
        response_model=None,
        tags=["jobs"],
    )
    def end_job(who: Writer, job_id: JobId, body: RawBody) -> dict[str, Any]:
        """Mark a job ended at ``ended_at_s`` (default: now). An agent token ends only jobs its host reported."""
        end = _decode(body, JobEnd) if body.strip() else JobEnd()
        if who.role == "agent":
            who.require_host_of(job_id, repository.job_host_names(ctx.engine, job_id))
        if end.ended_at_s is not None:
            window.check("ended_at_s", end.ended_at_s, ctx.clock())
        try:
            repository.end_job(ctx.engine, job_id, end.ended_at_s if end.ended_at_s is not None else ctx.clock())
        except repository.UnknownJob as exc:
            raise ApiError(404, str(exc), "job_id") from None
        except repository.EndsBeforeStart as exc:
            # A fine time in itself, at odds with the start the job already has: a conflict with what is
            # stored (409), as the document states, not a body outside its schema (422).
            raise ApiError(409, exc.message, exc.field) from None
        return _job_or_404(ctx, job_id, carbon)

    @router.post(
        "/api/v1/jobs/{job_id:path}/queries",
        openapi_extra=_body("QueriesIn"),
        responses=contract.responses("QueriesResult", 404, 409, 413, 415, 422, 503),
        response_model=None,
        tags=["jobs"],
    )
    def add_queries(
        who: Writer,
        job_id: JobId,
        body: RawBody,
        content_encoding: ContentEncoding = None,
        idempotency_key: IdempotencyKey = None,
    ) -> dict[str, Any]:
        """Record completed spans of a job: inference queries (tokens in/out), or training steps/epochs.

        Built for high request rates: thousands of spans per call (JSON, optionally gzip). The whole
        body is validated first, so a 422 (naming the field) stores nothing. Energy per span follows
        from the collector's next span-energy pass, as for spans in agent batches. With an
        ``Idempotency-Key`` header a retried post is stored once (``duplicate``: true); an agent token
        posts as its own host, for jobs its host reported.
        """
        encoding = (content_encoding or "identity").strip().lower()
        if encoding not in ("identity", "gzip"):
            raise ApiError(
                415, f"Content-Encoding {encoding!r} is not supported; send identity or gzip", "Content-Encoding"
            )
        if len(body) > MAX_BATCH_BYTES:
            raise ApiError(413, f"body is over {MAX_BATCH_BYTES >> 20} MiB; post fewer spans per call", "body")
        try:
            if encoding == "gzip":
                body = _gunzip(body, MAX_BATCH_BYTES)
        except wire.WireError as exc:
            raise ApiError(422, exc.message, exc.field) from None
        posted = _decode(body, QueriesIn)
        items = []
        for i, q in enumerate(posted.queries):
            if q.job is not None and q.job != job_id:
                raise ApiError(422, f"job {q.job!r} differs from the job in the path, {job_id!r}", f"queries[{i}].job")
            items.append(wire.Query(job_id, q.t_start_s, q.t_end_s, q.tokens_in, q.tokens_out, q.kind))
        host = who.require_write(posted.host, "host")
        if who.role == "agent":
            who.require_host_of(job_id, repository.job_host_names(ctx.engine, job_id))
        limits.check_span_times(posted.queries, ctx.clock(), window)
        try:
            n = repository.add_queries(
                ctx.engine, job_id, items, host=host, idempotency_key=idempotency_key, now_s=ctx.clock()
            )
        except repository.UnknownJob as exc:
            raise ApiError(404, str(exc), "job_id") from None
        except repository.KeyReused as exc:
            raise _conflict(exc) from None
        if idempotency_key is None:
            return {"accepted": n}
        return {"accepted": n, "duplicate": bool(items) and n == 0}

    @router.get(
        "/api/v1/jobs",
        dependencies=guarded,
        responses=contract.responses("JobList", 422, 503),
        response_model=None,
        tags=["jobs"],
    )
    def list_jobs(
        kind: contract.Kind = None,
        since: contract.Since = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = repository.DEFAULT_LIST_LIMIT,
    ) -> dict[str, Any]:
        """The newest jobs first, each as a report entry."""
        jobs = repository.list_jobs(
            ctx.engine, since_s=_since_s(ctx, since), kind=_kind(kind), limit=limit, now_s=ctx.clock(), **carbon
        )
        return {"jobs": jobs}

    @router.get(
        "/api/v1/jobs/{job_id:path}",
        dependencies=guarded,
        responses=contract.responses("JobEntry", 404, 405, 422, 503),
        response_model=None,
        tags=["jobs"],
    )
    def get_job(job_id: JobId) -> dict[str, Any]:
        """One job's report entry."""
        job = repository.get_job(ctx.engine, job_id, now_s=ctx.clock(), **carbon)
        if job is None:
            # The id is a path, so GET /jobs/x/end lands here: with no job "x/end", it names the POST-only
            # action of job "x", and the answer is the 405 its method deserves, not a 404 for the id.
            head, _, action = job_id.rpartition("/")
            if head and action in POST_ONLY_ACTIONS:
                raise StarletteHTTPException(405)
            raise ApiError(404, f"no job {job_id!r}", "job_id")
        return job

    @router.get(
        "/api/v1/report",
        dependencies=guarded,
        responses=contract.responses("Report", 409, 422, 503),
        response_model=None,
        tags=["reports"],
    )
    def report(
        since: contract.Since = None,
        job: contract.JobFilter = None,
        kind: contract.Kind = None,
        until: contract.Until = None,
        host: contract.HostFilter = None,
        name: contract.NameGlob = None,
        label: contract.LabelFilter = None,
        limit: contract.Limit = contract.REPORT_DEFAULT_LIMIT,
        cursor: contract.Cursor = None,
    ) -> Response:
        """The report of DESIGN.md: ``{"jobs": [...], "idle": [...]}``, with the filters applied, one page
        at a time (``limit``; ``cursor``: the ``next_cursor`` of the page before).

        ``job`` takes a job's id, a unique prefix of it or its name (409 listing the candidates when it
        names several); ``since``/``until`` a duration back from now or a date; ``name`` a shell glob;
        ``label`` (repeatable) ``KEY=VALUE`` or ``KEY``; ``host`` a host name. With none of ``since``,
        ``until`` and ``job`` it covers the last 7 days (``window`` says which window applied), so a report
        never reads all of history unless asked to."""
        job_id = None
        if job:
            try:
                job_id = resolve_job(ctx.engine, job) or job
            except AmbiguousJob as exc:
                # A well-formed reference that several stored jobs answer to: at odds with what is stored.
                raise ApiError(409, str(exc), "job") from None
        default = not since and not until and not job
        since = contract.REPORT_DEFAULT_SINCE if default else (since or None)
        since_s = _since_s(ctx, since)
        if since_s is not None:
            since_s = max(since_s, 0.0)  # "since 10,000 weeks" is since 1970: nothing was stored before
        try:
            report = repository.build_report(
                ctx.engine,
                since_s=since_s,
                until_s=_since_s(ctx, until, "until"),
                job_id=job_id,
                kind=_kind(kind),
                host=host or None,
                name=name or None,
                labels=_labels(label),
                now_s=ctx.clock(),
                limit=limit,
                cursor=cursor or None,
                **carbon,
            )
        except repository.BadCursor as exc:
            raise ApiError(422, f"cursor: {exc}", "cursor") from None
        report["window"] = {"since": since, "since_s": since_s, "since_at": iso_utc(since_s), "default": default}
        return _json(report)

    @router.get(
        "/api/v1/live",
        dependencies=guarded,
        responses=contract.responses("Live", 503),
        response_model=None,
        tags=["reports"],
    )
    def live() -> dict[str, Any]:
        """Power now per device of the hosts heard from lately, the running jobs holding each, and every
        running job's energy so far, J/query and J/step (what ``wattwatch top`` draws); O(running jobs +
        devices)."""
        from wattwatch.storage.live import live_view

        return live_view(ctx.engine, now_s=ctx.clock(), **carbon)

    @router.get(
        "/metrics",
        dependencies=guarded,
        response_class=PlainTextResponse,
        responses={**contract.PROMETHEUS_TEXT, **contract.responses(None, 503)},
        tags=["operations"],
    )
    def metrics() -> Response:
        """Prometheus text exposition of ingest counters and job, idle and host energy."""
        return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get(
        "/healthz",
        responses={**contract.responses("Health", secured=False), **contract.DEAD_THREAD},
        response_model=None,
        tags=["operations"],
    )
    async def healthz() -> JSONResponse:
        """The process is alive with every worker thread (says nothing about the database); 503 naming the
        threads that died, while the process stops."""
        dead = vital.DEATHS.dead
        if dead:
            return JSONResponse({"ok": False, "dead_threads": dead}, status_code=503)
        return JSONResponse({"ok": True})

    @router.get(
        "/readyz",
        responses={**contract.READINESS, **contract.responses(None, secured=False)},
        response_model=None,
        tags=["operations"],
    )
    def readyz() -> JSONResponse:
        """The database is reachable and migrated to this collector's revision."""
        try:
            check_schema(ctx.engine)
        except StorageError as exc:
            return JSONResponse({"ready": False, "error": str(exc)}, status_code=503)
        return JSONResponse({"ready": True})

    return router


def _job_or_404(ctx: Context, job_id: str, carbon: dict[str, Any]) -> dict[str, Any]:
    job = repository.get_job(ctx.engine, job_id, now_s=ctx.clock(), **carbon)
    if job is None:
        raise ApiError(404, f"no job {job_id!r}", "job_id")
    return job
