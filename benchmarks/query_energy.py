"""Energy per query: what wattwatch measures, against a truth computed without wattwatch; and its cost.

1. Accuracy. An inference server on a simulated H100 (power swinging 90-700 W many times a second)
   serves ~4 requests/s of 0.2-1.5 s each, for ``--duration`` seconds, once per seed.

   - Truth (``exact_split``): the simulator's exact integral of the board's true power, cut at every
     request's start and end, each piece shared equally by the requests in flight. No wattwatch code.
   - Measured: what wattwatch produces from sensor readings. Its NVML sensor reads the fake ``pynvml``
     board on a fake clock: a boundary read when the job opens and when it closes, tick reads every
     interval length on the agent's grid (which does not start with the job, and whose timer wakes up to
     2 ms late); the agent's sampler turns the readings into intervals; the collector (SQLite: ingest,
     then the span-energy pass) shares them among the requests. The energies are read back from the
     database.

   Printed per interval length: the worst p50 and p95 J/query error over the seeds, the per-query
   error (median and 95th percentile over every query of every seed), the worst error of the sum over
   the requests, and the worst error of the job's energy (its intervals against the exact integral).
2. Cost. ``split_job_energy`` per 10k spans; one span-energy pass over a backlog (8 GPUs, 1 s ticks,
   100 requests/s) on SQLite and PostgreSQL; and the steady state, a pass every 10 s while the same
   server keeps serving.

Run: ``python benchmarks/query_energy.py [--seeds 8] [--duration 300] [--part all|accuracy|cost]``.
PostgreSQL comes from WATTWATCH_TEST_PG_URL (default postgresql://postgres@127.0.0.1:5432/test); a
scratch database is created and dropped (``--sqlite-only`` skips it).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sqlalchemy import Engine, select, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exact_split import exact_request_energy, quantile
from ingest import pg_scratch
from mdtable import command, paragraph, percent, table

from wattwatch.accounting.spans import split_job_energy
from wattwatch.agent.sampler import Sampler
from wattwatch.protocol import wire
from wattwatch.sensors.nvml import NvmlSensor
from wattwatch.sim.clock import FakeClock
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine
from wattwatch.storage.repository import ingest_batch
from wattwatch.storage.span_energy import compute_span_energy
from wattwatch.storage.tables import queries

T0 = 1_700_000_000.0
INTERVALS_S = (1.0, 0.5, 0.2, 0.1)
DRIVER_LOADED_BEFORE_S = 600.0  # the counter is large, as on any running host
TIMER_LATE_S = 0.002  # how late the agent's tick timer may wake up
CHUNK = 2000  # intervals or spans per batch, as an agent sends them over several pushes


def poisson_spans(rng: random.Random, rate_hz: float, t0: float, t1: float) -> list[tuple[float, float]]:
    """Requests arriving at ``rate_hz`` (Poisson), lasting 0.2-1.5 s, all inside ``[t0, t1)``."""
    spans: list[tuple[float, float]] = []
    t = t0
    while True:
        t += rng.expovariate(rate_hz)
        d = rng.uniform(0.2, 1.5)
        if t + d >= t1:
            return spans
        spans.append((t, t + d))


# -- 1. accuracy ----------------------------------------------------------------------------------


@dataclass
class Trial:
    """One seed at one interval length: per-request energies, measured and exact (same order)."""

    seed: int
    interval_s: float
    measured_j: list[float]
    exact_j: list[float]
    job_error: float  # the job's energy (sum of its intervals) against the exact integral over them


def measured_intervals(seed: int, duration_s: float, interval_s: float, job_id: str) -> list[wire.Interval]:
    """The intervals an agent reading board 0 through wattwatch's NVML sensor closes for the job."""
    clock = FakeClock(T0 - DRIVER_LOADED_BEFORE_S)
    fleet = SimulatedFleet(1, seed=seed, clock=clock)
    fleet.set_activity(0, "inference", T0)
    clock.t_s = T0 - 2.0  # the agent started a little before the job
    sensor = NvmlSensor(fleet.module(), clock=clock, sleep=clock.sleep, power_sample_interval_s=None)
    sampler = Sampler([sensor])
    end_s = T0 + duration_s
    rng = random.Random(seed * 1000 + round(interval_s * 1000))

    running = False  # as in the agent: an interval belongs to the jobs registered when it is closed

    def held(_device: object, _t_start_s: float, _t_end_s: float) -> tuple[dict[str, float], float]:
        return ({job_id: 1.0} if running else {}), 0.0

    def at(t_s: float) -> None:
        clock.t_s = max(clock.t_s, t_s)

    out: list[wire.Interval] = []
    at(T0 - 1.0)
    sampler.sample(held)  # the agent's reading before the job: intervals start here
    at(T0)
    sampler.sample(held, at_s=T0)  # the job opens: boundary read
    running = True
    first_s = T0 + rng.uniform(0.0, interval_s)  # the agent's grid was not started by this job
    k = 0
    while (tick_s := first_s + k * interval_s + rng.uniform(0.0, TIMER_LATE_S)) < end_s:
        at(tick_s)
        out += sampler.sample(held)
        k += 1
    at(end_s)
    out += sampler.sample(held, at_s=end_s)  # the job closes: boundary read
    sensor.close()
    return out


