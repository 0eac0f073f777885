"""The collector's OpenAPI document: what each route takes and answers, stated so a client can rely on it.

- Request bodies, response bodies and the ``Error`` body are msgspec Structs (``wire``, ``bodies``,
  ``responses``); their JSON Schemas go into the document's components as msgspec writes them, so a
  bound added to a Struct (``msgspec.Meta``) is in the document with no second place to edit.
- Query parameters that are enums or have a format (``kind``, ``since``, ``job``) are the ``Annotated``
  types below: FastAPI both checks them (422 naming the parameter) and documents them.
- Every error a route can answer is listed with the JSON ``Error`` schema (``responses``); routes that
  need a token say so (``security``: an HTTP bearer token); ``/metrics`` is Prometheus text, not JSON.
- Errors FastAPI/Starlette raise themselves (405 for a method a path lacks, 404 for no such path) answer
  the same ``Error`` body, and a 405's ``Allow`` lists every method of the path.

tests/test_contract.py validates the document against the OpenAPI 3.1 schema and runs schemathesis
against the real app on SQLite and PostgreSQL: no server error, every response as documented.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Path, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from wattwatch.carbon import grid
from wattwatch.collector.responses import RESPONSE_BODIES
from wattwatch.protocol import limits, wire
from wattwatch.protocol.units import TIME_EXAMPLES, TIME_PATTERN, JobKind

BEARER = "bearerToken"
# Routes anyone may call, with or without a token (load balancers and orchestrators probe them).
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
# What ``units.parse_time_s`` reads (``wattwatch report --since`` too): a duration back from now, a number
# and a unit (s, m, h, d, w) or bare seconds, or an ISO date. One pattern for the CLI and the API.
SINCE_PATTERN = TIME_PATTERN
REF = "#/components/schemas/{name}"


def _meta(typ: Any) -> msgspec.Meta:
    """The msgspec.Meta of an ``Annotated`` wire type, so parameters share its bounds."""
    return next(m for m in typing.get_args(typ)[1:] if isinstance(m, msgspec.Meta))


Since = Annotated[
    str | None,
    Query(
        pattern=SINCE_PATTERN,
        max_length=40,
        description="jobs still running or ended after this: a duration back from now, a number and a unit "
        "(s, m, h, d, w), e.g. 90s, 15m, 12h, 7d (bare: seconds), or an ISO date, e.g. 2026-11-30T08:00Z",
        examples=["7d"],
    ),
]
Until = Annotated[
    str | None,
    Query(
        pattern=SINCE_PATTERN,
        max_length=40,
        description="jobs started before this: a duration back from now or an ISO date, as `since`",
        examples=["2026-11-30"],
    ),
]
HostFilter = Annotated[
    str | None, Query(max_length=limits.MAX_NAME_CHARS, pattern=limits.NO_NUL, description="only jobs on this host")
]
NameGlob = Annotated[
    str | None,
    Query(
        max_length=limits.MAX_NAME_CHARS,
        pattern=limits.NO_NUL,
        description="only jobs whose name matches this shell glob (case-sensitive), e.g. llama-*",
    ),
]
# KEY=VALUE or KEY: a key is at least one character, so an empty item or one starting with "=" is refused.
LABEL_FILTER_PATTERN = r"^[^=\x00][^\x00]*$"
LabelFilter = Annotated[
    list[Annotated[str, Field(pattern=LABEL_FILTER_PATTERN)]] | None,
    Query(description="only jobs with this label: KEY=VALUE, or KEY for any value (repeatable; all must hold)"),
]
Kind = Annotated[JobKind | None, Query(description="only jobs of this kind")]
# A report page: at most ``limit`` jobs, after the job a previous page's ``next_cursor`` names; with neither
# ``since`` nor ``job``, the default window (stated in the answer's ``window``).
REPORT_DEFAULT_LIMIT = limits.REPORT_DEFAULT_LIMIT
REPORT_MAX_LIMIT = limits.REPORT_MAX_LIMIT
REPORT_DEFAULT_SINCE = limits.REPORT_DEFAULT_SINCE
CURSOR_PATTERN = limits.CURSOR_PATTERN
Limit = Annotated[
    int, Query(ge=1, le=REPORT_MAX_LIMIT, description="at most this many jobs on the page", examples=[100])
]
Cursor = Annotated[
    str | None,
    Query(
        pattern=CURSOR_PATTERN,
        max_length=600,
        description="the next_cursor of the previous page (same filters); absent: the first page",
    ),
]
_KEY = _meta(wire.Key)
_NAME = _meta(wire.Name)
# A job's id, a unique prefix of it, or its name (names may hold any character but NUL).
JobFilter = Annotated[
    str | None,
    Query(
        min_length=_NAME.min_length,
        max_length=_NAME.max_length,
        pattern=_NAME.pattern,
        description="only this job: its id, a unique prefix of its id, or its name",
    ),
]

# pydantic's regexes (Rust) take no look-ahead and need none: their `$` is the end of the text.
JobId = Annotated[
    str,
    Path(min_length=_KEY.min_length, max_length=_KEY.max_length, pattern=wire.KEY_CHARS, description="a job's id"),
]

# What a value of a parameter with a pattern looks like, for its 422 (app.py's validation handler).
_JOB_ID_HINT = "a job id: 1-200 characters of A-Za-z0-9_.:@/-"
PATTERN_HINTS = {
    "since": TIME_EXAMPLES,
    "until": TIME_EXAMPLES,
    "job": "a job's id, a unique prefix of it, or its name: 1-200 characters, no NUL",
    "job_id": _JOB_ID_HINT,
    "cursor": "a cursor: the next_cursor of the previous page, as given",
    "label": "KEY=VALUE or KEY (a key of at least one character, no NUL)",
}

_DESCRIPTIONS = {
    401: "No token, or a token unknown or revoked (once any token exists, every route but /healthz and "
    "/readyz needs one)",
    403: "The token's role may not do this (a reader writing, an agent reading), or an agent token "
    "writing for another host",
    404: "No such job",
    405: "A job's POST-only action (`/end`, `/queries`) asked for with another method; `Allow` says POST",
    409: "At odds with what is stored: an idempotency key (agent id and seq, or Idempotency-Key) reused with "
    "other content, an agent id that belongs to another host, a job's end before its recorded start, or a "
    "job reference that several stored jobs answer to",
    413: "The body is over the size limit (compressed or not)",
    415: "A Content-Encoding other than identity or gzip",
    422: "A body, parameter or header that does not fit; `field` names it",
    500: "An unexpected error; the collector's log says more",
    429: "The collector is answering as many requests of this kind as it takes at once; retry after "
    "`Retry-After` seconds",
    503: "The database is unreachable or not migrated to this collector's revision, or (ingest) the collector "
    "is behind and asks to retry after `Retry-After` seconds",
}


def error(status: int) -> dict[str, Any]:
    """The OpenAPI response object of an error ``status``: its meaning and the JSON ``Error`` body."""
    response: dict[str, Any] = {
        "description": _DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": REF.format(name="Error")}}},
    }
    if status == 401:
        response["headers"] = {
            "WWW-Authenticate": {"description": "always `Bearer`", "required": True, "schema": {"type": "string"}}
        }
    elif status in (429, 503):
        response["headers"] = {
            "Retry-After": {
                "description": "seconds to wait before retrying (on a busy answer)",
                "required": status == 429,
                "schema": {"type": "string"},
            }
        }
    elif status == 405:
        response["headers"] = {
            "Allow": {"description": "the methods the path takes", "required": True, "schema": {"type": "string"}}
        }
    return response


def responses(ok: str | None, *errors: int, secured: bool = True, ok_description: str = "") -> dict[int | str, Any]:
    """A route's ``responses=``: 200 with the ``ok`` schema (a ``responses`` Struct's name; None: the
    route states its own 200), each of ``errors``, 500, and 401/403/429 when the route needs a token."""
    out: dict[int | str, Any] = {}
    if ok is not None:
        out[200] = {
            "description": ok_description or "OK",
            "content": {"application/json": {"schema": {"$ref": REF.format(name=ok)}}},
        }
    # Any route can fail unexpectedly (500, JSON like every error); any but the health checks (the open
    # routes) can be busy (429, collector.load).
    statuses = {*errors, 500, *((401, 403, 429) if secured else ())}
    for status in sorted(statuses):
        out[status] = error(status)
    return out


PROMETHEUS_TEXT: dict[int | str, Any] = {
    200: {
        "description": "Prometheus text exposition format (what prometheus_client writes)",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}

DEAD_THREAD: dict[int | str, Any] = {
    503: {
        "description": "A worker thread died: the process is stopping (`dead_threads` names them)",
        "content": {"application/json": {"schema": {"$ref": REF.format(name="Health")}}},
    }
}

READINESS: dict[int | str, Any] = {
    200: {
        "description": "Ready",
        "content": {"application/json": {"schema": {"$ref": REF.format(name="Readiness")}}},
    },
    503: {
        "description": "Not ready: the database is unreachable or not migrated; `error` says which",
        "content": {"application/json": {"schema": {"$ref": REF.format(name="Readiness")}}},
    },
}


def _job_links() -> dict[str, Any]:
    # A job a response names can be read, ended and given spans: schemathesis' stateful tests follow these.
    ops = {
        "GetJob": "#/paths/~1api~1v1~1jobs~1{job_id}/get",
        "EndJob": "#/paths/~1api~1v1~1jobs~1{job_id}~1end/post",
        "AddSpans": "#/paths/~1api~1v1~1jobs~1{job_id}~1queries/post",
    }
    return {name: {"operationRef": ref, "parameters": {"job_id": "$response.body#/id"}} for name, ref in ops.items()}


# (method, path) of operations answering one job entry: they link to what can be done with that job.
_ANSWERS_A_JOB = (("post", "/api/v1/jobs"), ("post", "/api/v1/jobs/{job_id}/end"), ("get", "/api/v1/jobs/{job_id}"))


def openapi_document(app: FastAPI, bodies: dict[str, type]) -> dict[str, Any]:
    """The app's OpenAPI document: FastAPI's, plus the msgspec schemas of ``bodies`` (request bodies by
    name) and of the responses, the bearer scheme on every route but OPEN_PATHS, and links between job
    operations."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    _, components = msgspec.json.schema_components([*bodies.values(), *RESPONSE_BODIES], ref_template=REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    # FastAPI's own 422 shape is never sent (app.py reshapes validation errors into Error).
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(components)
    if "Batch" in schemas:
        # Batch.version is an int for a clear error on a newer agent; the only version accepted is this one.
        schemas["Batch"]["properties"]["version"] = {
            "type": "integer",
            "enum": [wire.WIRE_VERSION],
            "default": wire.WIRE_VERSION,
            "description": "the wire format's version; this collector speaks only this one",
        }
        regions = grid.exact_regions()
        if regions is not None:
            # The regions codecarbon's data knows, as agents spell them: any other is refused (ingest.py).
            schemas["Batch"]["properties"]["grid_region"]["enum"] = sorted(regions)
    doc["components"]["securitySchemes"] = {
        BEARER: {
            "type": "http",
            "scheme": "bearer",
            "description": "`wattwatch token create --role agent --host H | --role reader | --role admin`. "
            "Agents write (for their own host), readers read, admins do both. A collector with no token "
            "at all (and listening on loopback only) is open.",
        }
    }
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            op["security"] = [] if path in OPEN_PATHS else [{BEARER: []}]
            if (method, path) in _ANSWERS_A_JOB:
                op["responses"]["200"]["links"] = _job_links()
    return doc


