"""Storage against real SQLite and PostgreSQL: migrations, ingest, rollups, reports, readiness messages."""

from __future__ import annotations

import math
import os
import random
import re
import socket
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, inspect, select, text

from wattwatch.errors import StorageError
from wattwatch.protocol import wire
from wattwatch.storage import migrate, repository
from wattwatch.storage.engine import check_ready, make_engine, normalize_url
from wattwatch.storage.raw_batches import read_intervals
from wattwatch.storage.span_energy import compute_span_energy
from wattwatch.storage.spans import pack_ticks, unpack_ticks
from wattwatch.storage.tables import (
    DATA_TABLES,
    devices,
    idle_energy,
    job_device_energy,
    job_ticks,
    jobs,
    queries,
    span_dirty,
)

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
# A collector time window that takes T0's data on the real clock (limits.TimeWindow's default is 30 days back).
WIDE_WINDOW_S = 1e10
DESIGN_JOB_KEYS = {
    "id", "name", "kind", "started_at", "ended_at", "duration_s", "hosts", "devices", "energy_j", "gpu_energy_j",
    "cpu_energy_j", "dram_energy_j", "avg_power_w", "peak_power_w", "queries", "tokens", "energy_per_query_j",
    "energy_per_token_j", "emissions_g", "sources",
}  # fmt: skip
GPUS = [wire.Device(key=f"gpu{i}", kind="gpu", index=i, uuid=f"GPU-{i}", model="H100") for i in range(2)]
CPU = wire.Device(key="cpu0", kind="cpu")


def row_counts(engine: Engine) -> dict[str, int]:
    """Rows in every data table."""
    with engine.connect() as conn:
        return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in DATA_TABLES}


def batch(seq: int, **kw: Any) -> wire.Batch:
    """A batch from agent a1 on host h1 with two GPUs and a CPU package."""
    kw.setdefault("agent_id", "a1")
    kw.setdefault("host", "h1")
    kw.setdefault("devices", [*GPUS, CPU])
    return wire.Batch(seq=seq, sent_at_s=T0, **kw)


def iv(device: str, t_s: float, energy_j: float, shares: dict[str, float], **kw: Any) -> wire.Interval:
    """A one-second interval starting at ``t_s``."""
    kw.setdefault("source", "counter")
    return wire.Interval(device=device, t_start_s=t_s, t_end_s=t_s + 1.0, energy_j=energy_j, shares=shares, **kw)


# --- migrations and readiness -----------------------------------------------------------------------


def _migrate_blank(url: str) -> None:
    assert migrate.current_revision(url) is None
    migrate.upgrade(url)
    newest = sorted(p.name for p in (migrate.MIGRATIONS_DIR / "versions").glob("[0-9]*.py"))[-1]
    assert migrate.current_revision(url) == migrate.head_revision() == newest.split("_")[0]
    migrate.upgrade(url)  # a second upgrade is a no-op, as `wattwatch up` runs it every start
    engine = make_engine(url)
    try:
        names = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert set(DATA_TABLES) | {"alembic_version"} <= names


def test_migrations_upgrade_sqlite(tmp_path: Path) -> None:
    # The parent directory does not exist yet: upgrade creates it (it is what `wattwatch db upgrade` runs).
    _migrate_blank(f"sqlite:///{tmp_path / 'new' / 'wattwatch.db'}")


@pytest.mark.postgres
def test_migrations_upgrade_postgres(pg_blank_url: str) -> None:
    _migrate_blank(pg_blank_url)


REPO = Path(__file__).resolve().parents[1]


def test_migrations_live_at_the_top_level() -> None:
    # A checkout (and an editable install) migrates from the repository's alembic/ folder.
    root = migrate.MIGRATIONS_DIR
    assert root == REPO / "alembic"
    assert (root / "env.py").is_file() and (root / "script.py.mako").is_file()
    assert not (root / "__init__.py").exists(), "an __init__.py would shadow the alembic library from the repo root"
    versions = sorted(p.name for p in (root / "versions").glob("*.py"))
    assert versions[:2] == ["0001_initial.py", "0002_span_energy.py"]


