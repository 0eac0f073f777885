"""Collector ingest and report speed on SQLite and PostgreSQL.

Prints, per database: intervals/s through ``ingest_batch`` (decode + attribution + rollups + raw rows,
one transaction per batch) against a baseline measured in the same run — the same raw rows inserted
with a plain executemany and nothing else — and the time ``build_report`` takes once the database
holds every batch, as a markdown table under the command that produced it.
Run: ``python benchmarks/ingest.py [--batches 50] [--intervals 1000] [--sqlite-only]``.
PostgreSQL comes from WATTWATCH_TEST_PG_URL (default postgresql://postgres@127.0.0.1:5432/test); a
scratch database is created and dropped.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Engine, create_engine, insert, text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mdtable import command, paragraph, table

from wattwatch.protocol import wire
from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine, normalize_url
from wattwatch.storage.repository import build_report, ingest_batch
from wattwatch.storage.tables import energy_intervals

T = TypeVar("T")

GPUS = 8


def make_batches(n_batches: int, n_intervals: int, seed: int = 1) -> list[bytes]:
    """Agent-shaped batches: 8 GPUs + a CPU package ticking at 1 Hz, a few jobs sharing them."""
    rng = random.Random(seed)
    devices = [wire.Device(key=f"gpu{i}", kind="gpu", index=i) for i in range(GPUS)]
    devices.append(wire.Device(key="cpu0", kind="cpu"))
    t_s = 1.8e9
    out = []
    for seq in range(n_batches):
        intervals: list[wire.Interval] = []
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


def pg_scratch(base_url: str) -> tuple[str, Engine, str]:
    """A scratch database on the PostgreSQL server at ``base_url``: (its URL, an admin engine, its name)."""
    admin = create_engine(normalize_url(base_url), isolation_level="AUTOCOMMIT")
    name = f"wattwatch_bench_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return make_url(base_url).set(database=name).render_as_string(hide_password=False), admin, name


def on_pg_scratch(base_url: str, run: Callable[[str], T]) -> tuple[T | None, str]:
    """``run(url)`` on a scratch PostgreSQL database dropped afterwards: (its result, ""), or (None, a note
    saying why PostgreSQL was skipped) when no server answers."""
    try:
        url, admin, name = pg_scratch(base_url)
    except Exception as exc:
        return None, f"(PostgreSQL skipped: {str(exc).splitlines()[0]})"
    try:
        return run(url), ""
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))


def per_s(n: float, seconds: float) -> str:
    """A rate in thousands per second: ``341k``."""
    return f"{n / seconds / 1e3:.0f}k"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the markdown table under the command that produced it."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--intervals", type=int, default=1000, help="intervals per batch")
    ap.add_argument("--sqlite-only", action="store_true", help="skip PostgreSQL")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    bodies = make_batches(args.batches, args.intervals)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(("SQLite", bench(f"sqlite:///{Path(tmp) / 'bench.db'}", bodies)))
    note = "(PostgreSQL skipped: --sqlite-only)" if args.sqlite_only else ""
    if not args.sqlite_only:
        base = os.environ.get("WATTWATCH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
        row, note = on_pg_scratch(base, lambda url: bench(url, bodies))
        if row is not None:
            rows.append(("PostgreSQL", row))
    print(command("ingest.py", argv))
    print(
        paragraph(
            f"**Collector ingest** ({args.batches} agent batches of {args.intervals:,} intervals; one process, one"
            " thread), against a baseline measured in the same run: the same raw rows inserted with a plain"
            " executemany and nothing else:"
        )
    )
    header = ("database", "decode/s", "ingest/s", "baseline/s", "ingest ÷ baseline", "report")
    print(
        table(
            header,
            [
                [
                    db,
                    per_s(r["n"], r["decode_s"]),
                    per_s(r["n"], r["ingest_s"]),
                    per_s(r["n"], r["baseline_s"]),
                    f"{r['ingest_s'] / r['baseline_s']:.2f}x",
                    f"{r['report_s'] * 1e3:.1f} ms",
                ]
                for db, r in rows
            ],
        )
    )
    if note:
        print(f"\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
