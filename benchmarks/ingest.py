"""Collector ingest and report speed on SQLite and PostgreSQL.

Prints, per database: intervals/s through ``ingest_batch`` (decode + attribution + rollups + raw rows,
one transaction per batch) against a baseline measured in the same run — the same raw rows inserted
with a plain executemany and nothing else — and the time ``build_report`` takes once the database
holds every batch. Run: ``python benchmarks/ingest.py [--batches 50] [--intervals 1000]``.
PostgreSQL comes from WATTWATCH_TEST_PG_URL (default postgresql://postgres@127.0.0.1:5432/test); a
scratch database is created and dropped.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

from wattwatch import wire
from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine, normalize_url
from wattwatch.storage.repository import build_report, ingest_batch
from wattwatch.storage.tables import energy_intervals

GPUS = 8


def make_batches(n_batches: int, n_intervals: int, seed: int = 1) -> list[bytes]:
    """Agent-shaped batches: 8 GPUs + a CPU package ticking at 1 Hz, a few jobs sharing them."""
    rng = random.Random(seed)
    devices = [wire.Device(key=f"gpu{i}", kind="gpu", index=i) for i in range(GPUS)]
    devices.append(wire.Device(key="cpu0", kind="cpu"))
    t_s = 1.8e9
    out = []
    for seq in range(n_batches):
        intervals = []
        while len(intervals) < n_intervals:
            for dev in devices:
                job = f"job-{(int(t_s) // 600 + dev.index // 2) % 40}"
                shares = {job: 1.0} if dev.kind == "gpu" and rng.random() < 0.8 else {}
                idle_weight = 4.0 if dev.kind == "cpu" else 0.0
                if dev.kind == "cpu":
                    shares = {job: rng.uniform(0.5, 2.0)}
                intervals.append(
                    wire.Interval(
                        device=dev.key,
                        t_start_s=t_s,
                        t_end_s=t_s + 1.0,
                        energy_j=rng.uniform(60, 700),
                        source="counter",
                        shares=shares,
                        idle_weight=idle_weight,
                    )
                )
            t_s += 1.0
        batch = wire.Batch(
            agent_id="bench", seq=seq, host="node-1", sent_at_s=t_s, devices=devices, intervals=intervals[:n_intervals]
        )
        out.append(wire.encode(batch))
    return out


def bench(url: str, bodies: list[bytes]) -> dict[str, float]:
    """Seconds for: decode, full ingest, baseline raw insert; report time; intervals count."""
    migrate.upgrade(url)
    engine = make_engine(url)
    t0 = time.perf_counter()
    batches = [wire.decode_batch(b) for b in bodies]
    decode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for batch in batches:
        ingest_batch(engine, batch, received_at_s=batch.sent_at_s)
    ingest_s = time.perf_counter() - t0
    # Baseline: the same raw rows, one executemany per batch, no attribution, no rollups.
    with engine.connect() as conn:
        device_id = conn.execute(text("SELECT min(id) FROM devices")).scalar_one()
    t0 = time.perf_counter()
    for batch in batches:
        rows = [
            {
                "device_id": device_id,
                "t_start_s": iv.t_start_s,
                "t_end_s": iv.t_end_s,
                "energy_j": iv.energy_j,
                "source": iv.source,
                "flags": "",
            }
            for iv in batch.intervals
        ]
        with engine.begin() as conn:
            conn.execute(insert(energy_intervals), rows)
    baseline_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = build_report(engine)
    report_s = time.perf_counter() - t0
    engine.dispose()
    n = sum(len(b.intervals) for b in batches)
    return {
        "n": n,
        "decode_s": decode_s,
        "ingest_s": ingest_s,
        "baseline_s": baseline_s,
        "report_s": report_s,
        "jobs": len(report["jobs"]),
    }


def pg_scratch(base_url: str) -> tuple[str, object]:
    admin = create_engine(normalize_url(base_url), isolation_level="AUTOCOMMIT")
    name = f"wattwatch_bench_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return make_url(base_url).set(database=name).render_as_string(hide_password=False), (admin, name)


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--intervals", type=int, default=1000, help="intervals per batch")
    args = ap.parse_args()
    bodies = make_batches(args.batches, args.intervals)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(("sqlite", bench(f"sqlite:///{Path(tmp) / 'bench.db'}", bodies)))
    base = os.environ.get("WATTWATCH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    try:
        url, (admin, name) = pg_scratch(base)  # type: ignore[misc]
    except Exception as exc:
        print(f"(PostgreSQL skipped: {str(exc).splitlines()[0]})")
    else:
        try:
            rows.append(("postgresql", bench(url, bodies)))
        finally:
            with admin.connect() as conn:  # type: ignore[attr-defined]
                conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    print(f"{args.batches} batches x {args.intervals} intervals, one process, one thread\n")
    print(
        f"{'database':<11} {'decode/s':>11} {'ingest/s':>10} {'baseline/s':>11} {'ingest÷base':>12} "
        f"{'report ms':>10} {'jobs':>5}"
    )
    for name_, r in rows:
        n = r["n"]
        print(
            f"{name_:<11} {n / r['decode_s']:>11,.0f} {n / r['ingest_s']:>10,.0f} {n / r['baseline_s']:>11,.0f} "
            f"{r['ingest_s'] / r['baseline_s']:>11.2f}x {r['report_s'] * 1e3:>10.1f} {int(r['jobs']):>5}"
        )
    print("\ningest/s: intervals/s through ingest_batch (attribution, rollups, raw rows, one transaction per batch)")
    print("baseline/s: the same raw rows inserted with executemany, nothing else (same run, same database)")


if __name__ == "__main__":
    main()
