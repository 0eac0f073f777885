"""Bounded storage: the prune pass deletes what is past retention and no rollup, on SQLite and
PostgreSQL, through the collector's own scheduler (``app.state.retention``) and its APScheduler timer.

Expected figures come from the batches the tests build (joules per interval times intervals), never from
the code under test; "before == after" compares the rollup tables and reports read before the prune.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, select, text

from test_storage import GPUS, T0, iv
from wattwatch.cli.main import main
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sim.clock import FakeClock
from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine
from wattwatch.storage.raw_batches import read_intervals
from wattwatch.storage.retention import DAY_S, prune
from wattwatch.storage.tables import energy_intervals, ingested_batches, job_ticks, queries, raw_batches

RETENTION_DAYS = 14.0
# The old job runs at T0, the new one AGE_DAYS later; the prune runs an hour after that.
AGE_DAYS = 20.0
NEW_S = T0 + AGE_DAYS * DAY_S
ROLLUPS = ("jobs", "job_device_energy", "job_hosts", "job_query_totals", "span_stats", "device_energy")
GPU_J = 300.0  # per one-second interval on gpu0, all the job's
IDLE_J = 60.0  # per one-second interval on gpu1, nobody's
SECONDS = 10


@pytest.fixture
def settings(tmp_path: Any) -> Settings:
    # A window of 2 days back and 1 ahead: spans, ticks and keys are past the late-data horizon at 14 days.
    return Settings(
        home=tmp_path,
        retention_days=RETENTION_DAYS,
        time_window_past_s=2 * DAY_S,
        time_window_future_s=DAY_S,
        metrics_retention_s=3600.0,
    )


def job_batch(seq: int, job_id: str, t0_s: float) -> wire.Batch:
    """A finished job with SECONDS of GPU energy, idle energy beside it, and one query span."""
    return wire.Batch(
        seq=seq,
        agent_id="a1",
        host="h1",
        devices=GPUS,
        sent_at_s=t0_s + SECONDS,
        jobs=[wire.Job(id=job_id, name=job_id, kind="inference", started_at_s=t0_s, ended_at_s=t0_s + SECONDS)],
        intervals=[iv("gpu0", t0_s + t, GPU_J, {job_id: 1.0}) for t in range(SECONDS)]
        + [iv("gpu1", t0_s + t, IDLE_J, {}) for t in range(SECONDS)],
        queries=[wire.Query(job=job_id, t_start_s=t0_s + 1, t_end_s=t0_s + 3, tokens_in=5, tokens_out=7)],
    )


def post(client: TestClient, b: wire.Batch) -> Any:
    return client.post("/api/v1/ingest", content=wire.encode(b), headers={"Content-Type": "application/json"})


def dump(engine: Engine, table: str) -> list[tuple[Any, ...]]:
    """Every row of ``table``, sorted, so two dumps compare equal exactly when the table did not change."""
    with engine.connect() as conn:
        return sorted(tuple(r) for r in conn.execute(text(f"SELECT * FROM {table}")))


def idle_per_device(engine: Engine) -> dict[int, float]:
    """Idle joules per device over all time, summed here from the rows."""
    out: dict[int, float] = {}
    for device_id, _hour_s, energy_j in dump(engine, "idle_energy"):
        out[device_id] = out.get(device_id, 0.0) + energy_j
    return out


def count(engine: Engine, table: Any, where: Any) -> int:
    with engine.connect() as conn:
        return len(conn.execute(select(table).where(where)).all())


def raw_intervals(engine: Engine, **window: float) -> int:
    """Raw intervals stored in ``raw_batches`` (decoded) within the window."""
    with engine.connect() as conn:
        return sum(1 for _ in read_intervals(conn, **window))


def host_series(client: TestClient) -> dict[tuple[str, str], float]:
    text_ = client.get("/metrics").text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text_):
        if family.name in ("wattwatch_host_energy_joules", "wattwatch_idle_energy_joules"):
            for s in family.samples:
                out[(family.name, s.labels["device"])] = s.value
    return out


@pytest.fixture
def stored(settings: Settings, db_engine: Engine) -> Iterator[tuple[TestClient, FakeClock]]:
    """A collector holding an old finished job (T0) and a new one (AGE_DAYS later), spans computed."""
    clock = FakeClock(T0 + 100)
    app = create_app(settings, db_engine, clock=clock, span_energy_interval_s=None)
    with TestClient(app) as client:
        assert post(client, job_batch(1, "old", T0)).status_code == 200
        clock.t_s = NEW_S + 100
        assert post(client, job_batch(2, "new", NEW_S)).status_code == 200
        app.state.wattwatch.span_energy.run_once(settle_s=0.0)
        clock.t_s = NEW_S + 3600
        yield client, clock


def test_prune_deletes_past_retention_and_keeps_rollups(
    stored: tuple[TestClient, FakeClock], db_engine: Engine
) -> None:
    client, _clock = stored
    old = (raw_batches.c.t_end_s < NEW_S - DAY_S, job_ticks.c.t_end_s < NEW_S - DAY_S)
    assert count(db_engine, raw_batches, old[0]) == 1  # the old job's batch is there, every interval in it
    assert raw_intervals(db_engine, until_s=NEW_S - DAY_S) == 2 * SECONDS
    assert count(db_engine, job_ticks, old[1]) >= 1
    assert count(db_engine, queries, queries.c.job_id == "old") == 1
    rollups_before = {t: dump(db_engine, t) for t in ROLLUPS}
    idle_before = idle_per_device(db_engine)
    old_day_s = T0 - T0 % DAY_S
    assert [r[1] for r in dump(db_engine, "idle_energy") if r[1] < NEW_S - DAY_S] == [T0 - T0 % 3600]  # one hour row
    report_before = client.get("/api/v1/report", params={"since": "60d"}).json()
    old_before = client.get("/api/v1/jobs/old").json()
    metrics_before = host_series(client)
    # The truth from the batches: the old job holds every GPU joule, idle the other GPU's.
    assert old_before["energy_j"] == pytest.approx(GPU_J * SECONDS)
    assert old_before["queries"] == 1
    assert metrics_before[("wattwatch_host_energy_joules", "gpu1")] == pytest.approx(2 * IDLE_J * SECONDS)

    # The collector's own scheduler object, built from settings by create_app, runs the real pass.
    result = client.app.state.retention.run_once()  # type: ignore[attr-defined]
    assert result is not None and result.complete

    # Past retention: gone.
    assert count(db_engine, raw_batches, old[0]) == 0
    assert raw_intervals(db_engine, until_s=NEW_S - DAY_S) == 0
    assert count(db_engine, job_ticks, old[1]) == 0
    assert count(db_engine, queries, queries.c.job_id == "old") == 0
    assert count(db_engine, ingested_batches, ingested_batches.c.seq == 1) == 0
    assert result.deleted["raw_batches"] == 1
    assert result.deleted["ingested_batches"] == 1
    # Within retention: kept.
    assert raw_intervals(db_engine, since_s=NEW_S) == 2 * SECONDS
    assert count(db_engine, queries, queries.c.job_id == "new") == 1
    assert count(db_engine, ingested_batches, ingested_batches.c.seq == 2) == 1
    # Rollups of finished jobs and totals: unchanged, row for row, and so every figure read from them.
    assert {t: dump(db_engine, t) for t in ROLLUPS} == rollups_before
    # Idle: the old day's hours folded into its midnight row, per device sums unchanged.
    assert idle_per_device(db_engine) == idle_before
    assert [r[1] for r in dump(db_engine, "idle_energy") if r[1] < NEW_S - DAY_S] == [old_day_s]
    assert result.deleted["idle_energy_hours_folded"] == 1
    assert client.get("/api/v1/report", params={"since": "60d"}).json() == report_before
    assert client.get("/api/v1/jobs/old").json() == old_before
    assert host_series(client) == metrics_before
    # A second pass finds nothing more.
    again = client.app.state.retention.run_once()  # type: ignore[attr-defined]
    assert again is not None and again.total == 0


def test_resend_after_keys_pruned_is_refused_not_double_counted(
    stored: tuple[TestClient, FakeClock], db_engine: Engine
) -> None:
    client, _clock = stored
    client.app.state.retention.run_once()  # type: ignore[attr-defined]
    before = client.get("/api/v1/jobs/old").json()["energy_j"]
    # The old batch's key is gone, but its times are past the window: refused, never stored twice.
    r = post(client, job_batch(1, "old", T0))
    assert r.status_code == 422, r.text
    assert client.get("/api/v1/jobs/old").json()["energy_j"] == before
    # A recent batch's key is kept: its resend is a duplicate.
    assert post(client, job_batch(2, "new", NEW_S)).json()["duplicate"] is True


def test_timer_prunes_at_startup(settings: Settings, db_engine: Engine) -> None:
    """The APScheduler wiring: a collector started after the data aged prunes it in its first timed pass."""
    clock = FakeClock(T0 + 100)
    with TestClient(create_app(settings, db_engine, clock=clock, span_energy_interval_s=None)) as client:
        assert post(client, job_batch(1, "old", T0)).status_code == 200
    clock.t_s = NEW_S
    app = create_app(settings, db_engine, clock=clock, span_energy_interval_s=None)
    with TestClient(app):
        assert app.state.retention.running
        assert app.state.retention.passed.wait(timeout=30), "the first timed prune pass did not run"
        assert app.state.retention.last is not None
        assert app.state.retention.last.deleted["raw_batches"] == 1
    assert count(db_engine, raw_batches, raw_batches.c.id > 0) == 0


def test_retention_zero_keeps_everything(settings: Settings, db_engine: Engine) -> None:
    clock = FakeClock(T0 + 100)
    keep = Settings(**{**settings.__dict__, "retention_days": 0.0})
    app = create_app(keep, db_engine, clock=clock, span_energy_interval_s=None)
    with TestClient(app) as client:
        assert post(client, job_batch(1, "old", T0)).status_code == 200
        clock.t_s = T0 + 1000 * DAY_S
        assert not app.state.retention.running
        assert app.state.retention.run_once() is None
    assert raw_intervals(db_engine) == 2 * SECONDS


def legacy_rows(engine: Engine, t0_s: float, n: int) -> None:
    """Row-per-interval raw rows as a collector before revision 0010 wrote them."""
    with engine.begin() as conn:
        conn.execute(
            energy_intervals.insert(),
            [
                {"device_id": 1, "t_start_s": t0_s + i, "t_end_s": t0_s + i + 1, "energy_j": 1.0, "source": "counter"}
                for i in range(n)
            ],
        )


def test_prune_in_chunks_deletes_all(stored: tuple[TestClient, FakeClock], db_engine: Engine) -> None:
    """Small chunks: many short transactions, the same end state; a spent budget stops early, incomplete."""
    _client, clock = stored
    # Old raw rows of both kinds: the old job's batch, and row-per-interval rows a pre-0010 collector wrote
    # (past retention, so pruned by the same rule), old and new.
    legacy_rows(db_engine, T0, 2 * SECONDS)
    legacy_rows(db_engine, NEW_S, 4)
    common = {"now_s": clock(), "retention_s": RETENTION_DAYS * DAY_S, "past_s": 2 * DAY_S, "future_s": DAY_S}
    ticks = iter(range(1000))  # each look at the clock: a second later; the budget: one fold, three chunks
    partial = prune(db_engine, chunk_rows=3, budget_s=4.5, monotonic=lambda: float(next(ticks)), **common)
    assert not partial.complete
    assert partial.deleted == {"idle_energy_hours_folded": 1, "raw_batches": 1, "energy_intervals": 6}
    result = prune(db_engine, chunk_rows=3, **common)
    assert result.complete
    assert partial.deleted["energy_intervals"] + result.deleted["energy_intervals"] == 2 * SECONDS
    assert count(db_engine, energy_intervals, energy_intervals.c.t_start_s < NEW_S) == 0
    assert count(db_engine, energy_intervals, energy_intervals.c.t_start_s >= NEW_S) == 4
    assert count(db_engine, raw_batches, raw_batches.c.t_start_s < NEW_S) == 0


@pytest.mark.parametrize("value", ["-1", "nan", "99999"])
def test_cli_refuses_bad_retention(value: str, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code = main(["--home", str(tmp_path), "collector", "--retention-days", value])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--retention-days" in err, err


def test_device_totals_match_the_batches(stored: tuple[TestClient, FakeClock], db_engine: Engine) -> None:
    """device_energy (what /metrics reads) holds each device's joules from both batches."""
    with db_engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT d.key, e.job_energy_j, e.idle_energy_j "
                "FROM device_energy e JOIN devices d ON d.id = e.device_id"
            )
        ).all()
    got = {key: (job_j, idle_j) for key, job_j, idle_j in rows}
    assert got == {
        "gpu0": (pytest.approx(2 * GPU_J * SECONDS), 0.0),
        "gpu1": (0.0, pytest.approx(2 * IDLE_J * SECONDS)),
    }


