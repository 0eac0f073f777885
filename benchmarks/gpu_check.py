"""Check wattwatch's NVML measurement on a real NVIDIA GPU: what the board offers, and how the methods compare.

Read-only: it never changes clocks, power limits, persistence or compute modes; its only action on
the GPU is a matrix-multiply load (torch if importable, else cupy, else no load). It reports:

1. driver, NVML version, model, UUID, power limit; whether the energy counter and POWER_INSTANT work;
2. how often the energy counter, POWER_INSTANT and nvmlDeviceGetPowerUsage change (polled every ~1 ms
   under load): the counter's update period, and whether instant power is live between counter
   updates or held (part-time sampling);
3. nvmlDeviceGetPowerUsage vs POWER_INSTANT through the step from idle to load;
4. a steady load (20 s) and a bursty one (10 s, 50 ms on / 50 ms off) each measured at once by
   wattwatch's NvmlSensor boundary reads, POWER_INSTANT at 10 Hz (trapezoid), POWER_INSTANT at
   ~100 Hz jittered (wattwatch's power-only path), and nvmlDeviceGetPowerUsage at 1 Hz x 1 s.

Everything also goes to ``$OUT/gpu_check.json`` when ``OUT`` is set. Needs only nvidia-ml-py (and
torch or cupy for the load) with ``PYTHONPATH=src``. ``--simulate`` runs the same code against a
simulated board on a fake clock (the load becomes simulated activity, and the exact energy is known).

    PYTHONPATH=src python benchmarks/gpu_check.py [--index 0] [--simulate [--generation h100]]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from wattwatch.sensors.nvml import POWER_SAMPLE_INTERVAL_S, NvmlSensor, jittered_interval_s
from wattwatch.sim.clock import FakeClock

Sample = tuple[float, float]  # (t_s, value)


class Scheduler:
    """Runs timed samplers while the caller (or wattwatch's sensor, through ``sleep``) waits, so every
    method samples the same stretch of time from one thread, on the real or the fake clock."""

    def __init__(self, clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
        self.clock, self._sleep = clock, sleep
        self._due: list[tuple[float, Callable[[float], None]]] = []

    def at(self, times_s: list[float], action: Callable[[float], None]) -> None:
        """Call ``action(now)`` at each of ``times_s`` (as soon as possible after it)."""
        self._due += [(t, action) for t in times_s]
        self._due.sort(key=lambda item: item[0])

    def sleep(self, dt_s: float) -> None:
        """Wait ``dt_s``, running whatever falls due meanwhile."""
        until_s = self.clock() + dt_s
        while True:
            now_s = self.clock()
            while self._due and self._due[0][0] <= now_s:
                _, action = self._due.pop(0)
                action(now_s)
            if now_s >= until_s:
                return
            next_s = min(until_s, self._due[0][0]) if self._due else until_s
            self._sleep(max(next_s - now_s, 1e-4))

    def wait_until(self, t_s: float) -> None:
        """Sleep (running samplers) until ``t_s``."""
        self.sleep(max(0.0, t_s - self.clock()))


# -- what the GPU offers ----------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # any NVML refusal is a finding to print, not a crash
        return f"error: {exc}"


def instant_w(nv: Any, handle: Any) -> float | None:
    """POWER_INSTANT in W, or None when the field is not supported."""
    value = nv.nvmlDeviceGetFieldValues(handle, [nv.NVML_FI_DEV_POWER_INSTANT])[0]
    return value.value.uiVal / 1000.0 if value.nvmlReturn == nv.NVML_SUCCESS else None


def probe(nv: Any, handle: Any) -> dict[str, Any]:
    """Driver, model and which readings work."""
    counter = _try(lambda: int(nv.nvmlDeviceGetTotalEnergyConsumption(handle)))
    instant = _try(lambda: instant_w(nv, handle))
    return {
        "driver": _try(lambda: _text(nv.nvmlSystemGetDriverVersion())),
        "nvml_version": _try(lambda: _text(nv.nvmlSystemGetNVMLVersion())),
        "model": _try(lambda: _text(nv.nvmlDeviceGetName(handle))),
        "uuid": _try(lambda: _text(nv.nvmlDeviceGetUUID(handle))),
        "power_limit_w": _try(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0),
        "energy_counter": isinstance(counter, int),
        "energy_counter_mj": counter,
        "power_instant": isinstance(instant, float),
        "power_instant_w": instant,
        "power_usage_w": _try(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0),
    }


def observe_updates(
    nv: Any, handle: Any, clock: Callable[[], float], sleep: Callable[[float], None], seconds: float
) -> dict[str, Any]:
    """Poll the counter, POWER_INSTANT and PowerUsage every ~1 ms; when does each change?"""
    readers: dict[str, Callable[[], Any]] = {
        "counter": lambda: nv.nvmlDeviceGetTotalEnergyConsumption(handle),
        "instant": lambda: instant_w(nv, handle),
        "power_usage": lambda: nv.nvmlDeviceGetPowerUsage(handle),
    }
    last: dict[str, Any] = {}
    changes: dict[str, list[float]] = {name: [] for name in readers}
    polls, end_s = 0, clock() + seconds
    while clock() < end_s:
        now_s = clock()
        for name, read in readers.items():
            try:
                value = read()
            except Exception:  # unsupported readings simply never change
                continue
            if name in last and value != last[name]:
                changes[name].append(now_s)
            last[name] = value
        polls += 1
        sleep(0.001)
    out: dict[str, Any] = {"seconds": seconds, "polls": polls, "poll_interval_s": seconds / max(polls, 1)}
    for name, times in changes.items():
        gaps = [b - a for a, b in pairwise(times)]
        out[name] = {
            "changes": len(times),
            "median_gap_s": statistics.median(gaps) if gaps else None,
            "min_gap_s": min(gaps) if gaps else None,
        }
    counter_changes = changes["counter"]
    if counter_changes and changes["instant"]:
        # Live instant power changes between counter updates; a held (part-time) one only at them.
        near = sum(any(abs(t - c) <= 0.003 for c in counter_changes) for t in changes["instant"])
        out["instant_changes_per_counter_update"] = len(changes["instant"]) / len(counter_changes)
        out["instant_changes_at_counter_updates"] = near / len(changes["instant"])
    return out


# -- loads ------------------------------------------------------------------------------------------


class Load:
    """A GPU load: ``start(burst_s)`` (None: steady; else on/off every ``burst_s``) and ``stop()``."""

    name = "none"

    def prepare(self) -> str:
        """Get ready (CUDA context, buffers); returns a line for the report."""
        return "no load available (neither torch nor cupy imports): the methods measure an idle GPU"

    def start(self, burst_s: float | None = None) -> None:
        """Begin loading the GPU."""

    def stop(self) -> None:
        """Stop loading the GPU."""


class MatmulLoad(Load):
    """Back-to-back fp16 matrix multiplies in a thread (torch or cupy)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step: Callable[[], None] | None = None

    def prepare(self) -> str:
        """Import torch (else cupy), create the context and two 8192 x 8192 fp16 matrices."""
        try:
            torch: Any = importlib.import_module("torch")
            device = torch.device("cuda", self.index)
            a = torch.randn(8192, 8192, device=device, dtype=torch.float16)

            def step() -> None:
                for _ in range(4):
                    a @ a  # the product itself is the load
                torch.cuda.synchronize(device)

            self.name = f"torch {torch.__version__}"
        except Exception as torch_exc:
            try:
                cupy: Any = importlib.import_module("cupy")
                cupy.cuda.Device(self.index).use()
                b = cupy.random.rand(8192, 8192, dtype=cupy.float32).astype(cupy.float16)

                def step() -> None:
                    for _ in range(4):
                        b @ b
                    cupy.cuda.Device(self.index).synchronize()

                self.name = f"cupy {cupy.__version__}"
            except Exception as cupy_exc:
                return f"no load: torch ({torch_exc}) and cupy ({cupy_exc}) unavailable"
        step()  # compile/warm up outside the measured windows
        self._step = step
        return f"load: 8192 x 8192 fp16 matmuls with {self.name}"

    def start(self, burst_s: float | None = None) -> None:
        """Run the matmul loop in a thread; with ``burst_s``, alternate bursts and idle of that length."""
        if self._step is None:
            return
        self._stop.clear()
        step = self._step

        def run() -> None:
            on = True
            switch_s = time.monotonic() + (burst_s or 0.0)
            while not self._stop.is_set():
                if burst_s is not None and time.monotonic() >= switch_s:
                    on, switch_s = not on, switch_s + burst_s
                if on:
                    step()
                else:
                    time.sleep(min(0.001, max(0.0, switch_s - time.monotonic())))

        self._thread = threading.Thread(target=run, name="gpu-check-load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and wait for the last matmuls."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


class SimulatedLoad(Load):
    """``--simulate``: training activity, or a square wave for bursts, on the simulated board."""

    name = "simulated"

    def __init__(self, fleet: Any, clock: Callable[[], float]) -> None:
        self.fleet, self.clock = fleet, clock

    def prepare(self) -> str:
        """Nothing to prepare."""
        return "load: simulated (training activity; square wave for bursts)"

    def start(self, burst_s: float | None = None) -> None:
        """Switch the simulated board to load now."""
        if burst_s is None:
            self.fleet.set_activity(0, "training", self.clock())
        else:
            self.fleet.set_square_wave(0, self.clock(), 2 * burst_s, 100.0, 650.0)

    def stop(self) -> None:
        """Back to idle now."""
        self.fleet.set_activity(0, "idle", self.clock())


# -- measurements under load -------------------------------------------------------------------------


def step_response(nv: Any, handle: Any, sched: Scheduler, load: Load, burst_s: float | None = None) -> dict[str, Any]:
    """PowerUsage and POWER_INSTANT every 10 ms from 0.5 s before the load starts to 2.5 s after."""
    series: dict[str, list[Sample]] = {"instant": [], "power_usage": []}

    def sample(now_s: float) -> None:
        value = instant_w(nv, handle)
        if value is not None:
            series["instant"].append((now_s, value))
        series["power_usage"].append((now_s, nv.nvmlDeviceGetPowerUsage(handle) / 1000.0))

    t0 = sched.clock()
    sched.at([t0 + 0.01 * k for k in range(300)], sample)
    sched.wait_until(t0 + 0.5)
    start_s = sched.clock()
    load.start(burst_s)
    sched.wait_until(t0 + 3.0)
    out: dict[str, Any] = {"load_started_s": start_s - t0}
    for name, samples in series.items():
        before = [v for t, v in samples if t < start_s]
        after = [v for t, v in samples if t >= start_s + 2.0]
        if not before or not after:
            continue
        low, high = statistics.mean(before), statistics.mean(after)
        reach = next((t - start_s for t, v in samples if t >= start_s and v >= low + 0.9 * (high - low)), None)
        out[name] = {"before_w": low, "after_w": high, "t90_s": reach, "samples": len(samples)}
    return out


def compare_methods(
    nv: Any, index: int, sched: Scheduler, seconds: float, truth: Callable[[float, float], float] | None = None
) -> dict[str, Any]:
    """Measure the next ``seconds`` by every method at once (the load is already running)."""
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    sensor = NvmlSensor(nv, visible=str(index), clock=sched.clock, sleep=sched.sleep, power_sample_interval_s=None)
    key = f"gpu{index}"
    t0 = sched.clock() + 0.05
    t1 = t0 + seconds
    instant_10hz: list[Sample] = []
    instant_fast: list[Sample] = []
    usage_1hz: list[Sample] = []

    def record(samples: list[Sample], read: Callable[[], float | None]) -> Callable[[float], None]:
        def action(now_s: float) -> None:
            value = read()
            if value is not None:
                samples.append((min(now_s, t1), value))

        return action

    def read_instant() -> float | None:
        return instant_w(nv, handle)

    rng = random.Random(1)
    fast_times, t_s = [t0], t0
    while (t_s := t_s + jittered_interval_s(POWER_SAMPLE_INTERVAL_S, rng)) < t1:
        fast_times.append(t_s)
    sched.at([t0 + 0.1 * k for k in range(round(seconds * 10) + 1)], record(instant_10hz, read_instant))
    sched.at([*fast_times, t1], record(instant_fast, read_instant))
    sched.at(
        [t0 + k for k in range(1, round(seconds) + 1)],
        record(usage_1hz, lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0),
    )
    sched.wait_until(t0)
    start = {r.device: r for r in sensor.read_at(t0)}[key]
    sched.wait_until(t1)
    end = {r.device: r for r in sensor.read_at(t1)}[key]
    sensor.close()

    def trapezoid(samples: list[Sample]) -> float | None:
        return sum((b - a) * (p + q) / 2 for (a, p), (b, q) in pairwise(samples)) if len(samples) > 1 else None

    results: dict[str, float | None] = {
        "wattwatch NvmlSensor (counter, boundary reads)": end.energy_j - start.energy_j,
        "POWER_INSTANT 10 Hz trapezoid": trapezoid(instant_10hz),
        "POWER_INSTANT ~100 Hz jittered (power-only path)": trapezoid(instant_fast),
        "PowerUsage 1 Hz x 1 s": sum(p * 1.0 for _, p in usage_1hz) if usage_1hz else None,
    }
    out: dict[str, Any] = {"seconds": seconds, "energy_j": results, "flags": sorted({*start.flags, *end.flags})}
    reference = results["wattwatch NvmlSensor (counter, boundary reads)"]
    if truth is not None:
        reference = out["exact_j"] = truth(t0, t1)
    if reference:
        out["vs_reference"] = {k: (v - reference) / reference for k, v in results.items() if v is not None}
        out["reference"] = "exact integral (simulated)" if truth is not None else "wattwatch NvmlSensor"
    return out


# -- the run ----------------------------------------------------------------------------------------


def run_check(
    nv: Any,
    index: int,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    load: Load,
    *,
    steady_s: float = 20.0,
    bursty_s: float = 10.0,
    truth: Callable[[float, float], float] | None = None,
) -> dict[str, Any]:
    """All the checks on GPU ``index``; returns the report (also what goes into the JSON)."""
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        report: dict[str, Any] = {"index": index, "device": probe(nv, handle), "load": load.prepare()}
        sched = Scheduler(clock, sleep)
        sched.sleep(2.0)  # let the board settle after the load's warm-up
        report["step_idle_to_load"] = step_response(nv, handle, sched, load)
        report["update_periods_under_load"] = observe_updates(nv, handle, clock, sleep, 3.0)
        if report["device"]["energy_counter"]:
            report["steady_load"] = compare_methods(nv, index, sched, steady_s, truth)
            load.stop()
            sched.sleep(2.0)
            load.start(0.05)
            report["bursty_load_50ms"] = compare_methods(nv, index, sched, bursty_s, truth)
        else:
            report["comparison"] = "skipped: no energy counter, so nothing to compare the integrals against"
        load.stop()
        return report
    finally:
        load.stop()
        nv.nvmlShutdown()


def summary(report: dict[str, Any]) -> str:
    """The report as readable lines."""
    dev = report["device"]
    lines = [
        f"GPU {report['index']}: {dev['model']}  {dev['uuid']}  driver {dev['driver']}  NVML {dev['nvml_version']}",
        f"  power limit {dev['power_limit_w']} W; energy counter: {'works' if dev['energy_counter'] else 'NO'} "
        f"({dev['energy_counter_mj']}); POWER_INSTANT: {'works' if dev['power_instant'] else 'NO'} "
        f"({dev['power_instant_w']})",
        f"  {report['load']}",
    ]
    upd = report["update_periods_under_load"]
    lines.append(f"  polled every {upd['poll_interval_s'] * 1e3:.2f} ms for {upd['seconds']:.0f} s under load:")
    for name in ("counter", "instant", "power_usage"):
        gap = upd[name]["median_gap_s"]
        lines.append(f"    {name:12s} changed {upd[name]['changes']:5d} times, median gap {_ms(gap)}")
    if "instant_changes_at_counter_updates" in upd:
        lines.append(
            f"    POWER_INSTANT changes {upd['instant_changes_per_counter_update']:.1f}x per counter update, "
            f"{upd['instant_changes_at_counter_updates']:.0%} of them within 3 ms of one "
            "(near 100 %: held between updates, i.e. part-time sampling)"
        )
    for name, step in report["step_idle_to_load"].items():
        if isinstance(step, dict):
            lines.append(
                f"  step idle->load, {name:11s}: {step['before_w']:.0f} W -> {step['after_w']:.0f} W, "
                f"90 % after {_ms(step['t90_s'])}"
            )
    for section in ("steady_load", "bursty_load_50ms"):
        if section not in report:
            continue
        res = report[section]
        ref = res.get("reference", "-")
        lines.append(f"  {section} ({res['seconds']:.0f} s; errors vs {ref}; flags {res['flags'] or 'none'}):")
        if "exact_j" in res:
            lines.append(f"    {'exact':52s} {res['exact_j']:10.1f} J")
        for name, energy_j in res["energy_j"].items():
            rel = res.get("vs_reference", {}).get(name)
            lines.append(f"    {name:52s} {_j(energy_j)}  {'' if rel is None else f'{rel:+.2%}'}")
    if "comparison" in report:
        lines.append(f"  {report['comparison']}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def _j(value: float | None) -> str:
    return f"{'-':>10s}  " if value is None else f"{value:10.1f} J"


def main(argv: list[str] | None = None) -> int:
    """Command line; prints the summary and writes ``$OUT/gpu_check.json`` when OUT is set.

    Exit 0 when the checks ran, 2 when there is no usable GPU (NVML cannot start or has no such index).
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=int, default=0, help="NVML index of the GPU to check")
    parser.add_argument("--simulate", action="store_true", help="a simulated board on a fake clock, no real GPU")
    parser.add_argument("--generation", default="h100", help="simulated board preset (with --simulate)")
    parser.add_argument("--steady-s", type=float, default=20.0, help="length of the steady-load window")
    parser.add_argument("--bursty-s", type=float, default=10.0, help="length of the bursty-load window")
    parser.add_argument("--json", type=Path, help="where to write the JSON (default: $OUT/gpu_check.json)")
    args = parser.parse_args(argv)
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    if args.simulate:
        from wattwatch.sim.fleet import SimulatedFleet

        fake = FakeClock(1_700_000_000.0)
        fleet = SimulatedFleet(1, clock=fake, generation=args.generation)
        nv: Any = fleet.module()
        clock, sleep, index = fake, fake.sleep, 0
        load: Load = SimulatedLoad(fleet, fake)

        def truth(a: float, b: float) -> float:
            return float(fleet.exact_energy_j(0, a, b))

        exact: Callable[[float, float], float] | None = truth
    else:
        import pynvml

        nv, clock, sleep, index, exact = pynvml, time.time, time.sleep, args.index, None
        load = MatmulLoad(args.index)
    try:
        nv.nvmlInit()
        nv.nvmlDeviceGetHandleByIndex(index)
        nv.nvmlShutdown()
    except nv.NVMLError as exc:
        print(f"gpu_check: no usable NVIDIA GPU {index} here (NVML: {exc}); try --simulate", file=sys.stderr)
        return 2
    began = time.perf_counter()
    report = run_check(nv, index, clock, sleep, load, steady_s=args.steady_s, bursty_s=args.bursty_s, truth=exact)
    report["simulated"] = args.simulate
    report["wall_s"] = time.perf_counter() - began
    print(summary(report))
    target = args.json or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None)
    if target is not None:
        target.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
