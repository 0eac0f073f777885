"""Check wattwatch's NVML measurement on a real NVIDIA GPU: what the board offers, and how the methods compare.

Read-only: it never changes clocks, power limits, persistence or compute modes; its only action on
the GPU is a matrix-multiply load (torch if importable, else cupy, else no load). It reports:

1. driver, NVML version, model, UUID, power limit; whether the energy counter and POWER_INSTANT work;
2. how often the energy counter, POWER_INSTANT and nvmlDeviceGetPowerUsage change (polled every ~1 ms
   under load): the counter's update period, and whether instant power is live between counter
   updates or held (part-time sampling);
3. nvmlDeviceGetPowerUsage vs POWER_INSTANT through the step from idle to load;
4. how long NVML calls take (counter, POWER_INSTANT, PowerUsage, process list; 200 of each);
5. what wattwatch's NvmlSensor learned about the same GPU in the same run (refresh period and phase,
   live or held instant power, per-process sample period, call latency; ``NvmlSensor.timing()``, as
   ``wattwatch doctor`` prints it), beside the raw figures of 2-4: a markdown table for docs/accuracy.md;
6. a steady load (20 s) and a bursty one (10 s, 50 ms on / 50 ms off) each measured at once by
   wattwatch's NvmlSensor boundary reads, POWER_INSTANT at 10 Hz (trapezoid), POWER_INSTANT at
   ~100 Hz jittered (wattwatch's power-only path), and nvmlDeviceGetPowerUsage at 1 Hz x 1 s.

The power averaging window of nvmlDeviceGetPowerUsage is fitted to its step response: the window W
whose mean power from the energy counter, read at the same instants, matches PowerUsage best.

Everything also goes to ``$OUT/gpu_check.json`` when ``OUT`` is set. Needs only nvidia-ml-py (and
torch or cupy for the load) with ``PYTHONPATH=src``. ``--simulate`` runs the same code against a
simulated board on a fake clock (the load becomes simulated activity, and the exact energy is known),
with the simulator's hardware flaws when ``--sim-flaws SPEC`` is given (``wattwatch.sim.flaws``).

    PYTHONPATH=src python benchmarks/gpu_check.py [--index 0] [--simulate [--generation h100] [--sim-flaws SPEC]]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mdtable import command, table

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
        self.pid = os.getpid()  # this process is the one on the GPU, as with a real load

    def prepare(self) -> str:
        """Nothing to prepare."""
        return "load: simulated (training activity; square wave for bursts)"

    def start(self, burst_s: float | None = None) -> None:
        """Switch the simulated board to load now, this process on it at 90 % SM utilisation."""
        now_s = self.clock()
        if burst_s is None:
            self.fleet.set_activity(0, "training", now_s, self.pid)
        else:
            self.fleet.set_square_wave(0, now_s, 2 * burst_s, 100.0, 650.0, self.pid)
        self.fleet.set_process_utilization(0, self.pid, 90.0, now_s)

    def stop(self) -> None:
        """Back to idle now."""
        now_s = self.clock()
        self.fleet.set_activity(0, "idle", now_s, self.pid)
        self.fleet.set_process_utilization(0, self.pid, 0.0, now_s)


# -- measurements under load -------------------------------------------------------------------------


def step_response(nv: Any, handle: Any, sched: Scheduler, load: Load, burst_s: float | None = None) -> dict[str, Any]:
    """PowerUsage and POWER_INSTANT (and the energy counter) every 10 ms from 0.5 s before the load starts
    to 2.5 s after: how fast each follows the step, and the PowerUsage averaging window that fits best."""
    series: dict[str, list[Sample]] = {"instant": [], "power_usage": []}
    counter: list[Sample] = []

    def sample(now_s: float) -> None:
        value = instant_w(nv, handle)
        if value is not None:
            series["instant"].append((now_s, value))
        series["power_usage"].append((now_s, nv.nvmlDeviceGetPowerUsage(handle) / 1000.0))
        with contextlib.suppress(Exception):  # no counter (pre-Volta): no window fit
            counter.append((now_s, nv.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0))

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

        def reach(
            fraction: float, samples: list[Sample] = samples, low: float = low, high: float = high
        ) -> float | None:
            level = low + fraction * (high - low)
            return next((t - start_s for t, v in samples if t >= start_s and v >= level), None)

        t10, t90 = reach(0.1), reach(0.9)
        out[name] = {"before_w": low, "after_w": high, "t10_s": t10, "t90_s": t90, "samples": len(samples)}
        if name == "power_usage" and high - low > 20.0 and len(counter) == len(samples):
            out[name]["window_s"] = fit_window(samples, counter, low)
    return out


def fit_window(usage: list[Sample], counter_j: list[Sample], before_w: float) -> float:
    """The averaging window W (10 ms to 2 s) for which the energy counter's mean power over the last W,
    read when PowerUsage was read, best matches PowerUsage (least squares); before the first reading the
    board drew ``before_w`` (it had settled)."""
    times = [t for t, _ in counter_j]
    first_s, first_j = counter_j[0]

    def energy_at(t_s: float) -> float:
        if t_s <= first_s:
            return first_j - before_w * (first_s - t_s)
        k = min(bisect.bisect_left(times, t_s), len(times) - 1)
        (ta, ea), (tb, eb) = counter_j[k - 1], counter_j[k]
        return ea + (eb - ea) * (t_s - ta) / (tb - ta) if tb > ta else eb

    def misfit(window_s: float) -> float:
        return sum((p - (energy_at(t) - energy_at(t - window_s)) / window_s) ** 2 for t, p in usage if t <= times[-1])

    return min((0.01 * k for k in range(1, 201)), key=misfit)


def call_latency(nv: Any, handle: Any, clock: Callable[[], float], calls: int = 200) -> dict[str, Any]:
    """How long each NVML read takes (``calls`` of each, back to back): median, p95, max in seconds."""
    readers: dict[str, Callable[[], Any]] = {
        "counter": lambda: nv.nvmlDeviceGetTotalEnergyConsumption(handle),
        "instant": lambda: instant_w(nv, handle),
        "power_usage": lambda: nv.nvmlDeviceGetPowerUsage(handle),
        "process_list": lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle),
    }
    out: dict[str, Any] = {}
    for name, read in readers.items():
        took: list[float] = []
        try:
            for _ in range(calls):
                began = clock()
                read()
                took.append(clock() - began)
        except Exception as exc:  # an unsupported call is a finding, not a crash
            out[name] = f"error: {exc}"
            continue
        took.sort()
        out[name] = {
            "median_s": statistics.median(took),
            "p95_s": took[min(len(took) - 1, int(0.95 * len(took)))],
            "max_s": took[-1],
            "calls": len(took),
        }
    return out


def process_sample_gaps(nv: Any, handle: Any, clock: Callable[[], float]) -> dict[str, Any]:
    """The timestamps NVML put on the last seconds of per-process utilisation samples: their gaps."""
    try:
        samples = nv.nvmlDeviceGetProcessUtilization(handle, int((clock() - 5.0) * 1e6))
    except Exception as exc:  # NotFound (no busy process), NotSupported (vGPU, MIG): a finding
        return {"error": str(exc)}
    stamps = sorted({int(s.timeStamp) for s in samples})
    gaps = [(b - a) / 1e6 for a, b in pairwise(stamps)]
    return {
        "samples": len(samples),
        "stamps": len(stamps),
        "min_gap_s": min(gaps) if gaps else None,
        "median_gap_s": statistics.median(gaps) if gaps else None,
    }


def learned_timing(nv: Any, index: int, sched: Scheduler, seconds: float = 3.0) -> dict[str, Any]:
    """What wattwatch's NvmlSensor learns about GPU ``index`` (the load running): its start-up
    calibration, then a boundary read and a tick read every 0.3 s and the process samples of the last
    ``seconds``, as the agent would do; ``NvmlSensor.timing()`` after that, with its figures in SI units."""
    sensor = NvmlSensor(nv, visible=str(index), clock=sched.clock, sleep=sched.sleep, power_sample_interval_s=None)
    key = f"gpu{index}"
    try:
        began_s = sched.clock()
        while sched.clock() < began_s + seconds:
            sensor.read_at(sched.clock())
            sched.sleep(0.15)
            sensor.read()
            sched.sleep(0.15)
        sensor.process_utilization(key, began_s, sched.clock() - 0.5)
        timing = sensor.timing()[key]
    finally:
        sensor.close()
    return dataclasses.asdict(timing)


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
        report["call_latency"] = call_latency(nv, handle, clock)
        report["process_samples"] = process_sample_gaps(nv, handle, clock)
        try:
            report["learned_timing"] = learned_timing(nv, index, sched)
        except Exception as exc:  # the sensor refusing this GPU is a finding to print
            report["learned_timing"] = f"error: {exc}"
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


def timing_rows(report: dict[str, Any]) -> list[list[str]]:
    """Each timing as gpu_check measured it raw, beside what wattwatch's NvmlSensor learned."""
    upd, step = report["update_periods_under_load"], report["step_idle_to_load"]
    learned = report.get("learned_timing")
    sensor: dict[str, Any] = learned if isinstance(learned, dict) else {}
    why = learned if isinstance(learned, str) else ""

    def sensor_cell(text: str) -> str:
        return text if sensor else why or "-"

    counter = upd["counter"]
    raw_period = (
        f"{_ms3(counter['median_gap_s'])} (median gap of {counter['changes']} changes, polled every "
        f"{upd['poll_interval_s'] * 1e3:.2f} ms)"
        if counter["median_gap_s"] is not None
        else f"no change seen in {upd['seconds']:.0f} s"
    )
    if sensor.get("refresh_period_s") is not None:
        err = sensor["refresh_period_err_s"]
        learned_period = f"{_ms3(sensor['refresh_period_s'])}" + (f" ± {_ms3(err)}" if err is not None else "")
        learned_period += f" (from {sensor['refreshes_seen']} refreshes)"
    else:
        learned_period = f"not learned: {sensor.get('refresh_why_not') or '-'}"
    if "instant_changes_at_counter_updates" in upd:
        near = upd["instant_changes_at_counter_updates"]
        raw_instant = (
            f"{'held' if near > 0.9 else 'live'}: {upd['instant_changes_per_counter_update']:.1f} changes per "
            f"counter refresh, {near:.0%} of them within 3 ms of one"
        )
    else:
        raw_instant = "not supported" if not report["device"]["power_instant"] else "no change seen"
    usage = step.get("power_usage", {})
    rise = (
        f"10-90 % rise {usage['t90_s'] - usage['t10_s']:.2f} s"
        if usage.get("t10_s") is not None and usage.get("t90_s") is not None
        else "no step seen"
    )
    raw_window = (
        f"{usage['window_s']:.2f} s (best fit to the counter's mean power; {rise})"
        if "window_s" in usage
        else f"not fitted ({rise}; a fit needs the energy counter)"
    )
    procs = report["process_samples"]
    raw_procs = (
        f"{_ms3(procs['min_gap_s'])} (smallest gap of {procs['stamps']} sample stamps)"
        if procs.get("min_gap_s") is not None
        else f"no samples ({procs.get('error', 'no busy process')})"
    )
    if sensor.get("process_sample_period_s") is not None:
        learned_procs = f"{_ms3(sensor['process_sample_period_s'])} (from {sensor['process_stamps_seen']} stamps)"
    else:
        learned_procs = "not learned"
    lat = report["call_latency"]
    raw_latency = "; ".join(
        f"{name} {_ms3(v['median_s'])} (p95 {_ms3(v['p95_s'])})" if isinstance(v, dict) else f"{name}: {v}"
        for name, v in lat.items()
    )
    if sensor.get("call_latency_s"):
        median_s, p95_s, calls = sensor["call_latency_s"]
        learned_latency = f"{_ms3(median_s)} (p95 {_ms3(p95_s)}, {calls} counter and power reads)"
    else:
        learned_latency = "not measured"
    return [
        ["counter refresh period", raw_period, sensor_cell(learned_period)],
        ["POWER_INSTANT", raw_instant, sensor_cell(str(sensor.get("instant_power")))],
        [
            "PowerUsage averaging window",
            raw_window,
            "not used (energy comes from the counter)" if sensor.get("energy_counter") else "-",
        ],
        ["per-process sample period", raw_procs, sensor_cell(learned_procs)],
        ["NVML call latency: median (p95)", raw_latency, sensor_cell(learned_latency)],
    ]


