"""How close does each way of measuring a GPU job come to the exact energy? Ground truth on simulated GPUs.

Every trace (``accuracy_traces``) runs on a simulated board with a fake clock, so the exact integral
of its power is known and the benchmark takes seconds, not the traces' minutes. For each trace the
table gives each method's error against that integral (for traces of several jobs, the job with the
largest error): wattwatch's real NVML sensor, the two naive loops, and CodeCarbon's GPU code reading
the same simulated board through the same fake ``pynvml``. Then the same traces on the same board with
its energy counter hidden (the power-only path), and a RAPL trace whose counter wraps twice between
slow reads. Acceptance is checked and printed at the end; the exit code is 1 if it fails.

    PYTHONPATH=src python benchmarks/accuracy.py [--quick] [--generation h100] [--no-codecarbon] [--no-realtime]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy_methods import (
    CodeCarbonShim,
    Method,
    Unavailable,
    codecarbon_method,
    codecarbon_tracker_realtime,
    naive_1hz,
    naive_10hz,
    wattwatch,
)
from accuracy_rapl import JOB_S, MAX_POWER_W, RANGE_UJ, derived_poll_interval_s, run_rapl
from accuracy_traces import T_START, Trace, gpu_traces, play, quick_traces
from mdtable import caption, command, table

from wattwatch.sim.clock import FakeClock
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.sim.generations import generation as resolve_generation

COUNTER_BOUND = 0.005  # counter path: <= 0.5 % on every job >= 1 s
RESET_BOUND = 0.02  # a counter reset mid-job: within 2 %
DRIVER_LOADED_BEFORE_S = 600.0
METHODS = ("wattwatch", "naive 1 Hz", "naive 10 Hz", "CodeCarbon")


@dataclass
class Row:
    """One trace measured by every method: the worst job's signed relative error, or why there is none."""

    trace: str
    path: str  # counter | power
    jobs: int
    exact_j: float  # all jobs together
    errors: dict[str, float | str] = field(default_factory=dict)
    has_reset: bool = False


def measure_trace(trace: Trace, gen: str, *, power_only: bool, methods: dict[str, Method]) -> Row:
    """Schedule ``trace`` on a fresh simulated board and let every method measure it."""
    # The driver was loaded well before the trace (the counter is large, as on any running host).
    clock = FakeClock(T_START - DRIVER_LOADED_BEFORE_S)
    fleet = SimulatedFleet(1, seed=11, clock=clock, generation=gen)
    clock.t_s = T_START
    if power_only:
        fleet.set_energy_counter_supported(0, False)
    windows = play(fleet, 0, trace)
    exact = [fleet.exact_energy_j(0, a, b) for a, b in windows]
    row = Row(trace.name, "power" if power_only else "counter", len(windows), sum(exact), has_reset=trace.has_reset)
    for name, method in methods.items():
        try:
            measured = method(fleet, windows, clock)
        except Unavailable as exc:
            row.errors[name] = str(exc)
            continue
        errors = [(m - e) / e for m, e in zip(measured, exact, strict=True)]
        row.errors[name] = max(errors, key=abs)
    return row


