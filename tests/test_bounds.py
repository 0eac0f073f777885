"""Bad input at the collector (the real ASGI app on SQLite and PostgreSQL, with agent tokens): every value
outside ``wattwatch.protocol.limits`` is a 422 naming its field, nothing of its batch or post is stored, the two
backends answer alike, and the next good batch lands. Every bounded input, one by one."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select

from test_storage import T0, batch, iv, row_counts
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import limits, wire
from wattwatch.storage import tokens
from wattwatch.storage.tables import jobs, queries

NOW = T0 + 100.0  # the collector's clock; the good batch's data lies in [T0, T0 + 10]
DAY_S = 86400.0
Body = dict[str, Any]


@pytest.fixture
def token(db_engine: Engine) -> str:
    return tokens.create_token(db_engine, "agent", "h1")[1]


@pytest.fixture
def client(tmp_path: Path, db_engine: Engine, token: str) -> Iterator[TestClient]:
    """The collector, called with h1's agent token (reads: ``read(client)`` adds a reader token)."""
    app = create_app(
        Settings(home=tmp_path), db_engine, clock=lambda: NOW, span_energy_interval_s=None, token_refresh_s=0.0
    )
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as c:
        c.reader = {"Authorization": f"Bearer {tokens.create_token(db_engine, 'reader')[1]}"}  # type: ignore[attr-defined]
        yield c


def read(client: TestClient, path: str, **params: str) -> Any:
    """GET ``path`` as a reader (an agent token writes only)."""
    return client.get(path, params=params, headers=client.reader)  # type: ignore[attr-defined]


def good_batch(seq: int) -> Body:
    """A batch from h1 with a job, intervals, spans and a count window, all within the bounds."""
    b = batch(
        seq,
        jobs=[wire.Job(id="train-1", name="llama-ft", kind="training", started_at_s=T0, labels={"team": "nlp"})],
        intervals=[iv("gpu0", T0 + t, 300.0, {"train-1": 1.0}) for t in range(5)],
        queries=[wire.Query("train-1", T0 + 1, T0 + 2, tokens_in=5, tokens_out=7)],
        query_counts=[wire.QueryCount("train-1", T0, T0 + 5, queries=3)],
    )
    body: Body = msgspec.to_builtins(b)
    return body


def post(client: TestClient, body: Body | str) -> Any:
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post("/api/v1/ingest", content=content, headers={"Content-Type": "application/json"})


def _set(path: str, value: Any) -> Callable[[Body], None]:
    """A mutation setting ``path`` (``intervals.3.energy_j``) of a batch body to ``value``."""

    def mutate(body: Body) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[int(last) if last.isdigit() else last] = value

    return mutate


