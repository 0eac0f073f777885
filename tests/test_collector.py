"""The collector app in-process (FastAPI TestClient over the real ASGI app) on SQLite and PostgreSQL."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from procs import promtool_check
from test_storage import T0, WIDE_WINDOW_S, batch, iv, row_counts
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.errors import ConfigError
from wattwatch.protocol import wire
from wattwatch.sim.clock import FakeClock
from wattwatch.storage import repository
from wattwatch.storage.engine import make_engine


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    # The data is from T0 (2023) and some apps here run on the real clock: accept any time (test_bounds tests
    # the window).
    return Settings(
        home=tmp_path,
        grid_intensity_g_per_kwh=400.0,
        pue=1.0,
        metrics_retention_s=3600.0,
        time_window_past_s=WIDE_WINDOW_S,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0 + 100)


@pytest.fixture
def client(settings: Settings, db_engine: Engine, clock: FakeClock) -> Iterator[TestClient]:
    # No timer: tests run the span-energy pass themselves, so what they read never depends on timing.
    with TestClient(create_app(settings, db_engine, clock=clock, span_energy_interval_s=None)) as c:
        yield c


def compute_spans(client: TestClient) -> None:
    """Run the app's span-energy pass now, for everything received."""
    client.app.state.wattwatch.span_energy.run_once(settle_s=0.0)  # type: ignore[attr-defined]


def post_batch(client: TestClient, b: wire.Batch, headers: dict[str, str] | None = None) -> Any:
    return client.post(
        "/api/v1/ingest", content=wire.encode(b), headers={"Content-Type": "application/json", **(headers or {})}
    )


def sample_batch(seq: int = 1) -> wire.Batch:
    return batch(
        seq,
        jobs=[wire.Job(id="train-1", name="llama-ft", kind="training", started_at_s=T0)],
        intervals=[iv("gpu0", T0 + t, 300.0, {"train-1": 1.0}) for t in range(10)]
        + [iv("gpu1", T0 + t, 60.0, {}) for t in range(10)],
    )


def test_ingest_duplicate_and_report(client: TestClient, db_engine: Engine, clock: FakeClock) -> None:
    r = post_batch(client, sample_batch())
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": True, "duplicate": False, "intervals": 20}
    assert post_batch(client, sample_batch()).json() == {"accepted": True, "duplicate": True, "intervals": 0}
    report = client.get("/api/v1/report").json()
    # No since: the default window, stated in the answer.
    window = report.pop("window")
    assert window == {
        "since": "7d",
        "since_s": clock() - 7 * 86400,
        "since_at": "2023-11-07T22:15:00Z",
        "default": True,
    }
    assert report == repository.build_report(db_engine, now_s=clock(), since_s=window["since_s"], limit=1000)
    (job,) = report["jobs"]
    assert (job["id"], job["energy_j"], job["hosts"]) == ("train-1", 3000.0, ["h1"])
    assert report["idle"][0]["energy_j"] == 600.0


def _finished_job(seq: int, job_id: str, t0_s: float) -> wire.Batch:
    """A job of 10 s with 100 J per second on gpu0, and 10 J per second idle on gpu1."""
    return batch(
        seq,
        jobs=[wire.Job(id=job_id, name=job_id, kind="training", started_at_s=t0_s, ended_at_s=t0_s + 10)],
        intervals=[iv("gpu0", t0_s + t, 100.0, {job_id: 1.0}) for t in range(10)]
        + [iv("gpu1", t0_s + t, 10.0, {}) for t in range(10)],
    )