def collector_split(
    engine: Engine,
    host: str,
    job_id: str,
    intervals: list[wire.Interval],
    spans: list[tuple[float, float]],
    end_s: float,
) -> list[float]:
    """Ingest the intervals and spans, run the collector's span-energy pass, read each span's J back."""
    devices = [wire.Device(key="gpu0", kind="gpu", index=0)]
    job = wire.Job(id=job_id, name="bench-serve", kind="inference", started_at_s=T0, ended_at_s=end_s)
    batches = [
        wire.Batch(agent_id=host, seq=k, host=host, devices=devices, jobs=[job], intervals=intervals[i : i + CHUNK])
        for k, i in enumerate(range(0, len(intervals), CHUNK))
    ]
    wq = [wire.Query(job=job_id, t_start_s=a, t_end_s=b) for a, b in spans]
    batches += [
        wire.Batch(agent_id=host + "-sdk", seq=k, host=host, queries=wq[i : i + CHUNK])
        for k, i in enumerate(range(0, len(wq), CHUNK))
    ]
    for b in batches:
        ingest_batch(engine, b, received_at_s=end_s)
    compute_span_energy(engine, now_s=end_s + 3600, settle_s=0.0)
    with engine.connect() as conn:
        rows = conn.execute(
            select(queries.c.t_start_s, queries.c.t_end_s, queries.c.energy_j).where(queries.c.job_id == job_id)
        ).all()
    got = {(r.t_start_s, r.t_end_s): r.energy_j for r in rows}
    if len(got) != len(spans) or any(got.get(s) is None for s in spans):
        raise SystemExit(f"{job_id}: the collector stored {len(got)} of {len(spans)} spans with energy")
    return [float(got[s]) for s in spans]


def accuracy(seeds: int, duration_s: float, intervals_s: Sequence[float], db_url: str) -> list[Trial]:
    """Every seed at every interval length, against the exact split."""
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    trials = []
    try:
        for seed in range(seeds):
            truth = SimulatedFleet(1, seed=seed, clock=lambda: T0 - DRIVER_LOADED_BEFORE_S)
            truth.set_activity(0, "inference", T0)
            end_s = T0 + duration_s
            spans = poisson_spans(random.Random(seed), 4.0, T0 + 0.5, end_s)
            exact_j, waiting_j = exact_request_energy(partial(truth.exact_energy_j, 0), spans, T0, end_s)
            # The truth keeps every joule: requests + waiting == the board's energy over the job.
            whole_j = truth.exact_energy_j(0, T0, end_s)
            if not math.isclose(math.fsum(exact_j) + waiting_j, whole_j, rel_tol=1e-9):
                raise SystemExit(f"seed {seed}: the exact split lost energy")
            for interval_s in intervals_s:
                job_id = f"serve-{seed}-{interval_s:g}"
                ivs = measured_intervals(seed, duration_s, interval_s, job_id)
                # A late tick read can move the closing boundary a few ms past end_s, as in the agent.
                closed_s = max(end_s, ivs[-1].t_end_s)
                got = collector_split(engine, f"bench-{seed}-{interval_s:g}", job_id, ivs, spans, closed_s)
                job_j = math.fsum(iv.energy_j for iv in ivs)
                job_exact_j = truth.exact_energy_j(0, ivs[0].t_start_s, ivs[-1].t_end_s)
                trials.append(Trial(seed, interval_s, got, exact_j, job_j / job_exact_j - 1))
    finally:
        engine.dispose()
    return trials


def accuracy_rows(trials: list[Trial], intervals_s: Sequence[float]) -> list[list[str]]:
    """One table row per interval length."""
    rows = []
    for interval_s in intervals_s:
        mine = [t for t in trials if t.interval_s == interval_s]
        p50 = [quantile(t.measured_j, 0.5) / quantile(t.exact_j, 0.5) - 1 for t in mine]
        p95 = [quantile(t.measured_j, 0.95) / quantile(t.exact_j, 0.95) - 1 for t in mine]
        total = [math.fsum(t.measured_j) / math.fsum(t.exact_j) - 1 for t in mine]
        per_query = [abs(m / x - 1) for t in mine for m, x in zip(t.measured_j, t.exact_j, strict=True) if x > 0]
        rows.append(
            [
                f"{interval_s:g} s",
                percent(max(p50, key=abs)),
                percent(max(p95, key=abs)),
                percent(statistics.median(per_query), sign=False),
                percent(quantile(per_query, 0.95), sign=False),
                percent(max(total, key=abs), 3),
                percent(max((t.job_error for t in mine), key=abs), 3),
            ]
        )
    return rows


ACCURACY_HEADER = (
    "interval length",
    "worst p50 J/query error",
    "worst p95 J/query error",
    "per-query error, median",
    "per-query error, p95",
    "worst sum error",
    "worst job energy error",
)