def test_pyproject_lists_every_package() -> None:
    # pyproject lists packages by hand (it maps alembic/ into one); a package missing there is missing from wheels.
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO / "src").parts) for p in (REPO / "src" / "wattwatch").rglob("__init__.py")
    }
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_alembic_command_line_from_the_repository_root(tmp_path: Path) -> None:
    alembic = Path(sys.executable).with_name("alembic")
    db = tmp_path / "cli.db"
    env = {**os.environ, "WATTWATCH_HOME": str(tmp_path / "home")}
    env.pop("WATTWATCH_DB", None)
    for args in (["upgrade", "head"], ["-x", f"url=sqlite:///{db}", "upgrade", "head"]):
        done = subprocess.run([str(alembic), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert migrate.current_revision(f"sqlite:///{tmp_path / 'home' / 'wattwatch.db'}") == migrate.head_revision()
    assert migrate.current_revision(f"sqlite:///{db}") == migrate.head_revision()


@pytest.mark.slow
def test_wheel_carries_the_migrations(tmp_path: Path) -> None:
    # Build the wheel as a user would get it, install it on its own, and migrate with it.
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("wattwatch-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    shipped = {n for n in names if n.startswith("wattwatch/storage/migrations/")}
    expected = {
        f"wattwatch/storage/migrations/{p.relative_to(REPO / 'alembic').as_posix()}"
        for p in (REPO / "alembic").rglob("*")
        if p.suffix in (".py", ".mako") and "__pycache__" not in p.parts
    }
    assert expected <= shipped
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    url = f"sqlite:///{tmp_path / 'from-wheel.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "wattwatch.cli.main", "db", "upgrade", "--db", url],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert migrate.current_revision(url) == migrate.head_revision()


def test_check_ready_missing_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'nowhere' / 'wattwatch.db'}"
    with pytest.raises(StorageError) as err:
        check_ready(url)
    message = str(err.value)
    assert "\n" not in message
    assert f"no wattwatch database at {tmp_path / 'nowhere' / 'wattwatch.db'}" in message
    assert f"`wattwatch db upgrade --db {url}`" in message and "`wattwatch up`" in message
    assert not (tmp_path / "nowhere").exists()  # checking must not create anything


def test_check_ready_unmigrated_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    url = f"sqlite:///{path}"
    with pytest.raises(StorageError) as err:
        check_ready(url)
    assert str(err.value) == (
        f"database {url} is at revision none, this wattwatch needs {migrate.head_revision()}; "
        f"run `wattwatch db upgrade --db {url}`"
    )


@pytest.mark.postgres
def test_check_ready_unmigrated_postgres(pg_blank_url: str) -> None:
    needs = migrate.head_revision()
    with pytest.raises(
        StorageError, match=rf"is at revision none, this wattwatch needs {needs}; run `wattwatch db upgrade"
    ):
        check_ready(pg_blank_url)


def test_check_ready_outdated_database(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'zzzz'"))
    engine.dispose()
    with pytest.raises(StorageError, match="newer than this wattwatch knows"):
        check_ready(sqlite_url)


def test_check_ready_unreachable_server_masks_password() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StorageError) as err:
        check_ready(f"postgresql://ww:s3cret@127.0.0.1:{port}/wattwatch")
    message = str(err.value)
    assert message.startswith(f"cannot reach database postgresql://ww:***@127.0.0.1:{port}/wattwatch")
    assert "s3cret" not in message and "\n" not in message


def test_postgresql_urls_use_psycopg3() -> None:
    assert normalize_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    with pytest.raises(StorageError, match="not a database URL"):
        normalize_url("not a url")


def test_sqlite_engine_settings(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 10_000
    engine.dispose()


# --- ingest -----------------------------------------------------------------------------------------


def test_duplicate_batch_is_idempotent(db_engine: Engine) -> None:
    b = batch(
        1,
        intervals=[iv("gpu0", T0, 100.0, {"j1": 1.0}), iv("gpu1", T0, 50.0, {})],
        jobs=[wire.Job(id="j1", name="train", kind="training", started_at_s=T0)],
        queries=[wire.Query(job="j1", t_start_s=T0, t_end_s=T0 + 0.5, tokens_in=3, tokens_out=4)],
    )
    first = repository.ingest_batch(db_engine, b, received_at_s=T0 + 2)
    assert first == repository.IngestResult(duplicate=False, n_intervals=2)
    before = row_counts(db_engine)
    report_before = repository.build_report(db_engine, now_s=T0 + 10)
    again = repository.ingest_batch(db_engine, b, received_at_s=T0 + 3)
    assert again == repository.IngestResult(duplicate=True, n_intervals=0)
    assert row_counts(db_engine) == before
    assert repository.build_report(db_engine, now_s=T0 + 10) == report_before
    assert report_before["jobs"][0]["energy_j"] == 100.0


def _random_batches(rng: random.Random, n_batches: int) -> list[wire.Batch]:
    out = []
    for seq in range(n_batches):
        intervals = []
        for tick in range(20):
            t_s = T0 + seq * 20 + tick
            for dev in ("gpu0", "gpu1", "cpu0"):
                held = rng.sample(["j1", "j2", "j3"], rng.randint(0, 3))
                shares = {j: rng.choice([0.0, rng.random(), 1e-9, 3.0]) for j in held}
                idle_weight = rng.random() if dev == "cpu0" else 0.0
                energy_j = rng.choice([0.0, rng.uniform(0, 700), 1e-7, 123456.789])
                intervals.append(iv(dev, t_s, energy_j, shares, idle_weight=idle_weight))
        out.append(batch(seq, intervals=intervals))
    return out


def test_rollups_conserve_device_energy(db_engine: Engine) -> None:
    for b in _random_batches(random.Random(7), 5):
        repository.ingest_batch(db_engine, b, received_at_s=T0)
    with db_engine.connect() as conn:
        # Raw energy per device, summed here from the stored raw batches (device key -> the device's id).
        ids = dict(conn.execute(select(devices.c.key, devices.c.id)).all())
        raw: dict[int, float] = {}
        for r in read_intervals(conn):
            raw[ids[r.interval.device]] = raw.get(ids[r.interval.device], 0.0) + r.interval.energy_j
        jobs_j = dict(
            conn.execute(
                select(job_device_energy.c.device_id, func.sum(job_device_energy.c.energy_j)).group_by(
                    job_device_energy.c.device_id
                )
            ).all()
        )
        idle_j = dict(
            conn.execute(
                select(idle_energy.c.device_id, func.sum(idle_energy.c.energy_j)).group_by(idle_energy.c.device_id)
            ).all()
        )
    assert len(raw) == 3
    for device_id, energy_j in raw.items():
        attributed_j = jobs_j.get(device_id, 0.0) + idle_j.get(device_id, 0.0)
        assert attributed_j == pytest.approx(energy_j, rel=1e-9)
    # And the report agrees with the rollups: job energy + idle = everything measured.
    report = repository.build_report(db_engine, now_s=T0 + 1000)
    reported_j = math.fsum([j["energy_j"] for j in report["jobs"]] + [i["energy_j"] for i in report["idle"]])
    assert reported_j == pytest.approx(math.fsum(raw.values()), rel=1e-9)


def test_multi_host_job_is_summed(db_engine: Engine) -> None:
    job = wire.Job(id="run-42", name="llama-ft", kind="training", started_at_s=T0, labels={"team": "nlp"})
    for agent, host, power_w in (("a1", "h1", 600.0), ("a2", "h2", 500.0)):
        repository.ingest_batch(
            db_engine,
            batch(
                1,
                agent_id=agent,
                host=host,
                jobs=[job],
                intervals=[iv(f"gpu{g}", T0 + t, power_w, {"run-42": 1.0}) for t in range(10) for g in range(2)],
            ),
            received_at_s=T0 + 11,
        )
    end = wire.Job(id="run-42", name="llama-ft", kind="training", started_at_s=T0, ended_at_s=T0 + 10)
    repository.upsert_job(db_engine, "h2", end, now_s=T0 + 12)
    (entry,) = repository.build_report(db_engine, now_s=T0 + 100)["jobs"]
    assert entry["hosts"] == ["h1", "h2"]
    assert entry["devices"] == ["h1/gpu0", "h1/gpu1", "h2/gpu0", "h2/gpu1"]
    assert entry["energy_j"] == pytest.approx(2 * 10 * (600.0 + 500.0))
    assert entry["gpu_energy_j"] == entry["energy_j"]
    assert entry["duration_s"] == 10.0 and entry["running"] is False
    assert entry["avg_power_w"] == pytest.approx(2200.0)
    assert entry["peak_power_w"] == pytest.approx(2 * 600.0 + 2 * 500.0)
    assert entry["per_host"] == [
        {
            "host": "h1",
            "energy_j": pytest.approx(12000.0),
            "peak_power_w": pytest.approx(1200.0),
            "grid_intensity_g_per_kwh": 400.0,  # no region anywhere: the configured default
            "emissions_g": pytest.approx(12000.0 / 3.6e6 * 400.0),
        },
        {
            "host": "h2",
            "energy_j": pytest.approx(10000.0),
            "peak_power_w": pytest.approx(1000.0),
            "grid_intensity_g_per_kwh": 400.0,
            "emissions_g": pytest.approx(10000.0 / 3.6e6 * 400.0),
        },
    ]
    assert entry["labels"] == {"team": "nlp"}


def test_placeholder_job_is_replaced_by_the_real_record(db_engine: Engine) -> None:
    repository.ingest_batch(
        db_engine,
        batch(1, intervals=[iv("gpu0", T0 + 5, 10.0, {"late": 1.0})], queries=[]),
        received_at_s=T0 + 6,
    )
    assert repository.get_job(db_engine, "late", now_s=T0 + 6)["name"] == "late"  # type: ignore[index]
    real = wire.Job(id="late", name="bert-serve", kind="inference", started_at_s=T0, labels={"a": "b"})
    repository.ingest_batch(db_engine, batch(2, jobs=[real]), received_at_s=T0 + 7)
    # A later interval naming only the id must not turn it back into a placeholder.
    repository.ingest_batch(db_engine, batch(3, intervals=[iv("gpu0", T0 + 8, 10.0, {"late": 1.0})]), received_at_s=T0)
    job = repository.get_job(db_engine, "late", now_s=T0 + 10)
    assert job is not None
    assert (job["name"], job["kind"], job["labels"], job["started_at_s"]) == ("bert-serve", "inference", {"a": "b"}, T0)
    assert job["energy_j"] == 20.0
    with db_engine.connect() as conn:
        assert conn.execute(select(jobs.c.placeholder).where(jobs.c.id == "late")).scalar_one() is False


def test_job_start_and_end_merge_across_hosts(db_engine: Engine) -> None:
    repository.upsert_job(db_engine, "h1", wire.Job(id="j", name="n", started_at_s=T0 + 5), now_s=T0 + 5)
    repository.upsert_job(db_engine, "h2", wire.Job(id="j", name="n", started_at_s=T0), now_s=T0 + 5)
    repository.end_job(db_engine, "j", T0 + 30)
    repository.end_job(db_engine, "j", T0 + 20)  # an earlier end from a slower host does not shorten it
    job = repository.get_job(db_engine, "j")
    assert job is not None
    assert (job["started_at_s"], job["ended_at_s"], job["hosts"]) == (T0, T0 + 30, ["h1", "h2"])
    with pytest.raises(repository.UnknownJob, match="no job 'nope'"):
        repository.end_job(db_engine, "nope", T0)


def test_queries_and_sources(db_engine: Engine) -> None:
    repository.upsert_job(db_engine, "h1", wire.Job(id="srv", name="vllm", kind="inference", started_at_s=T0))
    repository.ingest_batch(
        db_engine,
        batch(
            1,
            intervals=[iv("gpu0", T0, 100.0, {"srv": 1.0}), iv("gpu0", T0 + 1, 60.0, {"srv": 1.0}, source="power")],
            queries=[wire.Query(job="srv", t_start_s=T0, t_end_s=T0 + 1, tokens_in=10, tokens_out=30)],
        ),
        received_at_s=T0 + 2,
    )
    repository.ingest_batch(
        db_engine, batch(2, intervals=[iv("cpu0", T0, 40.0, {"srv": 1.0}, source="estimate")]), received_at_s=T0
    )
    queries = [wire.Query(job="srv", t_start_s=T0 + 1, t_end_s=T0 + 2, tokens_out=60) for _ in range(3)]
    assert repository.add_queries(db_engine, "srv", queries, host="h1") == 3
    job = repository.get_job(db_engine, "srv", now_s=T0 + 4)
    assert job is not None
    # Counted at once; energies only once the span-energy pass has settled them.
    assert (job["queries"], job["query_method"], job["queries_settled"], job["energy_per_query_j"]) == (
        4,
        "spans",
        0,
        None,
    )
    compute_span_energy(db_engine, now_s=T0 + 100)
    job = repository.get_job(db_engine, "srv", now_s=T0 + 4)
    assert job is not None
    assert job["sources"] == ["counter", "estimate", "power"]
    assert (job["queries"], job["tokens"], job["tokens_in"], job["tokens_out"]) == (4, 220, 10, 210)
    # The first query had T0..T0+1 alone (100 J GPU + 40 J CPU); three shared T0+1..T0+2 (60 J).
    assert job["energy_per_query_j"] == pytest.approx((140.0 + 3 * 20.0) / 4)
    assert job["energy_per_query_p50_j"] == pytest.approx(20.0, rel=0.002)
    assert job["energy_per_query_p95_j"] == pytest.approx(140.0, rel=0.002)
    assert job["energy_per_token_j"] == pytest.approx(200.0 / 220)
    assert job["waiting_energy_j"] == 0.0
    assert job["cpu_energy_j"] == 40.0 and job["gpu_energy_j"] == 160.0
    assert "estimated" in job["source_note"]
    with pytest.raises(repository.UnknownJob):
        repository.add_queries(db_engine, "ghost", [])
    with pytest.raises(ValueError, match="posted to job"):
        repository.add_queries(db_engine, "srv", [wire.Query(job="other", t_start_s=T0, t_end_s=T0)])


def test_a_device_the_job_drew_nothing_from_is_not_listed_nor_its_source(db_engine: Engine) -> None:
    # The job held the GPU but used no CPU time: its share of the estimated CPU package is 0 J.
    repository.ingest_batch(
        db_engine,
        batch(
            1,
            intervals=[
                iv("gpu0", T0, 300.0, {"j": 1.0}),
                iv("cpu0", T0, 15.0, {"j": 0.0}, idle_weight=2.0, source="estimate"),
            ],
        ),
        received_at_s=T0 + 1,
    )
    job = repository.get_job(db_engine, "j", now_s=T0 + 2)
    assert job is not None
    assert job["devices"] == ["h1/gpu0"]
    assert job["sources"] == ["counter"]
    assert job["cpu_energy_j"] == 0.0


# --- reports ----------------------------------------------------------------------------------------


def _seed_report_data(engine: Engine) -> None:
    repository.ingest_batch(
        engine,
        batch(
            1,
            jobs=[
                wire.Job(id="old", name="old-train", kind="training", started_at_s=T0, ended_at_s=T0 + 10),
                wire.Job(id="srv", name="serve", kind="inference", started_at_s=T0 + 4000),
            ],
            intervals=[
                iv("gpu0", T0, 3.6e6, {"old": 1.0}),
                iv("gpu1", T0, 50.0, {}),
                iv("gpu0", T0 + 4000, 200.0, {"srv": 1.0}),
                iv("gpu1", T0 + 4000, 70.0, {}),
            ],
        ),
        received_at_s=T0 + 4001,
    )


def test_report_shape_is_design_json(db_engine: Engine) -> None:
    _seed_report_data(db_engine)
    report = repository.build_report(db_engine, grid_intensity_g_per_kwh=500.0, pue=1.2, now_s=T0 + 4010)
    # DESIGN's two keys, what tells "no job matches" from "no job yet", the paging cursor
    # (null: no limit asked, so this is the only page), what the emissions rest on (carbon_policy), and the
    # page's totals (report_group; the CLI's footer) and how many jobs match on all pages.
    assert set(report) == {
        "jobs",
        "idle",
        "filters",
        "jobs_recorded",
        "idle_from",
        "idle_until",
        "next_cursor",
        "carbon",
        "totals",
        "jobs_matched",
    }
    assert report["jobs_matched"] == len(report["jobs"])
    assert report["totals"]["energy_j"] == pytest.approx(sum(j["energy_j"] for j in report["jobs"]), rel=1e-12)
    assert report["totals"]["idle_energy_j"] == pytest.approx(sum(i["energy_j"] for i in report["idle"]), rel=1e-12)
    assert report["filters"] == {} and report["jobs_recorded"] is True and report["next_cursor"] is None
    assert report["carbon"]["pue"] == 1.2
    assert report["carbon"]["hosts"] == [{"host": "h1", "region": None, "g_per_kwh": 500.0, "source": "config default"}]
    old, srv = report["jobs"]
    assert set(old) >= DESIGN_JOB_KEYS
    iso = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
    assert old["started_at"] == "2023-11-14T22:13:20Z" and iso.match(old["ended_at"])
    assert srv["ended_at"] is None and srv["running"] is True
    assert srv["duration_s"] == 10.0
    assert old == {
        **old,
        "id": "old",
        "name": "old-train",
        "kind": "training",
        "duration_s": 10.0,
        "hosts": ["h1"],
        "devices": ["h1/gpu0"],
        "energy_j": 3.6e6,
        "gpu_energy_j": 3.6e6,
        "cpu_energy_j": 0.0,
        "dram_energy_j": 0.0,
        "avg_power_w": 3.6e5,
        "peak_power_w": 3.6e6,
        "queries": 0,
        "tokens": 0,
        "energy_per_query_j": None,
        "energy_per_token_j": None,
        "emissions_g": pytest.approx(600.0),
        "sources": ["counter"],
    }
    for entry in report["jobs"]:
        for key in ("energy_j", "gpu_energy_j", "cpu_energy_j", "dram_energy_j", "duration_s", "emissions_g"):
            assert isinstance(entry[key], float), key
        assert isinstance(entry["queries"], int) and isinstance(entry["tokens"], int)
    assert report["idle"] == [{"host": "h1", "device": "gpu1", "energy_j": 120.0, "device_kind": "gpu"}]


def test_report_filters(db_engine: Engine) -> None:
    _seed_report_data(db_engine)
    now_s = T0 + 4010
    since = repository.build_report(db_engine, since_s=T0 + 3700, now_s=now_s)
    assert [j["id"] for j in since["jobs"]] == ["srv"]  # "old" ended before since; "srv" still runs
    # Idle from the hour containing `since` on: T0 + 3700 falls in the hour that starts at T0 + 2000.
    assert since["idle"] == [{"host": "h1", "device": "gpu1", "energy_j": 70.0, "device_kind": "gpu"}]
    assert [j["id"] for j in repository.build_report(db_engine, kind="training")["jobs"]] == ["old"]
    one = repository.build_report(db_engine, job_id="srv", now_s=now_s)
    assert [j["id"] for j in one["jobs"]] == ["srv"]
    assert repository.build_report(db_engine, job_id="nope")["jobs"] == []
    with pytest.raises(ValueError, match="kind 'bogus'"):
        repository.build_report(db_engine, kind="bogus")
    listed = repository.list_jobs(db_engine, now_s=now_s)
    assert [j["id"] for j in listed] == ["srv", "old"]  # newest first
    assert [j["id"] for j in repository.list_jobs(db_engine, limit=1)] == ["srv"]
    assert repository.get_job(db_engine, "nope") is None


def test_metrics_snapshot_drops_finished_jobs_after_retention(db_engine: Engine) -> None:
    _seed_report_data(db_engine)
    snap = repository.metrics_snapshot(db_engine, now_s=T0 + 4010, retention_s=3600.0)
    assert set(snap.jobs) == {"srv"}  # "old" ended 4000 s ago
    assert snap.idle == [("h1", "gpu1", "gpu", 120.0)]
    # Host energy keeps every job's energy, retired or not, so the counter never goes down.
    assert {(host, kind) for host, _, kind, _ in snap.host} == {("h1", "gpu")}
    assert math.fsum(energy_j for *_, energy_j in snap.host) == pytest.approx(3.6e6 + 200.0 + 120.0)
    everything = repository.metrics_snapshot(db_engine, now_s=T0 + 4010, retention_s=1e9)
    assert set(everything.jobs) == {"old", "srv"}


def test_concurrent_ingest_loses_nothing(db_engine: Engine) -> None:
    # Several agents push at once into the same job, devices and idle hours; every addition must land.
    from concurrent.futures import ThreadPoolExecutor

    def push(agent: int) -> None:
        for seq in range(8):
            b = batch(
                seq, agent_id=f"a{agent}", intervals=[iv("gpu0", T0 + seq, 10.0, {"j": 1.0}), iv("gpu1", T0, 1.0, {})]
            )
            repository.ingest_batch(db_engine, b, received_at_s=T0)

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(push, range(4)))
    report = repository.build_report(db_engine, now_s=T0 + 100)
    assert report["jobs"][0]["energy_j"] == pytest.approx(4 * 8 * 10.0)
    assert report["idle"][0]["energy_j"] == pytest.approx(4 * 8 * 1.0)


# --- per-span energy: ticks, marks ----------------------------------------------------------------------


def test_job_ticks_are_packed_per_batch_in_bounded_rows(db_engine: Engine) -> None:
    ticks = [iv("gpu0", T0 + t, 10.0 + t, {"j": 1.0}) for t in range(150)]
    ticks += [iv("gpu1", T0 + t, 1.0, {"j": 1.0}) for t in range(150)]  # same bounds: one tick per second
    repository.ingest_batch(db_engine, batch(1, intervals=ticks), received_at_s=T0)
    with db_engine.connect() as conn:
        rows = conn.execute(select(job_ticks).order_by(job_ticks.c.t_start_s)).all()
        marks = conn.execute(select(span_dirty.c.job_id, span_dirty.c.t_s, span_dirty.c.max_tick_s)).all()
    assert [(r.t_start_s - T0, r.t_end_s - T0) for r in rows] == [(0, 60), (60, 120), (120, 150)]
    unpacked = [tick for r in rows for tick in unpack_ticks(r.ticks)]
    assert unpacked == [(T0 + t, T0 + t + 1, 11.0 + t) for t in range(150)]
    assert pack_ticks(unpacked[:2]) == pack_ticks([(T0, T0 + 1, 11.0), (T0 + 1, T0 + 2, 12.0)])
    assert marks == [("j", T0, 60.0)]


def test_spans_after_their_ticks_were_consumed_and_a_stalled_tick(db_engine: Engine) -> None:
    # The ticks come first and a pass runs before any span exists (so it drops the job's marks);
    # one tick is 300 s long (an agent that stalled), which windows far after its start must still see.
    ticks = [iv("gpu0", T0 + t, 100.0, {"srv": 1.0}) for t in range(100)]
    ticks.append(wire.Interval(device="gpu0", t_start_s=T0 + 100, t_end_s=T0 + 400, energy_j=3000.0,
                               source="counter", shares={"srv": 1.0}))  # fmt: skip
    repository.ingest_batch(db_engine, batch(1, intervals=ticks), received_at_s=T0)
    assert compute_span_energy(db_engine, now_s=T0 + 1000).windows == 0
    spans = [
        wire.Query(job="srv", t_start_s=T0 + 10, t_end_s=T0 + 11),
        wire.Query(job="srv", t_start_s=T0 + 390, t_end_s=T0 + 400),
    ]
    repository.ingest_batch(db_engine, batch(2, queries=spans), received_at_s=T0)
    compute_span_energy(db_engine, now_s=T0 + 1000, chunk_s=30.0)
    with db_engine.connect() as conn:
        energies = conn.execute(select(queries.c.energy_j).order_by(queries.c.t_start_s)).scalars().all()
        # The longest row: ticks starting at T0 + 60 .. T0 + 100, the last one ending at T0 + 400.
        assert conn.execute(select(jobs.c.max_tick_s)).scalar_one() == 340.0
    assert energies == [pytest.approx(100.0), pytest.approx(100.0)]  # 10 W during the stalled tick
    job = repository.get_job(db_engine, "srv")
    assert job is not None
    assert job["waiting_energy_j"] == pytest.approx(job["energy_j"] - 200.0)


def test_power_now_moves_forward_only(db_engine: Engine) -> None:
    # A retried older batch arriving after a newer one must not turn power now back in time.
    newer = batch(2, intervals=[iv("gpu0", T0 + 10, 400.0, {"j": 1.0})])
    older = batch(1, intervals=[iv("gpu0", T0, 100.0, {"j": 1.0})])
    repository.ingest_batch(db_engine, newer, received_at_s=T0 + 12)
    repository.ingest_batch(db_engine, older, received_at_s=T0 + 13)
    snap = repository.metrics_snapshot(db_engine, now_s=T0 + 14, retention_s=3600.0)
    assert snap.job_power == [("j", "h1", pytest.approx(400.0))]