def test_report_pages_add_up_and_default_window(client: TestClient, clock: FakeClock) -> None:
    """Paging (limit, cursor) gives every job of the window once, in start order; idle on the first page;
    a job that ended before the default 7 days is left out until asked for with since."""
    day_s = 86400.0
    ids = [f"j{i}" for i in range(7)]
    for i, job_id in enumerate(ids):
        assert post_batch(client, _finished_job(i + 1, job_id, T0 - 3600 * (7 - i))).status_code == 200
    assert post_batch(client, _finished_job(100, "ancient", T0 - 9 * day_s)).status_code == 200
    pages: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = client.get("/api/v1/report", params=params).json()
        pages.append(page)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert [len(p["jobs"]) for p in pages] == [3, 3, 1]
    assert [j["id"] for p in pages for j in p["jobs"]] == ids  # "ancient" is outside the default window
    assert all(p["window"]["default"] for p in pages)
    # Idle once: 10 s x 10 J for each job in the window (the hours they fall in), on the first page only.
    assert [i["energy_j"] for i in pages[0]["idle"]] == [pytest.approx(100.0 * 7)]
    assert all(p["idle"] == [] for p in pages[1:])
    # Asked for, the older job is there, and the window says what was asked.
    wide = client.get("/api/v1/report", params={"since": "30d"}).json()
    assert [j["id"] for j in wide["jobs"]] == ["ancient", *ids]
    assert wide["window"]["default"] is False and wide["window"]["since"] == "30d"
    # One job: no window applies, whenever it ran.
    one = client.get("/api/v1/report", params={"job": "ancient"}).json()
    assert [j["id"] for j in one["jobs"]] == ["ancient"] and one["window"]["since_s"] is None


@pytest.mark.parametrize("cursor", ["bm90LWpzb24", "WzEsMl0", "!!"])
def test_report_bad_cursor_is_422(client: TestClient, cursor: str) -> None:
    r = client.get("/api/v1/report", params={"cursor": cursor})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "cursor"


def test_gzip_body(client: TestClient) -> None:
    body = gzip.compress(wire.encode(sample_batch()))
    r = client.post("/api/v1/ingest", content=body, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    assert r.json()["intervals"] == 20
    bad = client.post("/api/v1/ingest", content=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert (bad.status_code, bad.json()["field"]) == (422, "body")
    truncated = client.post("/api/v1/ingest", content=body[:-20], headers={"Content-Encoding": "gzip"})
    assert (truncated.status_code, truncated.json()["field"]) == (422, "body")
    bomb = gzip.compress(b" " * (65 << 20))  # 65 MiB of spaces gzip to ~65 KiB
    big = client.post("/api/v1/ingest", content=bomb, headers={"Content-Encoding": "gzip"})
    assert (big.status_code, big.json()["field"]) == (413, "body")
    br = client.post("/api/v1/ingest", content=b"{}", headers={"Content-Encoding": "br"})
    assert (br.status_code, br.json()["field"]) == (415, "Content-Encoding")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["intervals"][0].update(energy_j=-1.0), "intervals[0].energy_j"),
        (lambda d: d["intervals"][3].update(device="gpu9"), "intervals[3].device"),
        (lambda d: d.pop("seq"), "seq"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d["intervals"][1].update(t_end_s=T0 - 5), "intervals[1].t_end_s"),
        (
            lambda d: d["intervals"][0]["shares"].update({"train-1": "a lot"}),
            "intervals[0].shares[...]",
        ),  # msgspec's path for a dict value
        (lambda d: d["jobs"][0].update(kind="batch"), "jobs[0].kind"),
        (lambda d: d["devices"][0].pop("kind"), "devices[0].kind"),
    ],
)
def test_bad_batch_is_422_naming_the_field_and_stores_nothing(
    client: TestClient, db_engine: Engine, mutate: Any, field: str
) -> None:
    post_batch(client, sample_batch(1))
    before = row_counts(db_engine)
    doc = json.loads(wire.encode(sample_batch(2)))
    mutate(doc)
    r = client.post("/api/v1/ingest", content=json.dumps(doc))
    assert r.status_code == 422
    assert r.json()["field"] == field, r.json()
    assert r.json()["error"]
    assert row_counts(db_engine) == before
    metrics = client.get("/metrics").text
    assert "wattwatch_ingest_errors_total 1.0" in metrics


def test_not_json_is_422(client: TestClient, db_engine: Engine) -> None:
    r = client.post("/api/v1/ingest", content=b"{oops")
    assert (r.status_code, r.json()["field"]) == (422, "body")
    assert sum(row_counts(db_engine).values()) == 0


