"""Pages people read: how many jobs match beyond the page, the default page per format, and a fleet's idle
energy and grid intensities folded to lines a person reads (every device still in CSV and JSON)."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wattwatch.cli.main import main
from wattwatch.protocol import wire
from wattwatch.reporting.options import PAGE_FOR_PEOPLE, PAGE_FOR_PROGRAMS
from wattwatch.storage import repository
from wattwatch.storage.engine import make_engine

JOBS = PAGE_FOR_PEOPLE + 7  # more than a table's default page, fewer than a program's
HOSTS = 4
GPUS = 8


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WATTWATCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")
    return tmp_path / "home"


@pytest.fixture(scope="module")
def fleet_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """JOBS finished jobs over HOSTS hosts of GPUS GPUs in the last day, each on one host's gpu0; every
    other GPU idle for the same seconds, so the idle table has HOSTS x (GPUS - 1) rows."""
    url = f"sqlite:///{tmp_path_factory.mktemp('pages') / 'w.db'}"
    assert main(["db", "upgrade", "--db", url]) == 0
    engine = make_engine(url)
    now_s = time.time()
    devices = [wire.Device(key=f"gpu{i}", kind="gpu") for i in range(GPUS)]
    seqs = dict.fromkeys(range(HOSTS), 0)
    for j in range(JOBS):
        host = j % HOSTS
        t0_s = now_s - 86400 + 60 * j
        job_id = f"job{j:04d}"
        job = wire.Job(id=job_id, name=f"train-{j}", kind="training", started_at_s=t0_s, ended_at_s=t0_s + 10)
        intervals = [wire.Interval("gpu0", t0_s, t0_s + 10, 1000.0 + j, "counter", shares={job_id: 1.0})]
        intervals += [wire.Interval(f"gpu{i}", t0_s, t0_s + 10, 500.0, "counter") for i in range(1, GPUS)]
        seqs[host] += 1
        batch = wire.Batch(
            seq=seqs[host], agent_id=f"a{host}", host=f"node{host}", devices=devices, jobs=[job], intervals=intervals
        )
        repository.ingest_batch(engine, batch, received_at_s=now_s)
    engine.dispose()
    return url


def run_json(url: str, capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    assert main(["report", "--db", url, "--format", "json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_page_counts_the_jobs_on_every_page(fleet_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``jobs_matched`` is every matching job, on each page; the total row says "N of M" and sums the page."""
    first = run_json(fleet_db, capsys, "--limit", "10")
    assert len(first["jobs"]) == 10 and first["jobs_matched"] == JOBS and first["next_cursor"]
    second = run_json(fleet_db, capsys, "--limit", "10", "--cursor", first["next_cursor"])
    assert second["jobs_matched"] == JOBS
    assert [j["id"] for j in second["jobs"]] == [f"job{j:04d}" for j in range(10, 20)]
    # A glob is matched outside SQL: the count and the cursor hold there too.
    glob = run_json(fleet_db, capsys, "--name", "train-1*", "--limit", "5")
    expected = sorted((f"job{j:04d}" for j in range(JOBS) if str(j).startswith("1")), key=lambda i: int(i[3:]))
    assert glob["jobs_matched"] == len(expected) and [j["id"] for j in glob["jobs"]] == expected[:5]
    glob2 = run_json(fleet_db, capsys, "--name", "train-1*", "--limit", "5", "--cursor", glob["next_cursor"])
    assert [j["id"] for j in glob2["jobs"]] == expected[5:10] and glob2["jobs_matched"] == len(expected)
    # One page holding everything: the count is the page's.
    assert run_json(fleet_db, capsys, "--limit", str(JOBS))["jobs_matched"] == JOBS
    capsys.readouterr()
    assert main(["report", "--db", fleet_db, "--limit", "10"]) == 0
    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if line.startswith("TOTAL"))
    assert f"10 of {JOBS} jobs" in total
    assert f"This page: 10 of the {JOBS} jobs that match; totals are this page's" in out


