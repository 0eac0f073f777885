"""Report, one-job and /metrics latency over a large stored history, and disk per million raw intervals.

Fills a scratch database (SQLite, and PostgreSQL unless ``--sqlite-only``) with a fleet's history by bulk
SQL: ``--hosts`` hosts of 8 GPUs and a CPU package, ``--jobs`` finished jobs spread over ``--days`` days
(each on one host, all its devices, a rollup row per device as ingest would write), an idle row per device
and hour, the per-device totals, and ``--intervals`` raw intervals stored as ingest stores them (``raw_batches``,
30 s of a host's devices per row, compressed; energies vary second to second as measured ones do).
Then it serves the real collector app (in-process ASGI, FastAPI's TestClient, no network) and times, as
the median of ``--repeat`` requests: a 7-day report's first page (``limit=100``), an unpaged
report (``since=10000w``, all jobs, one page) for contrast, one job, and ``/metrics``.

Run: ``python benchmarks/report_scale.py`` (small), or for the target's figures
``python benchmarks/report_scale.py --intervals 10000000 --jobs 20000 --hosts 64 --postgres-only``.
PostgreSQL comes from WATTWATCH_TEST_PG_URL (default postgresql://postgres@127.0.0.1:5432/test); a scratch
database is created and dropped.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ingest import on_pg_scratch
from mdtable import command, paragraph, table

from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine
from wattwatch.storage.retention import fold_idle_days

GPUS = 8
HOUR_S = 3600.0
DAY_S = 86400.0
SIZE_TABLES = ("raw_batches", "job_device_energy", "idle_energy", "idle_energy_days", "jobs", "device_energy")


def fill(engine: Engine, *, intervals: int, jobs: int, hosts: int, days: float, now_s: float) -> list[str]:
    """The history described in the module docstring, committed; returns the job ids in start order."""
    rng = random.Random(1)
    start_s = now_s - days * DAY_S
    dev_rows: list[dict[str, Any]] = []
    host_rows = [
        {"id": h + 1, "name": f"node{h:04d}", "agent_id": f"a{h}", "first_seen_s": start_s, "last_seen_s": now_s}
        for h in range(hosts)
    ]
    for h in range(hosts):
        for i in range(GPUS + 1):
            kind, key = ("gpu", f"gpu{i}") if i < GPUS else ("cpu", "cpu0")
            dev_rows.append({"id": len(dev_rows) + 1, "host_id": h + 1, "key": key, "kind": kind, "index": i})
    per_host = GPUS + 1
    job_rows, jde_rows, jh_rows = [], [], []
    job_ids: list[str] = []
    totals = {d["id"]: [0.0, 0.0] for d in dev_rows}
    for j in range(jobs):
        t0 = start_s + (days * DAY_S - 7200) * j / max(jobs, 1)
        t1 = t0 + rng.uniform(600, 6 * 3600)
        host = j % hosts
        # Random hex ids, as `wattwatch run` makes (uuid4): short-id lookups read only the ids they show.
        job_id = f"{rng.getrandbits(128):032x}"
        job_ids.append(job_id)
        job_rows.append(
            {
                "id": job_id, "name": f"train-{j}", "kind": "training", "labels": {}, "started_at_s": t0,
                "ended_at_s": min(t1, now_s - 60), "created_at_s": t0, "placeholder": False, "max_tick_s": 0.0,
            }
        )  # fmt: skip
        jh_rows.append(
            {"job_id": job_id, "host_id": host + 1, "peak_power_w": 700.0 * GPUS, "first_s": t0, "last_s": t1}
        )
        for i in range(per_host):
            device_id = host * per_host + i + 1
            energy_j = (t1 - t0) * (600.0 if i < GPUS else 150.0)
            totals[device_id][0] += energy_j
            jde_rows.append(
                {
                    "job_id": job_id,
                    "device_id": device_id,
                    "energy_j": energy_j,
                    "sources": "counter",
                    "max_power_w": 700.0,
                }
            )
    idle_rows = []
    hour = start_s - start_s % HOUR_S
    while hour < now_s:
        for d in dev_rows:
            idle_rows.append({"device_id": d["id"], "hour_s": hour, "energy_j": 1000.0})
            totals[d["id"]][1] += 1000.0
        hour += HOUR_S
    from wattwatch.storage import tables as t

    with engine.begin() as conn:
        for tbl, rows in (
            (t.hosts, host_rows),
            (t.devices, dev_rows),
            (t.jobs, job_rows),
            (t.job_hosts, jh_rows),
            (t.job_device_energy, jde_rows),
            (t.idle_energy, idle_rows),
            (t.idle_energy_days, _days(idle_rows)),
        ):
            for k in range(0, len(rows), 20000):
                conn.execute(tbl.insert(), rows[k : k + 20000])
        conn.execute(
            t.device_energy.insert(),
            [{"device_id": d, "job_energy_j": j, "idle_energy_j": i} for d, (j, i) in totals.items()],
        )
        # Raw intervals: one per device and second, going back from now, stored as ingest stores them.
        _fill_raw(conn, intervals, dev_rows, now_s, rng)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE"))  # planner statistics, as a database that grew by ingest would have
    return job_ids


RAW_TICKS_PER_BATCH = 30  # a batch holds 30 s of a host's devices (270 intervals), as agent pushes about do


def _fill_raw(conn: Any, intervals: int, dev_rows: list[dict[str, Any]], now_s: float, rng: random.Random) -> None:
    """``intervals`` raw intervals in ``raw_batches`` rows made by ``raw_batches.batch_row`` (the encoding
    ingest uses), a device's energy varying second to second as measured energy does, so the compressed
    size is not flattered by repetition."""
    from wattwatch.protocol import wire
    from wattwatch.storage import raw_batches
    from wattwatch.storage.tables import raw_batches as raw_table

    per_host: dict[int, list[dict[str, Any]]] = {}
    for d in dev_rows:
        per_host.setdefault(d["host_id"], []).append(d)
    described = {
        h: [wire.Device(key=d["key"], kind=d["kind"], index=d["index"]) for d in devs] for h, devs in per_host.items()
    }
    n_dev = len(dev_rows)
    t0_s = now_s - intervals / n_dev
    rows: list[dict[str, Any]] = []
    seqs = dict.fromkeys(per_host, 0)
    made = 0
    tick = 0
    while made < intervals:
        for host_id, devs in per_host.items():
            batch_ivs: list[wire.Interval] = []
            for k in range(RAW_TICKS_PER_BATCH):
                t_s = t0_s + tick + k
                for d in devs:
                    if made >= intervals:
                        break
                    gpu = d["kind"] == "gpu"
                    batch_ivs.append(
                        wire.Interval(
                            device=d["key"],
                            t_start_s=t_s,
                            t_end_s=t_s + 1.0,
                            energy_j=round(rng.uniform(250.0, 700.0) if gpu else rng.uniform(80.0, 200.0), 3),
                            source="counter",
                            shares={f"job-{host_id}-{int(t_s // 3600)}": 1.0},
                            idle_weight=0.0 if gpu else 1.0,
                        )
                    )
                    made += 1
            if not batch_ivs:
                continue
            seqs[host_id] += 1
            batch = wire.Batch(seq=seqs[host_id], agent_id=f"a{host_id - 1}", host=f"node{host_id - 1:04d}",
                               sent_at_s=t0_s, devices=described[host_id], intervals=batch_ivs)  # fmt: skip
            row = raw_batches.batch_row(host_id, batch, t0_s + tick + RAW_TICKS_PER_BATCH)
            assert row is not None
            rows.append(dict(zip(raw_batches.COLUMNS, row, strict=True)))
            if len(rows) >= 2000:
                conn.execute(raw_table.insert(), rows)
                rows = []
        tick += RAW_TICKS_PER_BATCH
    if rows:
        conn.execute(raw_table.insert(), rows)


def _days(idle_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The idle_energy_days rows ingest keeps beside the hour rows: their sums per device and UTC day."""
    days: dict[tuple[int, float], float] = {}
    for r in idle_rows:
        key = (r["device_id"], r["hour_s"] - r["hour_s"] % DAY_S)
        days[key] = days.get(key, 0.0) + r["energy_j"]
    return [{"device_id": d, "day_s": day_s, "energy_j": e} for (d, day_s), e in days.items()]