BAD_BATCHES: list[tuple[str, Callable[[Body], None], str]] = [
    ("tokens_in 2**31 (PostgreSQL's int4)", _set("queries.0.tokens_in", 2**31), "queries[0].tokens_in"),
    ("tokens_in 2**63 (SQLite's int64)", _set("queries.0.tokens_in", 2**63), "queries[0].tokens_in"),
    ("tokens_out 2**70", _set("queries.0.tokens_out", 2**70), "queries[0].tokens_out"),
    ("count 2**31", _set("query_counts.0.queries", 2**31), "query_counts[0].queries"),
    ("seq 2**63", _set("seq", 2**63), "seq"),
    ("device index 2**31", _set("devices.0.index", 2**31), "devices[0].index"),
    ("pid 2**31", _set("jobs.0.pid", 2**31), "jobs[0].pid"),
    ("GPU model of 201 characters", _set("devices.0.model", "H" * 201), "devices[0].model"),
    ("GPU uuid of 201 characters", _set("devices.0.uuid", "G" * 201), "devices[0].uuid"),
    ("host of 201 characters", _set("host", "h" * 201), "host"),
    ("job name of 201 characters", _set("jobs.0.name", "n" * 201), "jobs[0].name"),
    ("1.7e308 J in one interval", _set("intervals.3.energy_j", 1.7e308), "intervals[3].energy_j"),
    ("a power limit of 1e300 W", _set("devices.0.power_limit_w", 1e300), "devices[0].power_limit_w"),
    ("a share weight of 1e300", _set("intervals.0.shares", {"train-1": 1e300}), "intervals[0].shares[...]"),
    ("a 10 MB label", _set("jobs.0.labels", {"big": "x" * 10_000_000}), "jobs[0].labels[...]"),
    ("100k labels", _set("jobs.0.labels", {f"k{i}": "v" for i in range(100_000)}), "jobs[0].labels"),
    ("a label key of 513 characters", _set("jobs.0.labels", {"k" * 513: "v"}), "jobs[0].labels"),
    ("an interval from 1970 to 2286", _set("intervals.0.t_start_s", 0.0), "intervals[0].t_start_s"),
    ("an interval ending in 2286", _set("intervals.4.t_end_s", 1e10), "intervals[4].t_end_s"),
    ("a span in milliseconds", _set("queries.0.t_start_s", NOW * 1000), "queries[0].t_start_s"),
    ("an interval 2 days ahead", _set("intervals.4.t_end_s", NOW + 2 * DAY_S), "intervals[4].t_end_s"),
    ("a count window 31 days back", _set("query_counts.0.t_start_s", NOW - 31 * DAY_S), "query_counts[0].t_start_s"),
    ("a job start from 1970", _set("jobs.0.started_at_s", 1.0), "jobs[0].started_at_s"),
    ("sent in 2286", _set("sent_at_s", 9.9e9), "sent_at_s"),
    ("a job ending before its start", _set("jobs.0.ended_at_s", T0 - 10), "jobs[0].ended_at_s"),
    ("a span ending before its start", _set("queries.0.t_end_s", T0), "queries[0].t_end_s"),
    ("NUL in a job name", _set("jobs.0.name", "llama\x00ft"), "jobs[0].name"),
    ("NUL in the host", _set("host", "h\x001"), "host"),
    ("NUL in a GPU model", _set("devices.0.model", "H100\x00"), "devices[0].model"),
    ("NUL in a label value", _set("jobs.0.labels", {"team": "n\x00lp"}), "jobs[0].labels[...]"),
    ("NUL in a label key", _set("jobs.0.labels", {"te\x00am": "nlp"}), "jobs[0].labels"),
    ("a flag of 300 characters", _set("intervals.0.flags", ["x" * 300]), "intervals[0].flags[0]"),
    ("nine flags", _set("intervals.0.flags", [f"f{i}" for i in range(9)]), "intervals[0].flags"),
    # A pattern's `$` also matches before a final newline (Python's re, which msgspec uses): not here.
    ("a job id ending in a newline", _set("jobs.0.id", "train-1\n"), "jobs[0].id"),
    ("a device key ending in a newline", _set("devices.0.key", "gpu0\n"), "devices[0].key"),
    ("a share's job id ending in a newline", _set("intervals.0.shares", {"train-1\n": 1.0}), "intervals[0].shares"),
    ("a flag ending in a newline", _set("intervals.0.flags", ["clamped\n"]), "intervals[0].flags[0]"),
    ("a grid region ending in a newline", _set("grid_region", "FR\n"), "grid_region"),
    ("who ended a job, ending in a newline", _set("jobs.0.ended_by", "exit\n"), "jobs[0].ended_by"),
]


@pytest.mark.parametrize(("mutate", "field"), [(m, f) for _, m, f in BAD_BATCHES], ids=[c[0] for c in BAD_BATCHES])
def test_a_bad_batch_is_a_422_naming_the_field_stores_nothing_and_the_next_lands(
    client: TestClient, db_engine: Engine, mutate: Callable[[Body], None], field: str
) -> None:
    assert post(client, good_batch(1)).status_code == 200
    before = row_counts(db_engine)
    bad = good_batch(2)
    mutate(bad)
    r = post(client, bad)
    assert (r.status_code, r.json()["field"]) == (422, field), r.text[:500]
    assert r.json()["error"] and "Traceback" not in r.text
    assert row_counts(db_engine) == before  # the whole batch refused, atomically
    # Nothing of it was claimed either: a good batch under the same seq is stored.
    r = post(client, good_batch(2))
    assert r.json() == {"accepted": True, "duplicate": False, "intervals": 5}
    assert row_counts(db_engine)["raw_batches"] == before["raw_batches"] + 1  # holding its 5 intervals


@pytest.mark.parametrize("number", ["1e400", "-1e400", "NaN", "Infinity"])
def test_numbers_json_cannot_hold_are_a_422(client: TestClient, db_engine: Engine, number: str) -> None:
    text = json.dumps(good_batch(1)).replace('"energy_j": 300.0', f'"energy_j": {number}', 1)
    r = post(client, text)
    assert r.status_code == 422 and r.json()["field"] in ("intervals[0].energy_j", "body"), r.text
    assert row_counts(db_engine)["raw_batches"] == 0
    assert post(client, good_batch(1)).status_code == 200