def test_job_routes(client: TestClient, clock: FakeClock) -> None:
    start = {"id": "srv-1", "name": "vllm", "kind": "inference", "started_at_s": T0, "host": "h1", "labels": {"m": "x"}}
    r = client.post("/api/v1/jobs", json=start)
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "vllm" and r.json()["running"] is True
    missing_host = client.post("/api/v1/jobs", json={k: v for k, v in start.items() if k != "host"})
    assert missing_host.status_code == 422 and "host" in missing_host.json()["error"]

    queries = {"queries": [{"t_start_s": T0 + 1, "t_end_s": T0 + 2, "tokens_in": 5, "tokens_out": 7}] * 4}
    assert client.post("/api/v1/jobs/srv-1/queries", json=queries).json() == {"accepted": 4}
    bad_q = {"queries": [{"t_start_s": T0 + 3, "t_end_s": T0 + 2}]}
    r = client.post("/api/v1/jobs/srv-1/queries", json=bad_q)
    assert (r.status_code, r.json()["field"]) == (422, "queries[0].t_end_s")
    r = client.post("/api/v1/jobs/srv-1/queries", json={"queries": [{"t_start_s": T0, "t_end_s": T0, "job": "x"}]})
    assert (r.status_code, r.json()["field"]) == (422, "queries[0].job")
    assert client.post("/api/v1/jobs/ghost/queries", json={"queries": []}).status_code == 404

    ended = client.post("/api/v1/jobs/srv-1/end", json={"ended_at_s": T0 + 50})
    assert ended.json()["ended_at_s"] == T0 + 50
    clock.t_s = T0 + 60
    client.post("/api/v1/jobs", json={**start, "id": "t-2", "kind": "training", "started_at_s": T0 + 10})
    assert client.post("/api/v1/jobs/t-2/end").json()["ended_at_s"] == T0 + 60  # no body: now

    job = client.get("/api/v1/jobs/srv-1").json()
    assert (job["queries"], job["tokens"], job["labels"]) == (4, 48, {"m": "x"})
    r = client.get("/api/v1/jobs/nope")
    assert r.status_code == 404 and r.json() == {"error": "no job 'nope'", "field": "job_id"}
    assert client.post("/api/v1/jobs/nope/end").status_code == 404

    assert [j["id"] for j in client.get("/api/v1/jobs").json()["jobs"]] == ["t-2", "srv-1"]
    assert [j["id"] for j in client.get("/api/v1/jobs?kind=inference&since=7d").json()["jobs"]] == ["srv-1"]
    assert [j["id"] for j in client.get("/api/v1/jobs?limit=1").json()["jobs"]] == ["t-2"]


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/api/v1/jobs?since=abc", "since"),
        ("/api/v1/jobs?kind=bogus", "kind"),
        ("/api/v1/jobs?limit=0", "limit"),
        ("/api/v1/report?since=-3d", "since"),
        ("/api/v1/report?kind=bogus", "kind"),
    ],
)
def test_bad_query_params_are_422_naming_the_param(client: TestClient, path: str, field: str) -> None:
    r = client.get(path)
    assert r.status_code == 422
    assert r.json()["field"] == field
    assert field in r.json()["error"]


def test_report_params(client: TestClient, clock: FakeClock) -> None:
    post_batch(client, sample_batch())
    clock.t_s = T0 + 10 * 86400
    assert client.get("/api/v1/report?since=7d").json()["jobs"][0]["id"] == "train-1"  # still running
    assert client.get("/api/v1/report?kind=inference").json()["jobs"] == []
    assert client.get("/api/v1/report?job=train-1").json()["jobs"][0]["duration_s"] == 10 * 86400


