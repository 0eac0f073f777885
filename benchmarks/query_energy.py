"""Energy per query: accuracy against the simulator's exact split, and what computing it costs.

1. Accuracy. An inference job on a simulated H100 (power swinging 90-700 W many times a second),
   ~4 requests/s of 0.2-1.5 s. The exact split integrates the board's true power on 1 ms steps and
   shares each step among the requests in flight; wattwatch's split sees only the energy per tick.
   Printed per tick length, over several seeds: the largest p50/p95 error and the median per-query error.
2. Cost. ``split_job_energy`` per 10k spans; one span-energy pass over a backlog of 10k spans (8 GPUs,
   1 s ticks, 100 requests/s) on SQLite and PostgreSQL; and the steady state, a pass every 10 s while
   the same server keeps serving.

Run: ``python benchmarks/query_energy.py [--seeds 8] [--duration 300]``. PostgreSQL comes from
WATTWATCH_TEST_PG_URL (default postgresql://postgres@127.0.0.1:5432/test); a scratch database is
created and dropped.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from wattwatch import wire
from wattwatch.accounting.quantiles import nearest_rank
from wattwatch.accounting.spans import split_job_energy
from wattwatch.sensors.simulated import SimulatedFleet
from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine, normalize_url
from wattwatch.storage.repository import ingest_batch
from wattwatch.storage.span_energy import compute_span_energy

T0 = 1_700_000_000.0
TICKS_S = (1.0, 0.5, 0.2, 0.1)


def poisson_spans(rng: random.Random, rate_hz: float, t0: float, t1: float) -> list[tuple[float, float]]:
    """Requests arriving at ``rate_hz`` (Poisson), lasting 0.2-1.5 s, all inside ``[t0, t1)``."""
    spans = []
    t = t0
    while True:
        t += rng.expovariate(rate_hz)
        d = rng.uniform(0.2, 1.5)
        if t + d >= t1:
            return spans
        spans.append((t, t + d))


def accuracy(seeds: int, duration_s: float) -> dict[float, list[tuple[float, float, float]]]:
    """Per tick length: (p50 error, p95 error, median |per-query error|) for each seed."""
    out: dict[float, list[tuple[float, float, float]]] = {tick: [] for tick in TICKS_S}
    for seed in range(seeds):
        fleet = SimulatedFleet(1, seed=seed, clock=lambda: T0)
        fleet.set_activity(0, "inference", T0)
        spans = poisson_spans(random.Random(seed), 4.0, T0 + 0.5, T0 + duration_s)
        # 1 ms steps of true power as "ticks": the board's power is constant on 10 ms slots.
        fine = [
            (T0 + k / 1000, T0 + (k + 1) / 1000, fleet.power_w(0, T0 + (k + 0.5) / 1000) / 1000)
            for k in range(int(duration_s * 1000))
        ]
        exact = split_job_energy(fine, spans).span_energy_j
        for tick_s in TICKS_S:
            n = round(duration_s / tick_s)
            ticks = [
                (
                    T0 + i * tick_s,
                    T0 + (i + 1) * tick_s,
                    fleet.exact_energy_j(0, T0 + i * tick_s, T0 + (i + 1) * tick_s),
                )
                for i in range(n)
            ]
            got = split_job_energy(ticks, spans).span_energy_j
            errs = [(g / e - 1) for g, e in zip(got, exact, strict=True) if e > 0]
            p50 = (nearest_rank(got, 0.5) or 0) / (nearest_rank(exact, 0.5) or 1) - 1
            p95 = (nearest_rank(got, 0.95) or 0) / (nearest_rank(exact, 0.95) or 1) - 1
            out[tick_s].append((p50, p95, statistics.median(abs(x) for x in errs)))
    return out


def pure_cost_s(n_spans: int, tick_s: float) -> float:
    """Seconds ``split_job_energy`` takes for ``n_spans`` requests at 100/s with ``tick_s`` ticks."""
    rng = random.Random(1)
    duration_s = n_spans / 100.0 + 2
    spans = poisson_spans(rng, 100.0, T0, T0 + duration_s)[:n_spans]
    ticks = [(T0 + i * tick_s, T0 + (i + 1) * tick_s, 400.0 * tick_s) for i in range(round(duration_s / tick_s))]
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        split_job_energy(ticks, spans, bucket_s=60.0)
        best = min(best, time.perf_counter() - t)
    return best


def server_batches(duration_s: float, rate_hz: float, seq0: int = 0, t0: float = T0) -> list[wire.Batch]:
    """10 s of an 8-GPU inference server: one batch of 1 s ticks, one of the requests that ended."""
    rng = random.Random(int(t0))
    devices = [wire.Device(key=f"gpu{i}", kind="gpu", index=i) for i in range(8)]
    job = wire.Job(id="srv", name="llm", kind="inference", started_at_s=T0)
    spans = poisson_spans(rng, rate_hz, t0, t0 + duration_s)
    out = []
    for k, start in enumerate(range(0, int(duration_s), 10)):
        ivs = [
            wire.Interval(
                device=d.key,
                t_start_s=t0 + s,
                t_end_s=t0 + s + 1,
                energy_j=rng.uniform(300, 700),
                source="counter",
                shares={"srv": 1.0},
            )
            for s in range(start, start + 10)
            for d in devices
        ]
        done = [
            wire.Query(job="srv", t_start_s=a, t_end_s=b, tokens_out=100)
            for a, b in spans
            if start <= b - t0 < start + 10
        ]
        seq = seq0 + 2 * k
        out.append(wire.Batch(agent_id="node", seq=seq, host="node-1", devices=devices, jobs=[job], intervals=ivs))
        out.append(wire.Batch(agent_id="node", seq=seq + 1, host="node-1", queries=done))
    return out


def db_cost(url: str) -> dict[str, float]:
    """Backlog pass over 10k spans, and the mean steady-state pass (every 10 s at 100 requests/s)."""
    migrate.upgrade(url)
    engine = make_engine(url)
    backlog = server_batches(100.0, 100.0)
    n_spans = sum(len(b.queries) for b in backlog)
    t = time.perf_counter()
    for b in backlog:
        ingest_batch(engine, b, received_at_s=T0)
    ingest_s = time.perf_counter() - t
    t = time.perf_counter()
    compute_span_energy(engine, now_s=T0 + 200, settle_s=0.0)
    backlog_s = time.perf_counter() - t
    passes = []
    for k in range(10, 30):  # the server keeps going: 10 s of data, then a pass, 20 times
        for b in server_batches(10.0, 100.0, seq0=1000 + 2 * k, t0=T0 + 10 * k):
            ingest_batch(engine, b, received_at_s=T0)
        t = time.perf_counter()
        compute_span_energy(engine, now_s=T0 + 10 * k + 10, settle_s=5.0)
        passes.append(time.perf_counter() - t)
    engine.dispose()
    return {"n": n_spans, "ingest_s": ingest_s, "backlog_s": backlog_s, "steady_s": statistics.mean(passes)}


def main() -> None:
    """Run both parts and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of simulated serving per seed")
    args = ap.parse_args()

    print(f"Accuracy vs the exact split ({args.seeds} seeds x {args.duration:.0f} s, ~4 requests/s)\n")
    print(f"{'tick':>6} {'max |p50 err|':>14} {'max |p95 err|':>14} {'median |query err|':>19}")
    for tick_s, rows in accuracy(args.seeds, args.duration).items():
        p50 = max(abs(r[0]) for r in rows)
        p95 = max(abs(r[1]) for r in rows)
        per_query = statistics.median(r[2] for r in rows)
        print(f"{tick_s:>5}s {p50:>13.2%} {p95:>14.2%} {per_query:>19.2%}")

    print("\nCost of split_job_energy (pure, one thread)\n")
    for tick_s in (1.0, 0.1):
        print(f"  10k spans, {tick_s} s ticks: {pure_cost_s(10_000, tick_s) * 1e3:.0f} ms")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(("sqlite", db_cost(f"sqlite:///{Path(tmp) / 'bench.db'}")))
    base = os.environ.get("WATTWATCH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    try:
        admin = create_engine(normalize_url(base), isolation_level="AUTOCOMMIT")
        name = f"wattwatch_bench_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # no PostgreSQL here: report SQLite alone
        print(f"(PostgreSQL skipped: {str(exc).splitlines()[0]})")
    else:
        try:
            rows.append(
                ("postgresql", db_cost(make_url(base).set(database=name).render_as_string(hide_password=False)))
            )
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    print("\nSpan-energy pass on a database (8 GPUs, 1 s ticks, 100 requests/s)\n")
    print(
        f"{'database':<11} {'spans':>6} {'ingest ms':>10} {'backlog pass ms':>16} {'ms/10k spans':>13} "
        f"{'pass/10 s ms':>13}"
    )
    for db, r in rows:
        per_10k = r["backlog_s"] / r["n"] * 1e4 * 1e3
        print(
            f"{db:<11} {int(r['n']):>6} {r['ingest_s'] * 1e3:>10.0f} {r['backlog_s'] * 1e3:>16.0f} {per_10k:>13.0f} "
            f"{r['steady_s'] * 1e3:>13.1f}"
        )
    print("\nbacklog pass: one pass over 100 s of data already stored; pass/10 s: mean of passes every 10 s")
    print("while serving (each recomputes from the minute before its last horizon, about 1k-6k spans)")


if __name__ == "__main__":
    main()
