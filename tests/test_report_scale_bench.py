"""A reduced run of benchmarks/report_scale.py on SQLite: it prints its command and two tables of finite
figures, the reads the README sets a target for are within it, and the history it fills holds what it says
(jobs, devices, raw intervals decoded back)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import report_scale

from test_benchmark_tables import check_table, tables
from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine
from wattwatch.storage.raw_batches import read_intervals

MAX_READ_MS = 100.0


def test_report_scale_prints_its_tables(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--intervals", "2000", "--jobs", "40", "--hosts", "2", "--days", "10", "--repeat", "1", "--sqlite-only"]
    assert report_scale.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("`python benchmarks/report_scale.py " + " ".join(argv) + "`")
    reads, sizes = tables(out)
    header = (
        "database",
        "7-day report, first page (100)",
        "one job",
        "/metrics",
        "all jobs, one page",
        "fill",
        "idle fold",
    )
    check_table(reads, header, 1)
    # The README's target: the 7-day report's first page, one job and /metrics each within 100 ms (stated at
    # 10M intervals on PostgreSQL; a reduced history must be well inside it).
    ms = dict(zip(header[1:4], (float(cell.removesuffix(" ms")) for cell in reads[1][1:4]), strict=True))
    assert all(0 < v <= MAX_READ_MS for v in ms.values()), ms
    check_table(sizes, ("database", "raw_batches per 1M intervals", *report_scale.SIZE_TABLES[1:]), 1)


def test_fill_holds_what_it_says(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'f.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        ids = report_scale.fill(engine, intervals=1234, jobs=17, hosts=3, days=2, now_s=time.time())
        with engine.connect() as conn:
            count = {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in ("jobs", "devices")}
            raw = sum(1 for _ in read_intervals(conn))
            hosts = {r.host for r in read_intervals(conn)}
            per_job = conn.execute(text("SELECT count(*) FROM job_device_energy")).scalar_one()
    finally:
        engine.dispose()
    assert len(set(ids)) == 17 and count == {"jobs": 17, "devices": 3 * 9}
    assert raw == 1234 and per_job == 17 * 9
    assert hosts == {"node0000", "node0001", "node0002"}