def test_migration_0008_fills_device_totals_from_rollups(db_url: str) -> None:
    """A database at 0007 with rollups gets device_energy equal to their sums on upgrade."""
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE device_energy"))
            conn.execute(text("DROP INDEX ix_idle_energy_hour_s"))
            conn.execute(text("ALTER TABLE hosts DROP COLUMN grid_region"))  # 0009, which follows 0008
            conn.execute(text("DROP TABLE raw_batches"))  # 0010
            conn.execute(text("DROP INDEX ix_jobs_id_stem"))  # 0011
            conn.execute(text("DROP TABLE idle_energy_days"))  # 0012
            conn.execute(text("DROP TABLE unmeasured_spans"))  # 0013
            conn.execute(text("ALTER TABLE span_stats DROP COLUMN carry"))  # 0014
            conn.execute(text("UPDATE alembic_version SET version_num = '0007'"))
            conn.execute(text("INSERT INTO hosts (id, name, first_seen_s, last_seen_s) VALUES (1, 'h', 0, 0)"))
            conn.execute(text("INSERT INTO devices (id, host_id, key, kind, \"index\") VALUES (1, 1, 'g', 'gpu', 0)"))
            conn.execute(
                text(
                    "INSERT INTO jobs (id, name, kind, labels, started_at_s, created_at_s, placeholder) "
                    "VALUES ('j1', 'j1', 'training', '{}', 0, 0, false), ('j2', 'j2', 'training', '{}', 0, 0, false)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO job_device_energy (job_id, device_id, energy_j, sources, max_power_w) "
                    "VALUES ('j1', 1, 100.0, 'counter', 1.0), ('j2', 1, 250.0, 'counter', 1.0)"
                )
            )
            conn.execute(
                text("INSERT INTO idle_energy (device_id, hour_s, energy_j) VALUES (1, 0, 7.0), (1, 3600, 5.0)")
            )
        migrate.upgrade(db_url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT device_id, job_energy_j, idle_energy_j FROM device_energy")).all() == [
                (1, 350.0, 12.0)
            ]
    finally:
        engine.dispose()