def install(app: FastAPI, bodies: dict[str, type]) -> None:
    """Serve ``openapi_document`` as ``app.openapi()`` (built once) and answer FastAPI's own HTTP errors
    (no such path, method not allowed) with the ``Error`` body."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, bodies)
        return app.openapi_schema

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        if exc.status_code == 405:
            headers["Allow"] = _methods_of(app, request.url.path, headers.get("Allow", ""))
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {headers['Allow']}"
        elif exc.status_code == 404:
            message = f"no such path {request.url.path!r}; GET /openapi.json lists them"
        return JSONResponse({"error": message, "field": None}, status_code=exc.status_code, headers=headers)

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_exception_handler(StarletteHTTPException, http_error)


def _methods_of(app: FastAPI, path: str, fallback: str) -> str:
    """The ``Allow`` of ``path``: every method the document states for it (Starlette's own 405 names only the
    first matching route's methods: POST for /api/v1/jobs, which GET serves too); ``fallback`` for a path
    the document leaves out."""
    methods: set[str] = set()
    for template, item in app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\{[^/]+\\}", "[^/]+", re.escape(template)), path):
            methods |= {m.upper() for m in item}
    if not methods:
        return fallback
    return ", ".join([*sorted(methods), *(["HEAD"] if "GET" in methods else [])])