# -- 2. cost --------------------------------------------------------------------------------------


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


def db_cost(url: str, backlog_s: float, passes: int) -> dict[str, float]:
    """A pass over a ``backlog_s`` backlog at 100 requests/s, then the mean of ``passes`` steady passes."""
    migrate.upgrade(url)
    engine = make_engine(url)
    backlog = server_batches(backlog_s, 100.0)
    n_spans = sum(len(b.queries) for b in backlog)
    t = time.perf_counter()
    for b in backlog:
        ingest_batch(engine, b, received_at_s=T0)
    ingest_s = time.perf_counter() - t
    t = time.perf_counter()
    compute_span_energy(engine, now_s=T0 + backlog_s + 100, settle_s=0.0)
    backlog_pass_s = time.perf_counter() - t
    steady = []
    first = math.ceil(backlog_s / 10)
    for k in range(first, first + passes):  # the server keeps going: 10 s of data, then a pass
        for b in server_batches(10.0, 100.0, seq0=100_000 + 2 * k, t0=T0 + 10 * k):
            ingest_batch(engine, b, received_at_s=T0)
        t = time.perf_counter()
        compute_span_energy(engine, now_s=T0 + 10 * k + 10, settle_s=5.0)
        steady.append(time.perf_counter() - t)
    engine.dispose()
    return {
        "n": n_spans,
        "ingest_s": ingest_s,
        "backlog_s": backlog_pass_s,
        "steady_s": statistics.mean(steady) if steady else math.nan,
    }


def db_rows(backlog_s: float, passes: int, sqlite_only: bool) -> tuple[list[list[str]], str]:
    """The database table's rows, and a note when PostgreSQL was skipped."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        results.append(("SQLite", db_cost(f"sqlite:///{Path(tmp) / 'bench.db'}", backlog_s, passes)))
    note = ""
    base = os.environ.get("WATTWATCH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    if sqlite_only:
        note = "(PostgreSQL skipped: --sqlite-only)"
    else:
        try:
            url, admin, name = pg_scratch(base)
        except Exception as exc:  # no PostgreSQL here: report SQLite alone
            note = f"(PostgreSQL skipped: {str(exc).splitlines()[0]})"
        else:
            try:
                results.append(("PostgreSQL", db_cost(url, backlog_s, passes)))
            finally:
                with admin.connect() as conn:
                    conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    rows = [
        [
            db,
            f"{int(r['n']):,}",
            f"{r['ingest_s'] * 1e3:.0f} ms",
            f"{r['backlog_s'] * 1e3:.0f} ms",
            f"{r['backlog_s'] / r['n'] * 1e7:.0f} ms",
            f"{r['steady_s'] * 1e3:.1f} ms",
        ]
        for db, r in results
    ]
    return rows, note


# -- output ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the parts asked for and print their tables (markdown, each under the command that made it)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "accuracy", "cost"), default="all")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of simulated serving per seed")
    ap.add_argument("--intervals", type=float, nargs="+", default=list(INTERVALS_S), help="interval lengths, s")
    ap.add_argument("--backlog", type=float, default=100.0, help="seconds of serving in the backlog pass")
    ap.add_argument("--passes", type=int, default=20, help="steady-state passes, one per 10 s of serving")
    ap.add_argument("--sqlite-only", action="store_true", help="skip PostgreSQL in the cost part")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    print(command("query_energy.py", argv))
    if args.part in ("all", "accuracy"):
        with tempfile.TemporaryDirectory() as tmp:
            trials = accuracy(args.seeds, args.duration, args.intervals, f"sqlite:///{Path(tmp) / 'accuracy.db'}")
        n = statistics.mean(len(t.exact_j) for t in trials)
        plural = "s" if args.seeds != 1 else ""
        print(
            paragraph(
                f"**Energy per query** against the exact split of the simulator's true power among the requests in"
                f" flight (computed without wattwatch); measured: wattwatch's NVML sensor reading the simulated"
                f" H100, the agent's sampler, the collector's span-energy pass. {args.seeds} seed{plural} x"
                f" {args.duration:g} s of bursty inference, {n:.0f} requests per seed:"
            )
        )
        print(table(ACCURACY_HEADER, accuracy_rows(trials, args.intervals)))
    if args.part in ("all", "cost"):
        print(paragraph("**Cost of the split**, pure (`split_job_energy`, one thread, best of 3):"))
        pure = [[f"{s:g} s", f"{pure_cost_s(10_000, s) * 1e3:.0f} ms"] for s in (1.0, 0.1)]
        print(table(("intervals", "10k spans"), pure))
        rows, note = db_rows(args.backlog, args.passes, args.sqlite_only)
        print(
            paragraph(
                f"**Span-energy pass on a database** (8 GPUs, 1 s intervals, 100 requests/s): one pass over a"
                f" {args.backlog:g} s backlog already stored, then the mean of {args.passes} passes run every 10 s"
                f" while the server keeps serving:"
            )
        )
        print(table(("database", "spans", "ingest", "backlog pass", "per 10k spans", "pass every 10 s"), rows))
        if note:
            print(f"\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