def test_retention_setting_from_the_environment_reaches_the_scheduler(tmp_path: Any, db_engine: Engine) -> None:
    from wattwatch.config import load_settings

    settings = load_settings(env={"WATTWATCH_HOME": str(tmp_path), "WATTWATCH_RETENTION_DAYS": "3"})
    assert settings.retention_days == 3.0
    for periodic in (True, False):
        app = create_app(settings, db_engine, span_energy_interval_s=None, periodic=periodic)
        assert app.state.retention.retention_s == 3 * DAY_S
        with TestClient(app):
            # periodic=False is every worker but the first of --workers N: the first one prunes.
            assert app.state.retention.running is periodic


def test_idle_hours_fold_into_days_and_reports_read_the_same(db_engine: Engine) -> None:
    """Idle hours older than two days become one row per device and day; a report whose window starts in
    such a day counts the whole day (idle_from says so) before and after the fold."""
    from wattwatch.protocol.units import iso_utc
    from wattwatch.storage import repository

    day_s = T0 - T0 % DAY_S
    hours = (1, 5, 13, 23)  # one idle second of 10 J on gpu1 in each of these hours
    intervals = [iv("gpu1", day_s + h * 3600 + 7, 10.0, {}) for h in hours]
    intervals += [iv("gpu1", day_s + DAY_S + 3600, 4.0, {})]  # the next day: 4 J
    b = wire.Batch(seq=1, agent_id="a1", host="h1", devices=GPUS, sent_at_s=day_s, intervals=intervals)
    repository.ingest_batch(db_engine, b, received_at_s=day_s)
    now_s = day_s + 10 * DAY_S

    def idle() -> tuple[Any, ...]:
        r = repository.build_report(db_engine, since_s=day_s + 10 * 3600, now_s=now_s)
        return r["idle_from"], [(i["device"], i["energy_j"]) for i in r["idle"]]

    before = idle()
    assert before == (iso_utc(day_s), [("gpu1", pytest.approx(44.0))])  # the whole day from its midnight
    result = prune(db_engine, now_s=now_s, retention_s=14 * DAY_S, past_s=2 * DAY_S, future_s=DAY_S)
    assert result.deleted["idle_energy_hours_folded"] == len(hours) + 1  # no hour was at midnight
    assert idle() == before
    with db_engine.connect() as conn:
        rows = sorted(conn.execute(text("SELECT hour_s, energy_j FROM idle_energy")).all())
    assert rows == [(day_s, pytest.approx(40.0)), (day_s + DAY_S, pytest.approx(4.0))]
    # A recent window stays in whole hours.
    recent = repository.build_report(db_engine, since_s=now_s - 5000, now_s=now_s)
    assert recent["idle_from"] == iso_utc(now_s - 5000 - (now_s - 5000) % 3600)