def test_default_page_is_sized_for_who_reads_it(fleet_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A table or markdown shows PAGE_FOR_PEOPLE jobs by default; JSON, CSV, --group-by and --sort the
    program's page (here: every job)."""
    capsys.readouterr()
    assert main(["report", "--db", fleet_db]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("job")]
    assert len(rows) == PAGE_FOR_PEOPLE
    assert f"{PAGE_FOR_PEOPLE} of {JOBS} jobs" in table and "more jobs: --cursor " in table
    assert main(["report", "--db", fleet_db, "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert sum(1 for line in md.splitlines() if "| train-" in line) == PAGE_FOR_PEOPLE
    assert len(run_json(fleet_db, capsys)["jobs"]) == JOBS <= PAGE_FOR_PROGRAMS
    assert main(["report", "--db", fleet_db, "--format", "csv"]) == 0
    assert len(list(csv.DictReader(io.StringIO(capsys.readouterr().out)))) == JOBS
    assert main(["report", "--db", fleet_db, "--sort", "energy"]) == 0
    assert f"{JOBS} jobs" in capsys.readouterr().out


def test_a_fleets_idle_and_intensity_fold_for_people(fleet_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Beyond a screenful of devices the table shows idle energy per host (summed), and hosts on one
    intensity share one carbon line; JSON keeps every device, and the sums agree."""
    report = run_json(fleet_db, capsys)
    per_device = report["idle"]
    assert len(per_device) == HOSTS * (GPUS - 1)  # gpu0 is always a job's
    assert main(["report", "--db", fleet_db]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Idle energy (held by no job)"))
    assert "per host (per device: csv or json)" in lines[start]
    assert lines[start + 1].split() == ["HOST", "DEVICES", "ENERGY"]
    rows = [line.split() for line in lines[start + 2 : start + 2 + HOSTS]]
    assert [r[0] for r in rows] == [f"node{h}" for h in range(HOSTS)]
    for host_row in rows:
        mine = [i for i in per_device if i["host"] == host_row[0]]
        assert int(host_row[1]) == len(mine) == GPUS - 1
        # The per-host sum of the JSON's devices, in kJ as the table prints it (500 J per device and job).
        assert float(host_row[2]) == pytest.approx(sum(i["energy_j"] for i in mine) / 1e3, rel=5e-3)
        assert host_row[3] == "kJ"
    carbon = [line for line in lines if "g/kWh (" in line]
    assert carbon == [f"  {HOSTS} hosts (node0 ... node{HOSTS - 1}): 400 g/kWh (config default)"]


# Ids that a natural-language collation orders differently from their bytes ("a-c" after "ab" in en-US).
SAME_INSTANT_IDS = ["NULL", "Z", "a-c", "ab", "b", "a_c", "A", "a.c", "a/c", "ns/x:1@y"]


@pytest.fixture
def icu_pg_url() -> Iterator[str]:
    """A scratch PostgreSQL database whose default collation is ICU en-US, migrated; dropped after."""
    import os
    import uuid

    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from conftest import PG_DEFAULT_URL, _admin_engine, unavailable
    from wattwatch.storage import migrate

    base = os.environ.get("WATTWATCH_TEST_PG_URL", PG_DEFAULT_URL)
    admin = _admin_engine(base)  # conftest's: autocommit, a 3 s connect timeout
    name = f"wattwatch_icu_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(
                text(
                    f"CREATE DATABASE \"{name}\" TEMPLATE template0 ENCODING 'UTF8' LOCALE 'C.UTF-8' "
                    "LOCALE_PROVIDER icu ICU_LOCALE 'en-US'"
                )
            )
    except Exception as exc:
        admin.dispose()
        unavailable(f"no PostgreSQL with ICU collations: {str(exc).splitlines()[0]}")
    url = make_url(base).set(database=name).render_as_string(hide_password=False)
    try:
        migrate.upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_pages_hold_every_job_once_whatever_the_collation(icu_pg_url: str) -> None:
    """Jobs that started at the same instant are paged by their ids' bytes, as the cursor compares them:
    walking one-job pages, with and without a name glob, meets each job once, on a database whose
    collation orders "a-c" after "ab"."""
    from wattwatch.storage.reads import build_report

    engine = make_engine(icu_pg_url)
    now_s = time.time()
    t0_s = now_s - 3600
    jobs = [
        wire.Job(id=job_id, name=f"j-{job_id}", kind="training", started_at_s=t0_s, ended_at_s=t0_s + 10)
        for job_id in SAME_INSTANT_IDS
    ]
    intervals = [
        wire.Interval("gpu0", t0_s, t0_s + 10, 800.0, "counter", shares={j.id: 1.0 for j in jobs}),
    ]
    batch = wire.Batch(
        seq=1, agent_id="a", host="h", devices=[wire.Device(key="gpu0", kind="gpu")], jobs=jobs, intervals=intervals
    )
    repository.ingest_batch(engine, batch, received_at_s=now_s)
    try:
        for name in (None, "j-*"):
            seen: list[str] = []
            cursor = None
            for _ in range(len(SAME_INSTANT_IDS) + 2):
                page = build_report(engine, since_s=now_s - 86400, limit=1, cursor=cursor, name=name, now_s=now_s)
                assert page["jobs_matched"] == len(SAME_INSTANT_IDS)
                seen += [j["id"] for j in page["jobs"]]
                cursor = page["next_cursor"]
                if cursor is None:
                    break
            assert seen == sorted(SAME_INSTANT_IDS), name  # each once, in Python's (code point) order
    finally:
        engine.dispose()


def test_a_page_of_several_states_idle_energy_without_a_share(
    fleet_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Idle energy is the window's, jobs are the page's: on one page of several a share of the two would
    be wrong (28.6 % where the whole window's is 9.1 %), so that page says the idle energy and how to get
    its share; one page holding every job gives the share; later pages carry no idle energy at all."""
    whole = run_json(fleet_db, capsys, "--limit", str(JOBS))
    first = run_json(fleet_db, capsys, "--limit", "10")
    assert 0.0 < whole["totals"]["idle_share"] < 1.0 and first["next_cursor"]
    runs = {
        "one page": ["--limit", str(JOBS)],
        "first of several": ["--limit", "10"],
        "second": ["--limit", "10", "--cursor", first["next_cursor"]],
    }
    lines = {}
    for what, args in runs.items():
        capsys.readouterr()
        assert main(["report", "--db", fleet_db, *args]) == 0
        lines[what] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Idle:")]
    share = f"{whole['totals']['idle_share'] * 100:.1f} %"
    assert len(lines["one page"]) == 1 and share in lines["one page"][0]
    assert len(lines["first of several"]) == 1 and "%" not in lines["first of several"][0]
    assert f"--limit {JOBS}" in lines["first of several"][0]
    assert lines["second"] == []


@given(st.floats(min_value=1e-12, max_value=1e15))
def test_figures_never_print_an_exponent(value: float) -> None:
    """Three significant digits (a whole number from 1000 up), and never the 1.66e+03 people misread."""
    from wattwatch.reporting.render import figure, format_energy, format_grams

    text = figure(value)
    assert "e" not in text and "inf" not in text
    assert float(text) == pytest.approx(value, rel=5e-3, abs=0.5 if value >= 999.5 else 0.0)
    assert "e+" not in format_energy(value) and "e-" not in format_energy(value)
    assert "e+" not in format_grams(value) and "e-" not in format_grams(value)
