"""Energy per query through the real processes, against the simulator's exact split.

Starts ``wattwatch up --simulate 1`` (once with the fine tick while requests flow, once without),
runs an SDK inference server on the simulated GPU that serves overlapping requests (Poisson arrivals,
~4/s, 0.2-1.5 s each) for ``--seconds``, stops everything, then compares the per-query energies the
collector stored with the exact split: the board's true power, integrated on 1 ms steps, each step
shared by the requests in flight. Prints p50/p95 J/query and the median per-query error.
Run: ``python benchmarks/query_energy_live.py [--seconds 40]`` (about 2 x (seconds + 15) s).
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
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from wattwatch.sensors.simulated import SimulatedFleet

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
    home = tmp / f"home-{fine_interval_s}"
    db = tmp / f"live-{fine_interval_s}.db"
    port = free_port()
    env = {**os.environ, "WATTWATCH_HOME": str(home)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wattwatch.cli",
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
    exact = exact_split(SimulatedFleet.replay(home / "simulated-gpus.jsonl", 1), spans)
    errors = [abs(m - x) / x for m, x in zip(measured, exact, strict=True) if x > 0]
    return {
        "queries": len(spans),
        "p50": statistics.median(measured),
        "p50_exact": statistics.median(exact),
        "p95": quantile(measured, 0.95),
        "p95_exact": quantile(exact, 0.95),
        "median_err": statistics.median(errors),
        "p95_err": quantile(errors, 0.95),
        "sum": sum(measured),
        "sum_exact": sum(exact),
    }


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def exact_split(fleet: SimulatedFleet, spans: list[tuple[float, float]]) -> list[float]:
    """Each 1 ms step of the board's true power shared equally by the requests in flight at its midpoint."""
    t0_s, t1_s = min(a for a, _ in spans), max(b for _, b in spans)
    dt_s = 0.001
    out = [0.0] * len(spans)
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    active: list[int] = []
    nxt = 0
    for k in range(int((t1_s - t0_s) / dt_s) + 1):
        mid_s = t0_s + (k + 0.5) * dt_s
        while nxt < len(order) and spans[order[nxt]][0] <= mid_s:
            active.append(order[nxt])
            nxt += 1
        active = [i for i in active if spans[i][1] > mid_s]
        if active:
            share_j = fleet.power_w(0, mid_s) * dt_s / len(active)
            for i in active:
                out[i] += share_j
    return out


def main() -> None:
    """Run with and without the fine tick and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="how long the server serves")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [(f, run_once(Path(tmp), args.seconds, f)) for f in (0.1, 0.0)]
    print(
        f"{'intervals':<16} {'queries':>7} {'p50 J':>7} {'exact':>7} {'err':>7} {'p95 J':>7} {'exact':>7} "
        f"{'err':>7} {'|err| p50':>9} {'|err| p95':>9} {'sum err':>8}"
    )
    for fine_s, r in results:
        label = f"fine tick {fine_s:g} s" if fine_s else "1 s tick only"
        print(
            f"{label:<16} {int(r['queries']):>7} {r['p50']:>7.1f} {r['p50_exact']:>7.1f} "
            f"{(r['p50'] - r['p50_exact']) / r['p50_exact']:>+7.2%} {r['p95']:>7.1f} {r['p95_exact']:>7.1f} "
            f"{(r['p95'] - r['p95_exact']) / r['p95_exact']:>+7.2%} {r['median_err']:>9.2%} {r['p95_err']:>9.2%} "
            f"{(r['sum'] - r['sum_exact']) / r['sum_exact']:>+8.2%}"
        )
    print("\n|err|: per-query error against the exact split (median and 95th percentile over queries)")


if __name__ == "__main__":
    main()