def timing_table(report: dict[str, Any], argv: list[str]) -> str:
    """The command, a caption and the raw-vs-learned timings as markdown (for docs/accuracy.md)."""
    dev = report["device"]
    where = "a simulated board" if report.get("simulated") else "a real GPU"
    lines = [
        command("gpu_check.py", argv),
        "",
        f"**NVML timings of {dev['model']}** (driver {dev['driver']}; {where}), as gpu_check measures them raw "
        "and as wattwatch's NvmlSensor learned them in the same run:",
        "",
        table(["timing", "raw (gpu_check)", "learned by NvmlSensor"], timing_rows(report), right=[False] * 3),
    ]
    return "\n".join(lines)


def _ms3(value: float) -> str:
    return f"{value * 1e3:.3f} ms"


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
    parser.add_argument(
        "--sim-flaws", default="", help="the simulator's hardware flaws (with --simulate), e.g. realistic,refresh_ms=20"
    )
    parser.add_argument("--steady-s", type=float, default=20.0, help="length of the steady-load window")
    parser.add_argument("--bursty-s", type=float, default=10.0, help="length of the bursty-load window")
    parser.add_argument("--json", type=Path, help="where to write the JSON (default: $OUT/gpu_check.json)")
    args = parser.parse_args(argv)
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    if args.simulate:
        from wattwatch.sim.fleet import SimulatedFleet

        fake = FakeClock(1_700_000_000.0)
        from wattwatch.sim.flaws import parse_flaws

        try:
            flaws = parse_flaws(args.sim_flaws)
        except ValueError as exc:
            parser.error(f"--sim-flaws: {exc}")
        fleet = SimulatedFleet(1, clock=fake, generation=args.generation, flaws=flaws)
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
    report["sim_flaws"] = args.sim_flaws if args.simulate else None
    report["wall_s"] = time.perf_counter() - began
    print(summary(report))
    print()
    print(timing_table(report, sys.argv[1:] if argv is None else list(argv)))
    target = args.json or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None)
    if target is not None:
        target.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