@dataclass
class Report:
    """Everything the benchmark measured, and the acceptance verdicts."""

    generation: str
    rows: list[Row]
    rapl_exact_j: float = 0.0
    rapl_rows: list[tuple[str, float | str, bool]] = field(default_factory=list)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    realtime: dict[str, float | str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """Whether every acceptance check passed."""
        return all(ok for _, ok, _ in self.checks)


def run(
    *, quick: bool = False, gen: str = "h100", codecarbon: bool = True, rapl: bool = True, realtime: bool = False
) -> Report:
    """Run the benchmark (``quick``: the reduced trace set of the smoke test) and check acceptance.

    ``realtime`` adds CodeCarbon's whole tracker beside wattwatch over 10 s of real time.
    """
    began = time.perf_counter()
    traces = quick_traces() if quick else gpu_traces()
    shim = CodeCarbonShim() if codecarbon else None
    methods: dict[str, Method] = {"wattwatch": wattwatch, "naive 1 Hz": naive_1hz, "naive 10 Hz": naive_10hz}
    if shim is not None:
        methods["CodeCarbon"] = codecarbon_method(shim)
    try:
        rows = []
        if resolve_generation(gen).energy_counter:
            rows += [measure_trace(t, gen, power_only=False, methods=methods) for t in traces]
        rows += [measure_trace(t, gen, power_only=True, methods=methods) for t in traces if not t.has_reset]
        realtime_figures = codecarbon_tracker_realtime(shim) if shim is not None and realtime else {}
    finally:
        if shim is not None:
            shim.close()
    report = Report(gen, rows, realtime=realtime_figures)
    if rapl:
        report.rapl_exact_j, report.rapl_rows = run_rapl()
    report.checks = acceptance(report)
    report.seconds = time.perf_counter() - began
    return report


def acceptance(report: Report) -> list[tuple[str, bool, str]]:
    """The accuracy targets, each with a verdict and the figure behind it."""
    checks = []
    for row in report.rows:
        err = row.errors.get("wattwatch")
        if not isinstance(err, float):
            checks.append((f"{row.path} path measures {row.trace}", False, str(err)))
            continue
        if row.path == "counter":
            bound = RESET_BOUND if row.has_reset else COUNTER_BOUND
            checks.append((f"counter path, {row.trace}: |error| <= {bound:.1%}", abs(err) <= bound, f"{err:+.3%}"))
        else:
            naive = row.errors.get("naive 10 Hz")
            if isinstance(naive, float):
                ok = abs(err) <= abs(naive)
                checks.append(
                    (f"power path, {row.trace}: no worse than naive 10 Hz", ok, f"{err:+.3%} vs {naive:+.3%}")
                )
    for name, measured, flagged in report.rapl_rows:
        if name.startswith("wattwatch") and "too slow" not in name and isinstance(measured, float):
            err = (measured - report.rapl_exact_j) / report.rapl_exact_j
            checks.append(
                (f"RAPL double wrap, {name}: |error| <= 0.1%", abs(err) <= 0.001 and not flagged, f"{err:+.4%}")
            )
        if "too slow" in name:
            checks.append((f"RAPL, {name}: flagged wrap_ambiguous", flagged, "flagged" if flagged else "not flagged"))
    return checks


def _cell(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:+.2%}"


def _codecarbon_version() -> str:
    try:
        return "CodeCarbon " + importlib.metadata.version("codecarbon")
    except importlib.metadata.PackageNotFoundError:
        return "CodeCarbon (not installed)"


def format_report(report: Report, argv: Sequence[str] = ()) -> str:
    """The command, the tables (markdown, as docs/accuracy.md shows them) and the acceptance verdicts, as printed."""
    lines = [command("accuracy.py", argv), ""]
    with_cc = any(isinstance(r.errors.get("CodeCarbon"), float) for r in report.rows)
    cc = f"; {_codecarbon_version()} reads the same fake board through its own pynvml code" if with_cc else ""
    captions = {
        "counter": (
            f"**Sensors against naive methods and CodeCarbon**: simulated {report.generation}, error of the worst "
            "job of each trace against the exact integral of the simulator's power; the naive loops read "
            f"nvmlDeviceGetPowerUsage once a second (x 1 s) and POWER_INSTANT at 10 Hz (trapezoid){cc}:"
        ),
        "power": (
            "**Without an energy counter** (the same traces, the board's counter hidden: wattwatch integrates "
            "POWER_INSTANT at ~100 Hz with jitter):"
        ),
    }
    for path in ("counter", "power"):
        rows = [r for r in report.rows if r.path == path]
        if not rows:
            continue
        lines += [caption(captions[path]), ""]
        body = [[r.trace, str(r.jobs), f"{r.exact_j:.1f}", *(_cell(r.errors.get(m)) for m in METHODS)] for r in rows]
        lines += [table(["trace", "jobs", "exact J", *METHODS], body), ""]
    if report.rapl_rows:
        lines.append(
            caption(
                f"**RAPL with a double wrap**: {JOB_S:.0f} s at 250-380 W, counter range {RANGE_UJ / 1e6:.0f} J "
                f"(wraps every {RANGE_UJ / 1e6 / MAX_POWER_W:.1f} s at {MAX_POWER_W:.0f} W); derived "
                f"max_poll_interval_s = {derived_poll_interval_s():.2f} s; exact {report.rapl_exact_j:.1f} J:"
            )
        )
        body = []
        for name, measured, flagged in report.rapl_rows:
            if isinstance(measured, float):
                err = (measured - report.rapl_exact_j) / report.rapl_exact_j
                body.append([name, f"{measured:.1f} J", f"{err:+.2%}", "wrap_ambiguous" if flagged else ""])
            else:
                body.append([name, measured, "-", ""])
        lines += ["", table(["reader", "measured", "error", "flagged"], body), ""]
    rt = report.realtime
    if rt:
        lines.append("**CodeCarbon's whole EmissionsTracker beside wattwatch**, same simulated board, real time:")
        lines.append("")
        if "error" in rt:
            lines.append(f"unavailable: {rt['error']}")
        else:
            exact = float(rt["exact_j"])
            body = [
                [name, f"{float(rt[key]):.1f} J", f"{(float(rt[key]) - exact) / exact:+.2%}"]
                for key, name in (("wattwatch_j", "wattwatch NvmlSensor"), ("codecarbon_j", "CodeCarbon tracker"))
            ]
            lines += [
                table(["measured by", "energy", "error"], body),
                "",
                f"({float(rt['seconds']):.0f} s of training, exact {exact:.1f} J; the tracker's start took "
                f"{float(rt['tracker_start_s']) * 1e3:.0f} ms, its stop {float(rt['tracker_stop_s']) * 1e3:.0f} ms)",
            ]
        lines.append("")
    lines.append("Acceptance:")
    lines.append("")
    for check, ok, detail in report.checks:
        lines.append(f"- {'PASS' if ok else 'FAIL'}  {check}  ({detail})")
    lines.append(f"\n{'all passed' if report.passed else 'FAILED'} in {report.seconds:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: prints the tables; exit 1 when an acceptance check fails."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the reduced trace set of the smoke test")
    parser.add_argument("--generation", default="h100", help="simulated board preset (h100, a100, ...)")
    parser.add_argument("--no-codecarbon", action="store_true", help="leave CodeCarbon out")
    parser.add_argument("--no-realtime", action="store_true", help="skip the 10 s real-time CodeCarbon tracker run")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    report = run(
        quick=args.quick,
        gen=args.generation,
        codecarbon=not args.no_codecarbon,
        realtime=not (args.no_realtime or args.quick),
    )
    print(format_report(report, sys.argv[1:] if argv is None else argv))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