def idle_days_from_hours(engine: Engine) -> dict[tuple[int, float], float]:
    """Idle joules per (device, UTC day), summed here from idle_energy's rows."""
    out: dict[tuple[int, float], float] = {}
    for device_id, hour_s, energy_j in dump(engine, "idle_energy"):
        key = (device_id, hour_s - hour_s % DAY_S)
        out[key] = out.get(key, 0.0) + energy_j
    return out


def idle_days_stored(engine: Engine) -> dict[tuple[int, float], float]:
    return {(d, day_s): e for d, day_s, e in dump(engine, "idle_energy_days")}


def test_idle_days_equal_the_hours_before_and_after_the_fold(
    stored: tuple[TestClient, FakeClock], db_engine: Engine
) -> None:
    """idle_energy_days (what whole-day report windows read) holds each day's hours, through ingest and fold."""
    client, _clock = stored
    before = idle_days_stored(db_engine)
    assert before.keys() == idle_days_from_hours(db_engine).keys() and len(before) >= 2
    for key, energy_j in idle_days_from_hours(db_engine).items():
        assert before[key] == pytest.approx(energy_j)
    # The truth from the batches: gpu1 idles IDLE_J a second, SECONDS seconds a job.
    assert sum(before.values()) == pytest.approx(2 * IDLE_J * SECONDS)
    report_before = client.get("/api/v1/report", params={"since": "60d"}).json()["idle"]
    client.app.state.retention.run_once()  # type: ignore[attr-defined]
    assert idle_days_stored(db_engine) == before  # the fold moves energy within a day only
    for key, energy_j in idle_days_from_hours(db_engine).items():
        assert before[key] == pytest.approx(energy_j)
    assert client.get("/api/v1/report", params={"since": "60d"}).json()["idle"] == report_before


def test_migration_0012_fills_idle_days_from_the_hours(stored: tuple[TestClient, FakeClock], db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        want = idle_days_from_hours(engine)
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE idle_energy_days"))
            conn.execute(text("DROP TABLE unmeasured_spans"))  # 0013, which follows
            conn.execute(text("ALTER TABLE span_stats DROP COLUMN carry"))  # 0014
            conn.execute(text("UPDATE alembic_version SET version_num = '0011'"))
        migrate.upgrade(db_url)
        got = idle_days_stored(engine)
        assert got.keys() == want.keys()
        for key, energy_j in want.items():
            assert got[key] == pytest.approx(energy_j)
    finally:
        engine.dispose()