def test_the_bounds_themselves_are_accepted(client: TestClient, db_engine: Engine) -> None:
    """The largest value of each bound is stored on both backends (PostgreSQL's columns hold them)."""
    body = good_batch(1)
    _set("queries.0.tokens_in", limits.MAX_TOKENS)(body)
    _set("query_counts.0.queries", limits.MAX_COUNT)(body)
    _set("seq", limits.MAX_SEQ)(body)
    _set("devices.0.index", limits.MAX_DEVICE_INDEX)(body)
    _set("devices.0.model", "🚀" * limits.MAX_NAME_CHARS)(body)
    _set("jobs.0.name", "ノ" * limits.MAX_NAME_CHARS)(body)
    _set("intervals.0.energy_j", limits.MAX_ENERGY_J)(body)
    _set("intervals.1.energy_j", limits.MAX_ENERGY_J)(body)
    _set("intervals.0.flags", ["f" * limits.MAX_FLAG_CHARS] * limits.MAX_FLAGS)(body)
    _set("jobs.0.labels", {f"{i:0{limits.MAX_LABEL_KEY_CHARS}d}": "v" * 1024 for i in range(limits.MAX_LABELS)})(body)
    r = post(client, body)
    assert r.status_code == 200, r.text[:500]
    job = read(client, "/api/v1/jobs/train-1").json()
    assert job["name"] == "ノ" * 200 and job["energy_j"] == pytest.approx(2 * limits.MAX_ENERGY_J + 900.0)
    with db_engine.connect() as conn:
        assert conn.execute(select(queries.c.tokens_in)).scalar_one() == limits.MAX_TOKENS


@pytest.mark.parametrize("since", ["nan", "inf", "-inf", "1e400s", "infd", "NaNh", "-5m", "soon"])
def test_report_since_that_is_no_duration_is_a_422(client: TestClient, since: str) -> None:
    for path in ("/api/v1/report", "/api/v1/jobs"):
        r = read(client, path, since=since)
        assert (r.status_code, r.json()["field"]) == (422, "since"), r.text


def test_report_kind_and_job_params_are_bounded(client: TestClient) -> None:
    assert post(client, good_batch(1)).status_code == 200
    for params, field in (({"kind": "x\x00"}, "kind"), ({"kind": "batch"}, "kind"), ({"job": "a\x00b"}, "job")):
        r = read(client, "/api/v1/report", **params)
        assert (r.status_code, r.json()["field"]) == (422, field), r.text
    assert read(client, "/api/v1/report", job="j" * 201).status_code == 422
    assert [j["id"] for j in read(client, "/api/v1/report", job="train-1").json()["jobs"]] == ["train-1"]


def _start(client: TestClient, **fields: Any) -> Any:
    return client.post("/api/v1/jobs", json={"id": "serve-1", "name": "chat", "host": "h1", **fields})


_ids = iter(range(10**9))


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"name": "n" * 201}, "name"),
        ({"name": "a\x00b"}, "name"),
        ({"labels": {f"k{i}": "v" for i in range(100_000)}}, "labels"),
        ({"labels": {"big": "x" * 10_000_000}}, "labels[...]"),
        ({"started_at_s": 1.0}, "started_at_s"),
        ({"started_at_s": NOW + 2 * DAY_S}, "started_at_s"),
        ({"started_at_s": NOW * 1000}, "started_at_s"),
        ({"started_at_s": NOW - 10, "ended_at_s": NOW - 20}, "ended_at_s"),
        ({"pid": 2**31}, "pid"),
    ],
)
def test_a_bad_job_start_is_a_422_and_stores_nothing(
    client: TestClient, db_engine: Engine, fields: dict[str, Any], field: str
) -> None:
    before = row_counts(db_engine)
    r = _start(client, **fields)
    assert (r.status_code, r.json()["field"]) == (422, field), r.text[:300]
    assert row_counts(db_engine) == before
    assert _start(client, started_at_s=NOW - 10).status_code == 200


def test_a_long_run_may_report_a_start_beyond_the_window(client: TestClient) -> None:
    r = _start(client, started_at_s=NOW - 90 * DAY_S, ended_at_s=NOW - 1)  # a 90-day training run's end record
    assert r.status_code == 200 and r.json()["duration_s"] == pytest.approx(90 * DAY_S - 1)
    assert _start(client, started_at_s=NOW - limits.MAX_JOB_AGE_S - DAY_S).json()["field"] == "started_at_s"


def test_a_job_cannot_end_before_it_starts(client: TestClient, db_engine: Engine) -> None:
    assert _start(client, started_at_s=NOW - 50).status_code == 200
    # A time fine in itself but at odds with the stored start is a conflict (409, as the document states);
    # one outside the time window is refused as such (422).
    for ended_at_s, status in ((NOW - 100, 409), (1.0, 422), (0.0, 422)):
        r = client.post("/api/v1/jobs/serve-1/end", json={"ended_at_s": ended_at_s})
        assert (r.status_code, r.json()["field"]) == (status, "ended_at_s"), r.text
    with db_engine.connect() as conn:  # neither its start moved back nor an end stored
        assert conn.execute(select(jobs.c.started_at_s, jobs.c.ended_at_s)).one() == (NOW - 50, None)
    r = client.post("/api/v1/jobs/serve-1/end", json={"ended_at_s": NOW - 10})
    assert r.status_code == 200 and r.json()["duration_s"] == 40.0


