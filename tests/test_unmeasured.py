"""Time no reading covers, in reports: intervals flagged ``gap`` (an agent's full disk) and ``restart_gap``
(an outage no counter bridged) that overlap a job's devices and window give its ``unmeasured_s`` (their
union, cut to its window), on SQLite and PostgreSQL, in JSON, CSV and the table's "N s not measured"."""

from __future__ import annotations

import csv
import io
import math
import time

from sqlalchemy import Engine

from wattwatch.cli.run import summary_line
from wattwatch.protocol import wire
from wattwatch.reporting.render import render
from wattwatch.storage.reads import build_report, get_job
from wattwatch.storage.repository import ingest_batch

HOST = "gap-host"
DEVICES = [
    wire.Device(key="gpu0", kind="gpu", index=0),
    wire.Device(key="gpu1", kind="gpu", index=1),
    wire.Device(key="gpu2", kind="gpu", index=2),
    wire.Device(key="cpu0", kind="cpu"),
]
POWER_W = 200.0


def seconds(
    device: str, t0_s: float, t1_s: float, shares: dict[str, float], holes: list[tuple[float, float, str]]
) -> list[wire.Interval]:
    """1 s intervals of ``device`` over ``[t0_s, t1_s)`` at POWER_W, except over ``holes`` (start, end, flag):
    one zero-energy interval flagged so each."""
    out = []
    t_s = t0_s
    while t_s < t1_s:
        hole = next((h for h in holes if h[0] == t_s), None)
        if hole is not None:
            out.append(wire.Interval(device, hole[0], hole[1], 0.0, "counter", shares=shares, flags=[hole[2]]))
            t_s = hole[1]
            continue
        out.append(wire.Interval(device, t_s, t_s + 1.0, POWER_W, "counter", shares=shares))
        t_s += 1.0
    return out


def fill(engine: Engine) -> float:
    """Jobs a (gpu0 and half of cpu0), b (gpu1 and half of cpu0) and c (gpu2), 100 s each from ``t0``;
    returns ``t0``."""
    t0 = math.floor(time.time()) - 3600.0
    jobs = [wire.Job(id=j, name=f"job-{j}", kind="training", started_at_s=t0, ended_at_s=t0 + 100.0) for j in "abc"]
    intervals = [
        # a's GPU: 20 s its agent had to drop, and a dropped span reaching 20 s past a's end.
        *seconds("gpu0", t0, t0 + 120.0, {"a": 1.0}, [(t0 + 30, t0 + 50, "gap"), (t0 + 90, t0 + 120, "gap")]),
        # b's GPU: 20 s an agent restart could not bridge.
        *seconds("gpu1", t0, t0 + 100.0, {"b": 1.0}, [(t0 + 40, t0 + 60, "restart_gap")]),
        # The CPU both share: 10 s dropped, overlapping a's and b's GPU gaps.
        *seconds("cpu0", t0, t0 + 100.0, {"a": 0.5, "b": 0.5}, [(t0 + 45, t0 + 55, "gap")]),
        *seconds("gpu2", t0, t0 + 100.0, {"c": 1.0}, []),
    ]
    batch = wire.Batch(
        agent_id="gap-agent", seq=0, host=HOST, sent_at_s=t0 + 120.0, devices=DEVICES, intervals=intervals, jobs=jobs
    )
    ingest_batch(engine, batch, received_at_s=t0 + 120.0)
    return t0


def test_a_jobs_unmeasured_seconds_are_the_union_of_its_devices_gaps_within_its_window(db_engine: Engine) -> None:
    fill(db_engine)
    report = build_report(db_engine)
    jobs = {j["name"]: j for j in report["jobs"]}
    # a: gpu0 30-50 and 90-100 (cut at its end), cpu0 45-55: 30-55 and 90-100 are 35 s.
    assert jobs["job-a"]["unmeasured_s"] == 35.0
    # b: gpu1 40-60, cpu0 45-55 within it: 20 s, not 30.
    assert jobs["job-b"]["unmeasured_s"] == 20.0
    assert jobs["job-c"]["unmeasured_s"] == 0.0  # another GPU's gaps are not its
    # Its energy is what was measured: its window less the time its GPU was not measured, and its CPU share.
    assert jobs["job-a"]["gpu_energy_j"] == (100 - 20 - 10) * POWER_W
    assert jobs["job-a"]["cpu_energy_j"] == (100 - 10) * POWER_W / 2
    one = get_job(db_engine, jobs["job-a"]["id"])
    assert one is not None and one["unmeasured_s"] == 35.0


def test_the_table_says_not_measured_and_csv_carries_it(db_engine: Engine) -> None:
    fill(db_engine)
    report = build_report(db_engine)
    table = render(report, "table", width=0)
    lines = [line for line in table.splitlines() if "not measured" in line]
    assert len(lines) == 2, table
    short = {j["name"]: j["short_id"] for j in report["jobs"]}
    assert any(line.startswith(f"{short['job-a']}: 35 s not measured of its 1m40s") for line in lines), lines
    assert any(line.startswith(f"{short['job-b']}: 20 s not measured") for line in lines), lines
    assert "not measured" in render(report, "markdown")
    rows = {r["name"]: r for r in csv.DictReader(io.StringIO(render(report, "csv")))}
    assert [float(rows[f"job-{j}"]["unmeasured_s"]) for j in "abc"] == [35.0, 20.0, 0.0]


def test_the_run_summary_says_how_much_was_not_measured(db_engine: Engine) -> None:
    fill(db_engine)
    jobs = {j["name"]: j for j in build_report(db_engine)["jobs"]}
    # gpu0 70 s and half of cpu0 over 90 s at 200 W: 23 kJ over its 100 s, 35 s of which not measured.
    assert "23 kJ in 1m40s (35 s of it not measured), avg 230 W" in summary_line(jobs["job-a"])
    assert "not measured" not in summary_line(jobs["job-c"])