def table_bytes(engine: Engine) -> dict[str, int]:
    """Bytes per table, indexes included (PostgreSQL: pg_total_relation_size; SQLite: dbstat)."""
    out = {}
    with engine.connect() as conn:
        for name in SIZE_TABLES:
            if engine.dialect.name == "postgresql":
                out[name] = int(conn.execute(text(f"SELECT pg_total_relation_size('{name}')")).scalar_one())
            else:
                out[name] = int(
                    conn.execute(
                        text(
                            "SELECT COALESCE(SUM(pgsize), 0) FROM dbstat WHERE name = :n OR name IN "
                            "(SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = :n)"
                        ),
                        {"n": name},
                    ).scalar_one()
                )
    return out


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of ``fn`` in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Fill ``url`` and time the reads through the collector app."""
    from fastapi.testclient import TestClient

    from wattwatch.collector import create_app
    from wattwatch.config import Settings

    now_s = time.time()
    migrate.upgrade(url)
    engine = make_engine(url)
    t0 = time.perf_counter()
    job_ids = fill(engine, intervals=args.intervals, jobs=args.jobs, hosts=args.hosts, days=args.days, now_s=now_s)
    fill_s = time.perf_counter() - t0
    # As a collector's prune pass leaves it: idle hours older than two days folded into days.
    t0 = time.perf_counter()
    fold_idle_days(engine, now_s=now_s)
    fold_s = time.perf_counter() - t0
    sizes = table_bytes(engine)
    settings = Settings(home=Path(tempfile.mkdtemp()), retention_days=0.0)
    app = create_app(settings, engine, span_energy_interval_s=None, periodic=False)
    out: dict[str, Any] = {"fill_s": fill_s, "fold_s": fold_s, "sizes": sizes}
    with TestClient(app) as client:

        def get(path: str, **params: Any) -> Any:
            r = client.get(path, params=params)
            assert r.status_code == 200, r.text
            return r

        first = get("/api/v1/report", limit=100).json()
        out["page_jobs"] = len(first["jobs"])
        out["window_jobs"] = first["window"]["since"]
        out["report_ms"] = median_ms(lambda: get("/api/v1/report", limit=100), args.repeat)
        out["report_all_ms"] = median_ms(
            lambda: get("/api/v1/report", since="10000w", limit=10_000), max(1, args.repeat // 3)
        )
        job_id = job_ids[len(job_ids) // 2]
        out["job_ms"] = median_ms(lambda: get(f"/api/v1/jobs/{job_id}"), args.repeat)
        out["metrics_ms"] = median_ms(lambda: get("/metrics"), args.repeat)
    engine.dispose()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run each backend, print the command and the tables."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--intervals", type=int, default=200_000, help="raw interval rows (default 200,000)")
    p.add_argument("--jobs", type=int, default=500, help="finished jobs (default 500)")
    p.add_argument("--hosts", type=int, default=8, help="hosts of 8 GPUs + a CPU (default 8)")
    p.add_argument("--days", type=float, default=30.0, help="days of history the jobs and idle span (default 30)")
    p.add_argument("--repeat", type=int, default=9, help="requests per figure (median; default 9)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--sqlite-only", action="store_true")
    only.add_argument("--postgres-only", action="store_true")
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if min(args.intervals, args.jobs, args.hosts, args.repeat) < 1 or args.days <= 0.1:
        p.error("--intervals, --jobs, --hosts and --repeat must be at least 1, --days more than 0.1")
    rows: list[tuple[str, dict[str, Any]]] = []
    note = ""
    if not args.postgres_only:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(("SQLite", bench(f"sqlite:///{tmp}/scale.db", args)))
    if not args.sqlite_only:
        base = os.environ.get("WATTWATCH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
        row, note = on_pg_scratch(base, lambda url: bench(url, args))
        if row is not None:
            rows.append(("PostgreSQL", row))
    print(command("report_scale.py", argv))
    print(
        paragraph(
            f"**Reads over a large history** ({args.intervals:,} raw intervals, {args.jobs:,} finished jobs over"
            f" {args.days:g} days, {args.hosts} hosts x {GPUS} GPUs + CPU; in-process ASGI app, median of"
            f" {args.repeat} requests; idle hours older than 2 days folded into days first, as the prune pass"
            " does). The last column is an unbounded report (every job, one page), for comparison:"
        )
    )
    print(
        table(
            (
                "database",
                "7-day report, first page (100)",
                "one job",
                "/metrics",
                "all jobs, one page",
                "fill",
                "idle fold",
            ),
            [
                [
                    db,
                    f"{r['report_ms']:.1f} ms",
                    f"{r['job_ms']:.1f} ms",
                    f"{r['metrics_ms']:.1f} ms",
                    f"{r['report_all_ms']:.0f} ms",
                    f"{r['fill_s']:.0f} s",
                    f"{r['fold_s']:.1f} s",
                ]
                for db, r in rows
            ],
        )
    )
    print(paragraph("**Disk per million raw intervals** (table with its indexes; rollup tables in total bytes):"))
    size_rows = []
    for db, r in rows:
        s = r["sizes"]
        size_rows.append(
            [
                db,
                f"{s['raw_batches'] / (args.intervals / 1e6) / 2**20:.1f} MiB",
                *(f"{s[n] / 2**20:.1f} MiB" for n in SIZE_TABLES[1:]),
            ]
        )
    print(table(("database", "raw_batches per 1M intervals", *SIZE_TABLES[1:]), size_rows))
    if note:
        print(f"\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