def test_one_bad_span_refuses_the_whole_post_and_the_next_lands(client: TestClient, db_engine: Engine) -> None:
    assert _start(client, started_at_s=NOW - 50).status_code == 200
    good = [{"t_start_s": NOW - 40 + i, "t_end_s": NOW - 39 + i, "tokens_in": 3} for i in range(3)]
    for i, bad, field in (
        (1, {"tokens_in": 2**31}, "tokens_in"),
        (2, {"t_start_s": (NOW - 5) * 1000, "t_end_s": NOW * 1000}, "t_start_s"),
        (0, {"t_start_s": NOW - 40 * DAY_S}, "t_start_s"),
        (1, {"t_end_s": NOW - 45}, "t_end_s"),
        (2, {"kind": "batch"}, "kind"),
    ):
        spans = [dict(s) for s in good]
        spans[i].update(bad)
        r = client.post("/api/v1/jobs/serve-1/queries", json={"queries": spans, "host": "h1"})
        assert (r.status_code, r.json()["field"]) == (422, f"queries[{i}].{field}"), r.text
    with db_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(queries)).scalar() == 0
    r = client.post("/api/v1/jobs/serve-1/queries", json={"queries": good, "host": "h1"})
    assert r.json() == {"accepted": 3}


TEXT = st.characters(codec="utf-8", exclude_characters="\x00")  # what JSON can carry, less NUL
NAMES = st.text(TEXT, min_size=1, max_size=limits.MAX_NAME_CHARS)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=NAMES, label=st.text(TEXT, max_size=50))
@example(name="x'); DROP TABLE jobs; --", label="' OR 1=1 --")
@example(name="モデル-ü-🚀", label="\\u0000 is six characters here")
@example(name="🚀" * limits.MAX_NAME_CHARS, label="")
def test_sql_shaped_and_unicode_names_round_trip_as_text(client: TestClient, name: str, label: str) -> None:
    job_id = f"job-{next(_ids)}"
    r = _start(client, id=job_id, name=name, labels={"note": label}, started_at_s=NOW - 10)
    assert r.status_code == 200, r.text[:300]
    got = read(client, f"/api/v1/jobs/{job_id}").json()
    assert got["name"] == name and got["labels"] == {"note": label}


def test_one_character_over_is_refused_on_both_backends(client: TestClient) -> None:
    r = _start(client, name="🚀" * (limits.MAX_NAME_CHARS + 1))
    assert (r.status_code, r.json()["field"]) == (422, "name")


def test_a_lone_surrogate_is_a_422_not_a_database_error(client: TestClient) -> None:
    body = '{"id": "serve-1", "name": "a\\ud800b", "host": "h1"}'  # JSON's escape of half a character
    r = client.post("/api/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()["field"]) == (422, "body"), r.text


def test_the_window_is_the_collectors_option(tmp_path: Path, db_engine: Engine, token: str) -> None:
    narrow = Settings(home=tmp_path, time_window_past_s=60.0, time_window_future_s=1.0)
    app = create_app(narrow, db_engine, clock=lambda: NOW, span_energy_interval_s=None)
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as c:
        r = post(c, good_batch(1))  # its data is 90-100 s old
        assert (r.status_code, r.json()["field"]) == (422, "sent_at_s")
        assert "more than 60 s before now" in r.json()["error"]
    wide = Settings(home=tmp_path, time_window_past_s=1e10)
    app = create_app(wide, db_engine, clock=lambda: NOW, span_energy_interval_s=None)
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as c:
        body = good_batch(1)
        _set("queries.0.t_start_s", 1000.0)(body)  # 1970: taken when the operator says so
        _set("queries.0.t_end_s", 1001.0)(body)  # (a span of 1970 to now would be longer than any span may be)
        assert post(c, body).status_code == 200


def test_the_window_options_say_what_to_fix(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from wattwatch.cli import main as cli
    from wattwatch.cli.settings import settings_from
    from wattwatch.config import load_settings
    from wattwatch.errors import ConfigError

    for flag, value, says in (("past", "nan", "is not a duration"), ("future", "0", "a positive number")):
        assert cli.main(["collector", f"--time-window-{flag}", value]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"--time-window-{flag}" in err and says in err
    args = cli.build_parser().parse_args(["collector", "--time-window-past", "90d", "--time-window-future", "12h"])
    window = settings_from(args).time_window()
    assert (window.past_s, window.future_s) == (90 * DAY_S, 43200.0)
    env = {"WATTWATCH_HOME": str(tmp_path), "WATTWATCH_TIME_WINDOW_PAST": "3600"}
    assert load_settings(env).time_window() == limits.TimeWindow(3600.0, limits.DEFAULT_FUTURE_S)
    with pytest.raises(ConfigError, match="--time-window-past"):
        load_settings({**env, "WATTWATCH_TIME_WINDOW_PAST": "-1"}).time_window()
