"""Energy per query through the real processes, against a split of the simulator's truth made without wattwatch.

Starts ``wattwatch up --simulate 1`` (once with the fine tick while requests flow, once with the 1 s
tick only), runs an SDK inference server on the simulated GPU that serves overlapping requests
(Poisson arrivals, ~4/s, 0.2-1.5 s each) for ``--seconds``, stops everything, then compares the
per-query energies the collector stored with the exact split (``exact_split``): the board's exact
energy, replayed from the simulator's truth log, cut at every request's start and end and shared
equally by the requests in flight. Prints the markdown table under the command that produced it.
Run: ``python benchmarks/query_energy_live.py [--seconds 40] [--repeat 1]`` (about 2 x repeat x (seconds +
15) s; a row per run, so ``--repeat`` shows how much the figures move from one real-time run to the next).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exact_split import exact_request_energy, quantile
from mdtable import command, paragraph, percent, table

from wattwatch.sim.fleet import SimulatedFleet

SERVER = textwrap.dedent(
    """
    import random, sys, threading, time, wattwatch
    seconds = float(sys.argv[1])
    rng = random.Random(5)
    def serve(d):
        with wattwatch.query(tokens_in=100, tokens_out=50):
            time.sleep(d)
    threads = []
    with wattwatch.job("live-serve", kind="inference"):
        end = time.time() + seconds
        while time.time() < end:
            time.sleep(rng.expovariate(4.0))
            t = threading.Thread(target=serve, args=(rng.uniform(0.2, 1.5),))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
    """
)


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(tmp: Path, seconds: float, fine_interval_s: float) -> dict[str, float]:
    """One `up` + server run; returns the measured and exact p50/p95 and the median per-query error."""
    tmp.mkdir(parents=True, exist_ok=True)
    home = tmp / f"home-{fine_interval_s}"
    db = tmp / f"live-{fine_interval_s}.db"
    port = free_port()
    env = {**os.environ, "WATTWATCH_HOME": str(home)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wattwatch.cli.main",
            "up",
            "--simulate",
            "1",
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            f"sqlite:///{db}",
            "--fine-interval",
            str(fine_interval_s),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if (
                    httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
                    and (home / "agent.sock").exists()
                ):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or up.poll() is not None:
                raise SystemExit("wattwatch up did not become ready")
            time.sleep(0.1)
        subprocess.run(
            [sys.executable, "-c", SERVER, str(seconds)],
            env={**env, "CUDA_VISIBLE_DEVICES": "0"},
            check=True,
            timeout=seconds + 60,
        )
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT t_start_s, t_end_s, energy_j FROM queries WHERE kind = 'query' ORDER BY t_start_s")
        ).all()
    engine.dispose()
    spans = [(float(a), float(b)) for a, b, _ in rows]
    measured = [e for _, _, e in rows]
    if not spans or any(e is None for e in measured):
        raise SystemExit(f"{sum(e is None for e in measured)} of {len(rows)} queries have no energy yet")
    fleet = SimulatedFleet.replay(home / "simulated-gpus.jsonl", 1)
    t0_s, t1_s = min(a for a, _ in spans), max(b for _, b in spans)
    exact, _waiting_j = exact_request_energy(partial(fleet.exact_energy_j, 0), spans, t0_s, t1_s)
    errors = [abs(m - x) / x for m, x in zip(measured, exact, strict=True) if x > 0]
    return {
        "queries": len(spans),
        "p50": quantile(measured, 0.5),
        "p50_exact": quantile(exact, 0.5),
        "p95": quantile(measured, 0.95),
        "p95_exact": quantile(exact, 0.95),
        "median_err": statistics.median(errors),
        "p95_err": quantile(errors, 0.95),
        "sum": sum(measured),
        "sum_exact": sum(exact),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run with and without the fine tick and print the comparison."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="how long the server serves")
    ap.add_argument(
        "--fine-intervals", type=float, nargs="+", default=[0.1, 0.0], help="--fine-interval of each run (0: off)"
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs of each setting (a row each: the spread over runs)")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            (f, k, run_once(Path(tmp) / f"run{k}", args.seconds, f))
            for k in range(args.repeat)
            for f in args.fine_intervals
        ]
    rows = []
    for fine_s, k, r in results:
        label = f"fine tick {fine_s:g} s" if fine_s else "1 s tick only"
        rows.append(
            [
                label + (f", run {k + 1}" if args.repeat > 1 else ""),
                f"{int(r['queries'])}",
                f"{r['p50']:.1f} J ({percent(r['p50'] / r['p50_exact'] - 1)})",
                f"{r['p95']:.1f} J ({percent(r['p95'] / r['p95_exact'] - 1)})",
                percent(r["median_err"], sign=False),
                percent(r["p95_err"], sign=False),
                percent(r["sum"] / r["sum_exact"] - 1),
            ]
        )
    print(command("query_energy_live.py", argv))
    print(
        paragraph(
            f"**Energy per query through the real processes** (`wattwatch up --simulate 1`, a threaded SDK server,"
            f" {args.seconds:g} s of overlapping requests), against the exact split of the simulator's energy among"
            f" the requests in flight (computed without wattwatch); error in brackets:"
        )
    )
    header = (
        "intervals",
        "queries",
        "p50 J/query",
        "p95 J/query",
        "per-query error, median",
        "per-query error, p95",
        "sum",
    )
    print(table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
