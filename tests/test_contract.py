"""The collector's OpenAPI document tells the truth (the contract).

The document is valid OpenAPI 3.1 and states enums, bounds, every error response and who needs a token;
schemathesis then drives the real ASGI app, with an admin token, on SQLite and on PostgreSQL, and checks
every response against the document: no server error, no status code, content type, header or body that
the document does not state. Examples are bounded so each backend takes well under a minute; set
WATTWATCH_CONTRACT_EXAMPLES (and WATTWATCH_CONTRACT_SEED) to search longer or elsewhere.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from sqlalchemy import Engine

from contract_rules import EQUALS_PATH, LISTED_IN, NOT_BEFORE, SPAN_MAX_S, keeps_stated_rules
from test_storage import CPU, GPUS, T0, batch, iv
from wattwatch.collector import create_app
from wattwatch.collector.contract import BEARER, OPEN_PATHS, PATTERN_HINTS, SINCE_PATTERN
from wattwatch.config import Settings
from wattwatch.protocol import limits, wire
from wattwatch.protocol.units import JOB_KINDS
from wattwatch.sim.clock import FakeClock
from wattwatch.storage import migrate, tokens
from wattwatch.storage.engine import make_engine

MAX_EXAMPLES = int(os.environ.get("WATTWATCH_CONTRACT_EXAMPLES", "60"))
SEED = int(os.environ.get("WATTWATCH_CONTRACT_SEED", "1"))
# A schema-valid request is accepted, or refused only for who sends it or what is stored (a 404 for an
# unknown job, a 409 for a reused key): never a 422, since the document states every rule of a body.
ACCEPTED_STATUSES = ["2xx", "401", "403", "404", "409"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Requests:
    """The app as schemathesis sees it: one ASGI callable for the whole module, forwarding requests to the
    app of the test running now (``app``). Lifespans are not forwarded: each test's TestClient runs its own
    app's, which starts once and stops when the test ends (schemathesis would keep it to the session's end)."""

    def __init__(self) -> None:
        self.app: FastAPI | None = None
        self.token = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            # Refusing before receiving anything is how an ASGI app says it has no lifespan.
            raise RuntimeError("each test runs its own app's lifespan")
        assert self.app is not None, "no test app is serving"
        await self.app(scope, receive, send)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def seed(client: TestClient, token: str) -> None:
    """Data for every report field to take a value: a training job with steps, an inference job with spans
    and a setup phase, idle energy, span energies computed."""
    setup = {wire.PHASE_LABEL: "setup", wire.PHASE_OF_LABEL: "srv-1"}
    jobs = [
        wire.Job(id="train-1", name="llama-ft", kind="training", started_at_s=T0, labels={"team": "nlp"}),
        wire.Job(id="proc-7", name="python", started_at_s=T0, ended_at_s=T0 + 2, labels=setup),
        wire.Job(id="srv-1", name="chat", kind="inference", started_at_s=T0 + 2, ended_at_s=T0 + 8),
    ]
    intervals = [iv("gpu0", T0 + t, 300.0, {"train-1": 1.0}) for t in range(8)]
    intervals += [iv("gpu1", T0 + t, 90.0, {"proc-7": 1.0}) for t in range(2)]
    intervals += [iv("gpu1", T0 + t, 250.0, {"srv-1": 1.0}) for t in range(2, 8)]
    intervals += [iv("cpu0", T0 + t, 40.0, {"train-1": 0.5}, idle_weight=0.5, source="estimate") for t in range(8)]
    queries = [wire.Query("srv-1", T0 + 2 + i, T0 + 3 + i, 100, 20) for i in range(5)]
    queries += [wire.Query("train-1", T0 + i, T0 + i + 1, kind="step") for i in range(8)]
    b = batch(1, devices=[*GPUS, CPU], jobs=jobs, intervals=intervals, queries=queries)
    r = client.post("/api/v1/ingest", content=wire.encode(b), headers=bearer(token))
    assert r.status_code == 200, r.text
    client.app.state.wattwatch.span_energy.run_once(settle_s=0.0)  # type: ignore[attr-defined]
    report = client.get("/api/v1/report", headers=bearer(token)).json()
    assert {j["id"] for j in report["jobs"]} == {"train-1", "srv-1"} and report["idle"]


CONFIG = SchemathesisConfig.from_dict(
    {
        # Bounded and reproducible: the same cases on every run unless WATTWATCH_CONTRACT_SEED changes.
        "seed": SEED,
        "generation": {"max-examples": MAX_EXAMPLES, "database": "none"},
        "checks": {"positive_data_acceptance": {"expected-statuses": ACCEPTED_STATUSES}},
    }
)


ROUTER = Requests()


def _load_schema() -> tuple[dict[str, Any], Any]:
    # Collection needs the document before any fixture runs: an app on a scratch SQLite file (no token yet)
    # serves it; test_the_document_tested_is_the_one_served holds it equal to what each test's app serves.
    with tempfile.TemporaryDirectory() as home:
        url = f"sqlite:///{home}/wattwatch.db"
        migrate.upgrade(url)
        engine = make_engine(url)
        try:
            ROUTER.app = create_app(Settings(home=Path(home)), engine, span_energy_interval_s=None)
            # schemathesis writes into its copy (inferred links); this one stays as served.
            document = TestClient(ROUTER.app).get("/openapi.json").json()
            return document, schemathesis.openapi.from_asgi("/openapi.json", ROUTER, config=CONFIG)
        finally:
            ROUTER.app = None
            engine.dispose()


DOCUMENT, schema = _load_schema()


# Rules JSON Schema cannot state: see contract_rules (the same filter the slow `schemathesis run` uses).
@schema.hook("filter_case")
def _keep_stated_rules(context: Any, case: Any) -> bool:
    return keeps_stated_rules(case.body, case.path_parameters or {})


@schema.auth(refresh_interval=None, retry_on=[])
class AdminToken:
    """Every request carries the running test's admin token. Given as schemathesis auth (not a fixed header)
    so its checks know which header is the credential: a case without it must be refused (ignored_auth)."""

    def get(self, case: Any, context: Any) -> str:
        return ROUTER.token

    def set(self, case: Any, data: str, context: Any) -> None:
        case.headers = {**(case.headers or {}), **bearer(data)}


@dataclass
class Served:
    """A collector with an admin token and seeded data, its lifespan running."""

    client: TestClient
    token: str


@pytest.fixture
def served(tmp_path: Path, db_engine: Engine) -> Iterator[Served]:
    admin = tokens.create_token(db_engine, "admin")[1]
    # The time window (limits.TimeWindow, tests/test_bounds.py) is a setting, not part of the document: opened
    # to every time the document allows, so schema-valid writes are stored and reach the database code.
    wide = {"time_window_past_s": limits.MAX_EPOCH_S, "time_window_future_s": limits.MAX_EPOCH_S}
    # The collector's clock an hour after the seeded data, so a report's default window (7 days) holds it.
    clock = FakeClock(T0 + 3600)
    app = create_app(Settings(home=tmp_path, **wide), db_engine, clock=clock, span_energy_interval_s=None)
    with TestClient(app) as client:
        seed(client, admin)
        ROUTER.app, ROUTER.token = app, admin
        try:
            yield Served(client, admin)
        finally:
            ROUTER.app, ROUTER.token = None, ""


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_every_response_is_as_documented(case: Any, served: Served) -> None:
    # Every check: no 5xx; status codes, content types, headers and bodies as documented; input outside the
    # document refused; a request without the token refused (ignored_auth).
    case.call_and_validate()


def test_stateful_sequences_follow_the_documented_links(served: Served) -> None:
    # Start a job, then read it, end it and post spans to it, by the id the answer names (the links).
    schema.as_state_machine().run(
        settings=settings(
            max_examples=max(MAX_EXAMPLES // 2, 5),
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
    )


def test_the_document_tested_is_the_one_served(served: Served) -> None:
    r = served.client.get("/openapi.json", headers=bearer(served.token))
    assert r.status_code == 200 and r.json() == DOCUMENT
    assert served.client.get("/openapi.json").status_code == 401  # a token exists now


# --- the document itself --------------------------------------------------------------------------------


@pytest.fixture
def document() -> dict[str, Any]:
    return DOCUMENT


def _operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            yield method, path, op


def test_document_is_valid_openapi_3_1(document: dict[str, Any]) -> None:
    # The OpenAPI Initiative's 3.1 schema as schemathesis ships it, then each JSON Schema in the document
    # against JSON Schema 2020-12 (OpenAPI 3.1's dialect), which the 3.1 schema leaves unchecked.
    from schemathesis.specs.openapi.definitions import OPENAPI_31

    assert document["openapi"].startswith("3.1.")
    jsonschema.Draft202012Validator(OPENAPI_31).validate(document)
    schemas = list(document["components"]["schemas"].values())
    for _, _, op in _operations(document):
        schemas += [p["schema"] for p in op.get("parameters", [])]
        for response in op["responses"].values():
            schemas += [c["schema"] for c in response.get("content", {}).values()]
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
    # A broken document is caught: the validation above is not vacuous.
    broken = {**document, "paths": {"/x": {"get": {"responses": {"200": {"content": "text"}}}}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(OPENAPI_31).validate(broken)


def test_document_states_enums_patterns_and_bounds(document: dict[str, Any]) -> None:
    params = {(path, p["name"]): p["schema"] for _, path, op in _operations(document) for p in op.get("parameters", [])}
    for path in ("/api/v1/jobs", "/api/v1/report"):
        kind = params[(path, "kind")]
        assert {"enum": list(JOB_KINDS), "type": "string"} in kind["anyOf"]
        since = params[(path, "since")]
        assert any(s.get("pattern") == SINCE_PATTERN for s in since["anyOf"])
    assert params[("/api/v1/jobs", "limit")]["maximum"] == 10_000
    schemas = document["components"]["schemas"]
    # Bounds come from the wire Structs (msgspec.Meta), so a bound added there is documented here.
    assert schemas["Interval"]["properties"]["energy_j"]["minimum"] == 0
    assert schemas["Job"]["properties"]["kind"]["enum"] == sorted(JOB_KINDS)
    assert schemas["QueryIn"]["properties"]["kind"]["enum"] == ["epoch", "query", "step"]
    assert schemas["Batch"]["properties"]["version"]["enum"] == [wire.WIRE_VERSION]
    assert schemas["JobEntry"]["properties"]["started_at"]["format"] == "date-time"
    assert "Content-Encoding" not in {name for _, name in params}  # HTTP's, stated in words and by 415


def test_every_operation_states_its_errors_and_its_security(document: dict[str, Any]) -> None:
    assert document["components"]["securitySchemes"][BEARER] == {
        **document["components"]["securitySchemes"][BEARER],
        "type": "http",
        "scheme": "bearer",
    }
    error_ref = {"$ref": "#/components/schemas/Error"}
    for method, path, op in _operations(document):
        statuses = set(op["responses"])
        assert "500" in statuses, (method, path)
        if path in OPEN_PATHS:
            assert op["security"] == [] and not {"401", "403"} & statuses, path
        else:
            assert op["security"] == [{BEARER: []}] and {"401", "403", "503"} <= statuses, (method, path)
            assert op["responses"]["401"]["headers"]["WWW-Authenticate"]["required"] is True
        for status, response in op["responses"].items():
            # The health checks' 503 is their own body (Readiness, Health): what a probe reads.
            if status.startswith(("4", "5")) and path not in ("/readyz", "/healthz"):
                assert response["content"] == {"application/json": {"schema": error_ref}}, (method, path, status)
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    writes = {path for method, path, _ in _operations(document) if method == "post"}
    for path in writes:
        assert "422" in document["paths"][path]["post"]["responses"], path
    for path in ("/api/v1/ingest", "/api/v1/jobs/{job_id}/queries"):
        assert {"409", "413", "415"} <= set(document["paths"][path]["post"]["responses"]), path


# --- what the document states, the app does -----------------------------------------------------------


OUTSIDE_THE_DOCUMENT = {
    "since=nan": "since",
    "since=inf": "since",
    "since=1e400s": "since",
    "since=-3d": "since",
    "since=7d%00": "since",
    "kind=": "kind",
    "kind=Training": "kind",
    "job=": "job",
    # A job may be named by its name, and names hold spaces: only NUL is outside.
    "job=a%00b": "job",
    "until=-3d": "until",
    "until=2026-02-30": "until",
    "since=2026-11-30T25:00Z": "since",
    "label==v": "label",
}


def test_parameters_outside_the_document_are_422_naming_them(served: Served) -> None:
    for query, field in OUTSIDE_THE_DOCUMENT.items():
        r = served.client.get(f"/api/v1/report?{query}", headers=bearer(served.token))
        assert r.status_code == 422 and r.json()["field"] == field, (query, r.text)
    r = served.client.get("/api/v1/jobs?since=1e3", headers=bearer(served.token))
    assert r.json()["error"] == "since: '1e3' is not " + PATTERN_HINTS["since"]
    for since in ("90s", "15m", "12h", "7d", "2w", "3600", "1.5h", "7D", "2026-11-30", "2026-11-30T08:00:00%2B01:00"):
        r = served.client.get(f"/api/v1/jobs?since={since}", headers=bearer(served.token))
        assert r.status_code == 200, (since, r.text)


def test_a_job_id_with_a_slash_is_addressable(served: Served) -> None:
    # Found by schemathesis' stateful run: ids may hold "/" (agents name Kubernetes jobs "ns/name"), and a
    # job the API creates must be one it can read, end and give spans.
    client, auth = served.client, bearer(served.token)
    r = client.post(
        "/api/v1/jobs", json={"id": "ns/pod-1", "name": "p", "host": "h1", "started_at_s": T0}, headers=auth
    )
    assert r.status_code == 200 and r.json()["id"] == "ns/pod-1"
    for path in ("/api/v1/jobs/ns/pod-1", "/api/v1/jobs/ns%2Fpod-1"):
        r = client.get(path, headers=auth)
        assert r.status_code == 200 and r.json()["id"] == "ns/pod-1", path
    r = client.post(
        "/api/v1/jobs/ns/pod-1/queries", json={"queries": [{"t_start_s": T0, "t_end_s": T0 + 1}]}, headers=auth
    )
    assert r.status_code == 200 and r.json()["accepted"] == 1
    r = client.post("/api/v1/jobs/ns/pod-1/end", json={"ended_at_s": T0 + 5}, headers=auth)
    assert r.status_code == 200 and r.json()["ended_at_s"] == T0 + 5
    assert client.get("/api/v1/jobs/ns/pod-2", headers=auth).status_code == 404


def test_framework_errors_answer_the_error_body(served: Served) -> None:
    client, admin = served.client, served.token
    r = client.delete("/api/v1/jobs", headers=bearer(admin))
    # Starlette's own 405 names only the first route's methods (here POST's), not the path's.
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST, HEAD"
    assert r.json()["field"] is None and "allowed: GET, POST" in r.json()["error"]
    r = client.get("/api/v2/nothing", headers=bearer(admin))
    assert r.status_code == 404 and set(r.json()) == {"error", "field"}


@pytest.mark.parametrize("action", ["end", "queries"])
def test_get_on_a_post_only_job_action_is_405(served: Served, action: str) -> None:
    # The id is a path, so without this GET /jobs/train-1/end would read as job "train-1/end" and be a 404.
    r = served.client.get(f"/api/v1/jobs/train-1/{action}", headers=bearer(served.token))
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    assert set(r.json()) == {"error", "field"}
    # A job whose own id ends in the action's name is still read as itself.
    created = served.client.post(
        "/api/v1/jobs",
        json={"id": f"ns/{action}", "name": "p", "host": "h1", "started_at_s": T0},
        headers=bearer(served.token),
    )
    assert created.status_code == 200
    assert served.client.get(f"/api/v1/jobs/ns/{action}", headers=bearer(served.token)).status_code == 200


def _stated_rules(node: Any, keyword: str) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    if isinstance(node, dict):
        for name, sub in (node.get("properties") or {}).items():
            for variant in [sub, *sub.get("anyOf", [])]:
                if keyword in variant:
                    found.add((name, variant[keyword]))
        for sub in node.values():
            found |= _stated_rules(sub, keyword)
    elif isinstance(node, list):
        for sub in node:
            found |= _stated_rules(sub, keyword)
    return found


def test_the_stated_rules_are_the_filtered_ones(document: dict[str, Any]) -> None:
    assert _stated_rules(document, "x-not-before") == set(NOT_BEFORE.items())
    assert _stated_rules(document, "x-equals-path") == set(EQUALS_PATH.items())
    assert _stated_rules(document, "x-listed-in") == set(LISTED_IN.items())
    assert _stated_rules(document, "x-lasts-at-most-s") == {("t_end_s", SPAN_MAX_S)}


def test_rules_the_schema_cannot_state_are_refused(served: Served) -> None:
    client, auth = served.client, bearer(served.token)
    r = client.post(
        "/api/v1/jobs",
        json={"id": "j", "name": "n", "host": "h1", "started_at_s": T0, "ended_at_s": T0 - 1},
        headers=auth,
    )
    assert r.status_code == 422 and r.json()["field"] == "ended_at_s", r.text
    span = {"t_start_s": T0 + 1, "t_end_s": T0}
    r = client.post("/api/v1/jobs/srv-1/queries", json={"queries": [span]}, headers=auth)
    assert r.status_code == 422 and r.json()["field"] == "queries[0].t_end_s", r.text
    span = {"t_start_s": T0, "t_end_s": T0 + 1, "job": "train-1"}
    r = client.post("/api/v1/jobs/srv-1/queries", json={"queries": [span]}, headers=auth)
    assert r.status_code == 422 and r.json()["field"] == "queries[0].job", r.text
    assert not keeps_stated_rules({"queries": [span]}, {"job_id": "srv-1"})
    assert keeps_stated_rules({"queries": [{**span, "job": "srv-1"}]}, {"job_id": "srv-1"})


def test_a_whole_number_written_as_a_float_is_an_integer(served: Served) -> None:
    # JSON Schema counts 1200.0 as an integer; the collector reads it as one, and still refuses 1200.5.
    client, auth = served.client, bearer(served.token)
    job = {"id": "p1", "name": "n", "host": "h1", "started_at_s": T0, "pid": 1200.0}
    r = client.post("/api/v1/jobs", json=job, headers=auth)
    assert r.status_code == 200, r.text
    r = client.post("/api/v1/jobs", json={**job, "pid": 1200.5}, headers=auth)
    assert r.status_code == 422 and r.json()["field"] == "pid", r.text


def test_an_empty_label_filter_is_refused_as_documented(served: Served) -> None:
    for bad in ("", "=v"):
        r = served.client.get("/api/v1/report", params={"label": bad}, headers=bearer(served.token))
        assert r.status_code == 422 and r.json()["field"] == "label", r.text