def test_bearer_token(settings: Settings, db_engine: Engine) -> None:
    app = create_app(replace(settings, token="s3cret"), db_engine)
    with TestClient(app) as c:
        r = post_batch(c, sample_batch())
        assert r.status_code == 401 and r.json()["field"] == "Authorization"
        assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/api/v1/report", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/metrics").status_code == 401
        ok = post_batch(c, sample_batch(), headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200


def test_health_and_readiness(client: TestClient, settings: Settings, tmp_path: Path) -> None:
    assert client.get("/healthz").json() == {"ok": True}
    assert client.get("/readyz").json() == {"ready": True}
    blank = tmp_path / "blank.db"
    blank.touch()
    engine = make_engine(f"sqlite:///{blank}")
    try:
        with TestClient(create_app(settings, engine)) as c:
            r = c.get("/readyz")
            assert r.status_code == 503 and "wattwatch db upgrade" in r.json()["error"]
            assert c.get("/healthz").status_code == 200
            ingest = post_batch(c, sample_batch())
            assert ingest.status_code == 503 and "wattwatch db upgrade" in ingest.json()["error"]
    finally:
        engine.dispose()


def test_openapi_documents_the_ingest_body(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/api/v1/ingest"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Batch"}
    schemas = spec["components"]["schemas"]
    assert {"Batch", "Interval", "Device", "Job", "Query", "JobStart", "QueriesIn"} <= set(schemas)
    assert "energy_j" in schemas["Interval"]["properties"]
    for path in ("/api/v1/jobs", "/api/v1/jobs/{job_id}", "/api/v1/report", "/metrics", "/healthz", "/readyz"):
        assert path in spec["paths"]


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics(client: TestClient, clock: FakeClock, tmp_path: Path) -> None:
    clock.t_s = T0 + 12  # the batch's ticks end at T0 + 10: its host pushed them 2 s ago
    post_batch(client, sample_batch())
    post_batch(client, sample_batch())  # duplicate
    client.post("/api/v1/jobs/train-1/queries", json={"queries": [{"t_start_s": T0, "t_end_s": T0 + 1}] * 3})
    client.post(
        "/api/v1/jobs/train-1/queries", json={"queries": [{"t_start_s": T0 + 2, "t_end_s": T0 + 4, "kind": "step"}]}
    )
    compute_spans(client)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = _families(r.text)
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    job = (("job_id", "train-1"), ("job_name", "llama-ft"), ("kind", "training"))
    assert value[("wattwatch_ingest_batches_total", ())] == 1
    assert value[("wattwatch_ingest_duplicates_total", ())] == 1
    assert value[("wattwatch_ingest_intervals_total", ())] == 20
    assert value[("wattwatch_ingest_errors_total", ())] == 0
    assert (
        value[("wattwatch_job_energy_joules_total", tuple(sorted((*job, ("host", "h1"), ("device_kind", "gpu")))))]
        == 3000
    )
    # Power now: the batch's last second of ticks (300 W), not the average since the start.
    assert value[("wattwatch_job_power_watts", tuple(sorted((*job, ("host", "h1")))))] == pytest.approx(300.0)
    assert value[("wattwatch_job_running", job)] == 1
    assert value[("wattwatch_job_queries_total", job)] == 3
    assert ("wattwatch_job_tokens_total", job) not in value  # no tokens: no always-zero series
    # Three queries shared the first second (300 J); the other nine seconds are waiting energy.
    assert value[("wattwatch_job_energy_per_query_joules", job)] == pytest.approx(100.0)
    for quantile in ("0.5", "0.95"):
        sample = value[("wattwatch_job_query_energy_joules", tuple(sorted((*job, ("quantile", quantile)))))]
        assert sample == pytest.approx(100.0, rel=0.002)
    assert value[("wattwatch_job_query_energy_joules_count", job)] == 3
    assert value[("wattwatch_job_query_energy_joules_sum", job)] == pytest.approx(300.0)
    assert value[("wattwatch_job_waiting_energy_joules", job)] == pytest.approx(2700.0)
    assert value[("wattwatch_job_steps_total", job)] == 1
    assert value[("wattwatch_job_energy_per_step_joules", job)] == pytest.approx(600.0)
    assert value[("wattwatch_job_emissions_grams_total", job)] == pytest.approx(3000 / 3.6e6 * 400)
    gpu1 = (("device", "gpu1"), ("device_kind", "gpu"), ("host", "h1"))
    gpu0 = (("device", "gpu0"), ("device_kind", "gpu"), ("host", "h1"))
    assert value[("wattwatch_idle_energy_joules_total", gpu1)] == 600
    assert ("wattwatch_idle_energy_joules_total", gpu0) not in value  # always held: no idle series
    assert value[("wattwatch_host_energy_joules_total", gpu0)] == 3000
    assert value[("wattwatch_host_energy_joules_total", gpu1)] == 600
    assert value[("wattwatch_host_last_seen_timestamp_seconds", (("host", "h1"),))] == T0 + 12
    assert value[("wattwatch_grid_intensity_grams_per_kwh", ())] == 400
    assert value[("wattwatch_pue", ())] == 1
    assert value[("wattwatch_collector_database_up", ())] == 1
    assert value[("wattwatch_collector_metrics_leader", ())] == 1
    # Prometheus' own scrape label never appears on our series.
    assert not any("job" in s.labels for f in fams.values() for s in f.samples)

    # A minute without a batch from its host: the job's power is unknown, not frozen at its last value.
    clock.t_s = T0 + 10 + 61
    assert "wattwatch_job_power_watts{" not in client.get("/metrics").text

    # A finished job leaves /metrics once the retention has passed; the host total keeps its energy.
    client.post("/api/v1/jobs/train-1/end", json={"ended_at_s": T0 + 10})
    clock.t_s = T0 + 10 + 3600 + 1
    later = client.get("/metrics").text
    assert 'job_id="train-1"' not in later
    assert 'wattwatch_host_energy_joules_total{device="gpu0",device_kind="gpu",host="h1"} 3000.0' in later
    promtool_check(r.text)


def test_metric_labels_allow_list(settings: Settings, db_engine: Engine, clock: FakeClock) -> None:
    # Only the labels the operator names become metric labels; a job without one gets "".
    labelled = replace(settings, metric_labels="team,app.kubernetes.io/name")
    with TestClient(create_app(labelled, db_engine, clock=clock, span_energy_interval_s=None)) as c:
        b = batch(
            1,
            jobs=[
                wire.Job(
                    id="a",
                    name="a",
                    kind="training",
                    started_at_s=T0,
                    labels={"team": "nlp", "app.kubernetes.io/name": "llama", "secret": "x"},
                ),
                wire.Job(id="b", name="b", kind="inference", started_at_s=T0),
            ],
            intervals=[iv("gpu0", T0, 100.0, {"a": 1.0}), iv("gpu1", T0, 50.0, {"b": 1.0})],
        )
        assert post_batch(c, b).status_code == 200
        samples = [s for f in _families(c.get("/metrics").text).values() for s in f.samples]
    running = {s.labels["job_id"]: s.labels for s in samples if s.name == "wattwatch_job_running"}
    assert running["a"]["team"] == "nlp" and running["a"]["app_kubernetes_io_name"] == "llama"
    assert running["b"]["team"] == "" and running["b"]["app_kubernetes_io_name"] == ""
    assert not any("secret" in s.labels for s in samples)
    energy = [s for s in samples if s.name == "wattwatch_job_energy_joules_total" and s.labels["job_id"] == "a"]
    assert energy and all(s.labels["team"] == "nlp" for s in energy)
    with pytest.raises(ConfigError, match="job_name"):
        create_app(replace(settings, metric_labels="job_name"), db_engine)


@pytest.mark.postgres
def test_replicas_export_database_totals_once(settings: Settings, pg_url: str, clock: FakeClock) -> None:
    # Two collectors on one PostgreSQL: exactly one exports the totals, so summing over replicas is exact;
    # when it goes away, the other takes over on its next scrape.
    engines = [make_engine(pg_url), make_engine(pg_url)]
    apps = [create_app(settings, e, clock=clock, span_energy_interval_s=None) for e in engines]
    try:
        with TestClient(apps[0]) as a, TestClient(apps[1]) as b:
            post_batch(a, sample_batch())

            def job_energy(c: TestClient) -> float:
                samples = [s for f in _families(c.get("/metrics").text).values() for s in f.samples]
                return sum(s.value for s in samples if s.name == "wattwatch_job_energy_joules_total")

            def leads(c: TestClient) -> float:
                return _families(c.get("/metrics").text)["wattwatch_collector_metrics_leader"].samples[0].value

            assert job_energy(a) + job_energy(b) == 3000
            assert (leads(a), leads(b)) == (1, 0)
            assert job_energy(b) == 0
            apps[0].state.metrics_leader.close()
            assert job_energy(b) == 3000 and leads(b) == 1
            assert leads(a) == 0 and job_energy(a) == 0
    finally:
        for e in engines:
            e.dispose()


def test_apps_do_not_share_metrics(settings: Settings, db_engine: Engine) -> None:
    with TestClient(create_app(settings, db_engine)) as a, TestClient(create_app(settings, db_engine)) as b:
        post_batch(a, sample_batch())
        assert "wattwatch_ingest_batches_total 1.0" in a.get("/metrics").text
        assert "wattwatch_ingest_batches_total 0.0" in b.get("/metrics").text


def test_spans_endpoint_takes_thousands_per_call_validates_all_first_and_feeds_the_pass(
    client: TestClient, db_engine: Engine, clock: FakeClock
) -> None:
    start = {"id": "srv", "name": "vllm", "kind": "inference", "started_at_s": T0, "host": "h1"}
    assert client.post("/api/v1/jobs", json=start).status_code == 200
    # 5000 queries of 0.5 s, ten starting every second over [T0, T0 + 500), plus 100 steps.
    spans: list[dict[str, Any]] = [
        {"t_start_s": T0 + i / 10, "t_end_s": T0 + i / 10 + 0.5, "tokens_in": 3, "tokens_out": 7} for i in range(5000)
    ]
    spans += [{"t_start_s": T0 + i, "t_end_s": T0 + i + 1, "kind": "step"} for i in range(100)]
    before = row_counts(db_engine)
    for mutate, field in [
        (lambda s: s[4321].update(t_end_s=T0 - 1), "queries[4321].t_end_s"),
        (lambda s: s[3].update(kind="batch"), "queries[3].kind"),
        (lambda s: s[5099].update(tokens_in=-1), "queries[5099].tokens_in"),
        (lambda s: s[7].update(job="other"), "queries[7].job"),
    ]:
        bad = json.loads(json.dumps(spans))
        mutate(bad)
        r = client.post("/api/v1/jobs/srv/queries", json={"queries": bad})
        assert (r.status_code, r.json()["field"]) == (422, field), r.json()
        assert row_counts(db_engine) == before  # nothing stored from a body with one bad span
    body = gzip.compress(json.dumps({"queries": spans, "host": "h1"}).encode())
    r = client.post("/api/v1/jobs/srv/queries", content=body, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.json() == {"accepted": 5100}, r.text
    r = client.post("/api/v1/jobs/srv/queries", content=b"{}", headers={"Content-Encoding": "br"})
    assert (r.status_code, r.json()["field"]) == (415, "Content-Encoding")

    # 100 W for the first 500 s, measured in 1 s ticks.
    ticks = [iv("gpu0", T0 + t, 100.0, {"srv": 1.0}) for t in range(500)]
    assert post_batch(client, batch(1, intervals=ticks)).status_code == 200
    assert client.get("/api/v1/jobs/srv").json()["queries_settled"] == 0
    clock.t_s = T0 + 1000
    compute_spans(client)
    job = client.get("/api/v1/jobs/srv").json()
    # Five queries in flight at every instant of [T0 + 0.5, T0 + 500): 100 W / 5 x 0.5 s = 10 J each.
    assert (job["query_method"], job["queries"], job["queries_settled"], job["steps"]) == ("spans", 5000, 5000, 100)
    assert job["energy_per_query_p50_j"] == pytest.approx(10.0, rel=0.002)
    assert job["energy_per_query_j"] == pytest.approx((50_000.0 - job["waiting_energy_j"]) / 5000)
    assert job["energy_per_token_j"] == pytest.approx(job["energy_per_query_j"] / 10)
    assert job["energy_per_step_j"] == pytest.approx(100.0)  # steps are shared among steps only
    assert job["waiting_energy_j"] == pytest.approx(0.0, abs=1e-6)  # a query is in flight from T0 on


def test_span_energy_runs_on_a_timer_and_once_more_at_shutdown(settings: Settings, db_engine: Engine) -> None:
    queries = [wire.Query(job="train-1", t_start_s=T0 + t, t_end_s=T0 + t + 1) for t in range(10)]
    clock = FakeClock(T0 + 100)
    app = create_app(settings, db_engine, clock=clock, span_energy_interval_s=0.05, span_energy_settle_s=1.0)
    with TestClient(app) as c:
        assert app.state.wattwatch.span_energy.running
        post_batch(c, msgspec.structs.replace(sample_batch(1), queries=queries))
        deadline = time.monotonic() + 20
        while c.get("/api/v1/jobs/train-1").json()["queries_settled"] < 10:
            assert time.monotonic() < deadline, "the timer never computed the spans"
            time.sleep(0.05)
        assert c.get("/api/v1/jobs/train-1").json()["energy_per_query_j"] == pytest.approx(300.0)
    assert not app.state.wattwatch.span_energy.running

    # A timer that would not fire for an hour: only the pass at shutdown can compute the new spans.
    app = create_app(settings, db_engine, clock=clock, span_energy_interval_s=3600.0, span_energy_settle_s=60.0)
    late = [wire.Query(job="train-1", t_start_s=T0 + 99, t_end_s=T0 + 99.5)]
    with TestClient(app) as c:
        post_batch(c, batch(2, queries=late, intervals=[iv("gpu0", T0 + 99, 50.0, {"train-1": 1.0})]))
        assert c.get("/api/v1/jobs/train-1").json()["queries_settled"] == 10
    job = repository.get_job(db_engine, "train-1", now_s=clock())
    assert job is not None and job["queries_settled"] == 11
    with pytest.raises(ValueError, match="positive"):
        create_app(settings, db_engine, span_energy_interval_s=0.0)


def test_phases_are_shown_with_their_job(client: TestClient, clock: FakeClock) -> None:
    # The energy a job's process drew before the job opened is the job's setup phase, not a job series.
    clock.t_s = T0 + 3
    setup = {wire.PHASE_LABEL: "setup", wire.PHASE_OF_LABEL: "srv"}
    b = batch(
        1,
        jobs=[
            wire.Job(id="proc-h1-7", name="python", kind="other", started_at_s=T0, ended_at_s=T0 + 1, labels=setup),
            wire.Job(id="srv", name="chat", kind="inference", started_at_s=T0 + 1),
        ],
        intervals=[iv("gpu0", T0, 80.0, {"proc-h1-7": 1.0}), iv("gpu0", T0 + 1, 300.0, {"srv": 1.0})],
    )
    assert post_batch(client, b).status_code == 200
    samples = [s for f in _families(client.get("/metrics").text).values() for s in f.samples]
    assert not any(s.labels.get("job_id") == "proc-h1-7" for s in samples)
    (phase,) = [s for s in samples if s.name == "wattwatch_job_phase_energy_joules_total"]
    assert phase.labels["job_id"] == "srv" and phase.labels["phase"] == "setup" and phase.value == 80
    energy = [s for s in samples if s.name == "wattwatch_job_energy_joules_total"]
    assert [(s.labels["job_id"], s.value) for s in energy] == [("srv", 300)]
    host = sum(s.value for s in samples if s.name == "wattwatch_host_energy_joules_total")
    idle = sum(s.value for s in samples if s.name == "wattwatch_idle_energy_joules_total")
    assert host == 380 and idle == 0  # job + phase + idle = measured
