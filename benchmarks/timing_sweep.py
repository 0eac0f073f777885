"""Boundary-read accuracy over counter refresh periods the sensor is never told: 10 to 200 ms.

Each row is a simulated board (``wattwatch.sim``) whose energy counter and power readings refresh every
``period``; live boards report the power of the moment, part-time ones the mean of the last quarter of
each period, held until the next refresh. Flaws (the simulator's, ``wattwatch.sim.flaws``): none, or
"slow+noisy": NVML calls of 0.5 ms plus an exponential tail of 0.5 ms mean (the value read at a random
point inside the call) and 5 W of noise on instant power readings. Jobs start and stop a training
load exactly at their boundaries; the agent gets to each boundary 0-20 ms late. The truth is the
simulator's exact integral of its board power over each job (``SimulatedFleet.exact_energy_j``),
which no wattwatch code computes.

Prints the command, then a markdown table: the period the sensor learned (where it learns one), and
the relative error of 1 s jobs (mean of its absolute value, worst) and 10 s jobs (worst).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from collections.abc import Sequence

import mdtable

from wattwatch.sensors.nvml import NvmlSensor
from wattwatch.sim.clock import FakeClock
from wattwatch.sim.flaws import Flaws
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.sim.generations import GENERATIONS

T0 = 1_700_000_000.0
PERIODS_S = (0.01, 0.02, 0.05, 0.1, 0.2)
# The simulator's flaws (``wattwatch.sim.flaws``): NVML calls of 0.5 ms plus an exponential tail of 0.5 ms
# mean, the value read at a random point inside the call, and 5 W of noise on instant power readings.
FLAWS = {"none": Flaws(), "slow+noisy": Flaws(power_noise_w=5.0, call_latency_s=0.0005, call_jitter_s=0.0005)}


def job_errors(fleet: SimulatedFleet, clock: FakeClock, sensor: NvmlSensor, window_s: float, jobs: int) -> list[float]:
    """Relative errors of ``jobs`` jobs of ``window_s`` measured by two boundary reads, per board."""
    rng = random.Random(3)
    errors: list[float] = []
    clock.t_s = max(clock.t_s, T0 + 2.0)
    for _ in range(jobs):
        start_s = clock.t_s + rng.uniform(0.3, 0.9)
        end_s = start_s + window_s
        for index in range(fleet.n_gpus):
            fleet.set_activity(index, "training", start_s)
            fleet.set_activity(index, "idle", end_s)
        clock.t_s = start_s + rng.uniform(0.0, 0.02)
        first = {r.device: r.energy_j for r in sensor.read_at(start_s)}
        clock.t_s = max(clock.t_s, end_s + rng.uniform(0.0, 0.02))
        last = {r.device: r.energy_j for r in sensor.read_at(end_s)}
        for index in range(fleet.n_gpus):
            exact_j = fleet.exact_energy_j(index, start_s, end_s)
            errors.append((last[f"gpu{index}"] - first[f"gpu{index}"] - exact_j) / exact_j)
    return errors


def row(generation: str, period_s: float, flaws: str, jobs: int) -> list[str]:
    """One board configuration's figures, as table cells."""
    clock = FakeClock(T0)
    board = dataclasses.replace(GENERATIONS[generation], update_period_s=period_s)
    fleet = SimulatedFleet(2, seed=7, clock=clock, generation=board, flaws=FLAWS[flaws])
    sensor = NvmlSensor(fleet.module(), clock=clock, sleep=clock.sleep, power_sample_interval_s=None)
    short = job_errors(fleet, clock, sensor, 1.0, jobs)
    long = job_errors(fleet, clock, sensor, 10.0, max(2, jobs // 4))
    timing = getattr(sensor, "timing", None)  # absent before the sensor learned its timings
    learned = "-"
    if timing is not None:
        period = timing()["gpu0"].refresh_period_s
        learned = "not learned" if period is None else f"{period * 1000:.3f} ms"
    sensor.close()
    return [
        generation,
        f"{period_s * 1000:g} ms",
        flaws,
        learned,
        f"{statistics.mean(abs(e) for e in short) * 100:.3f} %",
        f"{max(short, key=abs) * 100:+.3f} %",
        f"{max(long, key=abs) * 100:+.3f} %",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and print the command and the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20, help="1 s jobs per board (default 20; 10 s jobs: a quarter)")
    parser.add_argument("--periods-ms", default=",".join(f"{p * 1000:g}" for p in PERIODS_S))
    args = parser.parse_args(argv)
    try:
        periods = [float(p) / 1000 for p in args.periods_ms.split(",")]
    except ValueError:
        parser.error(f"--periods-ms: a comma-separated list of milliseconds, got {args.periods_ms!r}")
    if args.jobs < 1 or not periods or min(periods) <= 0:
        parser.error("--jobs must be >= 1 and every period > 0")
    rows = [
        row(generation, period_s, flaws, args.jobs)
        for generation in ("h100", "h100-parttime")
        for period_s in periods
        for flaws in FLAWS
    ]
    print(mdtable.command("timing_sweep.py", sys.argv[1:] if argv is None else list(argv)))
    print()
    header = ["board", "refresh", "flaws", "learned period"]
    header += ["1 s jobs: mean abs. error", "worst", "10 s jobs: worst"]
    print(mdtable.table(header, rows, right=[False, True, False, True, True, True, True]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
