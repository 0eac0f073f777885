"""The ways of measuring a GPU job that the accuracy benchmark compares, each on the fake clock.

Each method gets the fleet (with the trace already scheduled), the job windows and the clock, rewinds
the clock to ``T_START`` and walks it forward, reading the simulated board only through a fake
``pynvml`` module, exactly as it would read a real one:

- ``wattwatch``: the real ``NvmlSensor``: ticks every second, boundary reads (``read_at``) a few ms
  after each job start and end, as the agent's worker gets to them; on a board without an energy
  counter, also the integrator's power samples (10 ms apart on average, jittered as its thread does);
- ``naive_1hz``: ``nvmlDeviceGetPowerUsage`` read every second x the interval;
- ``naive_10hz``: ``NVML_FI_DEV_POWER_INSTANT`` sampled at 10 Hz, trapezoid-integrated;
- ``codecarbon``: CodeCarbon's own GPU code (``codecarbon.external.hardware.GPU``, what its
  EmissionsTracker drives): ``start()`` at the job start, ``monitor_power()`` every second and
  ``measure_power_and_energy()`` every 15 s (its default ``measure_power_secs``) and at the end.
"""

from __future__ import annotations

import heapq
import logging
import os
import random
import stat
import sys
import tempfile
import types
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from accuracy_traces import T_START

from wattwatch.sensors.nvml import POWER_SAMPLE_INTERVAL_S, NvmlSensor, jittered_interval_s
from wattwatch.sim.clock import FakeClock
from wattwatch.sim.fleet import SimulatedFleet

TICK_S = 1.0  # the agent's default interval
MAX_LATENCY_S = 0.005  # the agent's worker reaches a boundary within a few ms of it
CODECARBON_MEASURE_S = 15.0  # CodeCarbon's default measure_power_secs
CODECARBON_MONITOR_S = 1.0  # CodeCarbon samples power every second (for boards without a counter)
J_PER_KWH = 3.6e6


class Unavailable(Exception):
    """The method cannot measure this board; ``str()`` says why (printed in the table)."""


Method = Callable[[SimulatedFleet, list[tuple[float, float]], FakeClock], list[float]]


# -- wattwatch --------------------------------------------------------------------------------------


def wattwatch(fleet: SimulatedFleet, windows: list[tuple[float, float]], clock: FakeClock) -> list[float]:
    """Job energies (J) as wattwatch's NVML sensor measures them on board 0."""
    clock.t_s = T_START
    sensor = NvmlSensor(fleet.module(), clock=clock, sleep=clock.sleep, power_sample_interval_s=None)
    rng = random.Random(7)
    power_only = not sensor.capabilities()[0].energy_counter
    end_s = windows[-1][1] + 2 * TICK_S
    # (time, sequence, action, boundary): ticks, integrator samples and boundary reads, in time order.
    events: list[tuple[float, int, str, float]] = []
    n = 0
    t_s = T_START
    while t_s < end_s:
        events.append((t_s, n, "tick", 0.0))
        n += 1
        t_s += TICK_S
    if power_only:
        jitter = random.Random(3)
        t_s = T_START + POWER_SAMPLE_INTERVAL_S
        while t_s < end_s:
            events.append((t_s, n, "sample", 0.0))
            n += 1
            t_s += jittered_interval_s(POWER_SAMPLE_INTERVAL_S, jitter)
    for start_s, stop_s in windows:
        for boundary_s in (start_s, stop_s):
            events.append((boundary_s + rng.uniform(0.0, MAX_LATENCY_S), n, "boundary", boundary_s))
            n += 1
    heapq.heapify(events)
    at: dict[float, float] = {}
    while events:
        t_s, _, action, boundary_s = heapq.heappop(events)
        # One worker: what falls due while a boundary read polls runs right after it, as in the agent.
        clock.t_s = max(clock.t_s, t_s)
        if action == "boundary":
            (reading,) = [r for r in sensor.read_at(boundary_s) if r.device == "gpu0"]
            at[boundary_s] = reading.energy_j
        else:
            sensor.read()
    sensor.close()
    return [at[b] - at[a] for a, b in windows]


# -- naive methods ----------------------------------------------------------------------------------


def _open(fleet: SimulatedFleet) -> tuple[Any, Any]:
    nv = fleet.module()
    nv.nvmlInit()
    return nv, nv.nvmlDeviceGetHandleByIndex(0)


def naive_1hz(fleet: SimulatedFleet, windows: list[tuple[float, float]], clock: FakeClock) -> list[float]:
    """``nvmlDeviceGetPowerUsage`` every second x the interval (the usual loop around NVML)."""
    nv, handle = _open(fleet)
    out = []
    for start_s, stop_s in windows:
        energy_j, t_s = 0.0, start_s
        while t_s < stop_s:
            nxt = min(stop_s, t_s + 1.0)
            clock.t_s = nxt
            energy_j += nv.nvmlDeviceGetPowerUsage(handle) / 1000.0 * (nxt - t_s)
            t_s = nxt
        out.append(energy_j)
    return out


def naive_10hz(fleet: SimulatedFleet, windows: list[tuple[float, float]], clock: FakeClock) -> list[float]:
    """``NVML_FI_DEV_POWER_INSTANT`` at 10 Hz, trapezoid-integrated."""
    nv, handle = _open(fleet)
    field = nv.NVML_FI_DEV_POWER_INSTANT
    clock.t_s = windows[0][0]
    if nv.nvmlDeviceGetFieldValues(handle, [field])[0].nvmlReturn != nv.NVML_SUCCESS:
        raise Unavailable("no POWER_INSTANT")
    out = []
    for start_s, stop_s in windows:
        samples = []
        k = 0
        while (t_s := min(stop_s, start_s + 0.1 * k)) <= stop_s:
            clock.t_s = t_s
            samples.append((t_s, nv.nvmlDeviceGetFieldValues(handle, [field])[0].value.uiVal / 1000.0))
            if t_s == stop_s:
                break
            k += 1
        out.append(sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in pairwise(samples)))
    return out


# -- CodeCarbon -------------------------------------------------------------------------------------


class _PynvmlStandIn(types.ModuleType):
    """What ``import pynvml`` returns while CodeCarbon is measured: forwards to the current fake module."""

    target: Any = None

    def __getattr__(self, name: str) -> Any:
        if self.target is None:
            raise AttributeError(name)
        return getattr(self.target, name)


class CodeCarbonShim:
    """Makes CodeCarbon see the simulated fleet: ``import pynvml`` resolves to the fake module (through
    a stand-in that can be pointed at each trace's fleet), and ``nvidia-smi`` resolves to a stub
    script first on PATH, so CodeCarbon never finds a real one. Import CodeCarbon only after this."""

    def __init__(self) -> None:
        import pynvml

        self.real = getattr(pynvml, "_real", pynvml)
        self.stand_in = _PynvmlStandIn("pynvml")
        self.stand_in.target = SimulatedFleet(1).module()  # CodeCarbon calls nvmlInit when imported
        sys.modules["pynvml"] = self.stand_in
        self._bin = tempfile.TemporaryDirectory(prefix="wattwatch-bench-")
        stub = Path(self._bin.name) / "nvidia-smi"
        stub.write_text("#!/bin/sh\necho 'NVIDIA System Management Interface (simulated stub)'\n")
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
        self._path = os.environ.get("PATH")
        os.environ["PATH"] = f"{self._bin.name}{os.pathsep}{self._path or ''}"
        logging.getLogger("codecarbon").setLevel(logging.ERROR)
        try:
            from codecarbon.core import gpu_nvidia
        except Exception as exc:  # any import failure is the reason printed instead of a number
            self.error: str | None = f"CodeCarbon failed to import ({type(exc).__name__}: {exc})"
            return
        gpu_nvidia.clear_nvidia_system_cache()
        self.error = None if gpu_nvidia.PYNVML_AVAILABLE else "CodeCarbon did not accept the fake pynvml"

    def point_at(self, fleet: SimulatedFleet) -> None:
        """Route CodeCarbon's pynvml calls to ``fleet``."""
        self.stand_in.target = fleet.module()

    def close(self) -> None:
        """Put the real pynvml and PATH back and remove the stub directory."""
        sys.modules["pynvml"] = self.real
        if self._path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = self._path
        self._bin.cleanup()


def codecarbon_method(shim: CodeCarbonShim) -> Method:
    """CodeCarbon's GPU measurement, as its tracker drives it, on the fake clock."""

    def measure(fleet: SimulatedFleet, windows: list[tuple[float, float]], clock: FakeClock) -> list[float]:
        if shim.error:
            raise Unavailable(shim.error)
        from codecarbon.external.hardware import GPU

        shim.point_at(fleet)
        clock.t_s = windows[0][0]
        gpu = GPU.from_utils(None)
        out = []
        for start_s, stop_s in windows:
            clock.t_s = start_s
            gpu.start()
            energy_j, last_s = 0.0, start_s
            k = 1
            while True:
                t_s = min(stop_s, start_s + k * CODECARBON_MONITOR_S)
                clock.t_s = t_s
                if t_s < stop_s:
                    gpu.monitor_power()
                due = t_s >= stop_s or t_s - last_s >= CODECARBON_MEASURE_S - 1e-9
                if due:
                    _, energy = gpu.measure_power_and_energy(last_duration=t_s - last_s)
                    energy_j += energy.kWh * J_PER_KWH
                    last_s = t_s
                if t_s >= stop_s:
                    break
                k += 1
            out.append(energy_j)
        return out

    return measure


def codecarbon_tracker_realtime(shim: CodeCarbonShim, seconds: float = 10.0) -> dict[str, float | str]:
    """CodeCarbon's whole ``OfflineEmissionsTracker`` and wattwatch's sensor measuring one simulated
    board through the same ``seconds`` of training, in real time (the tracker takes no fake clock).

    Returns the exact J, both measurements, and how long the tracker's start and stop took (its
    counter reads happen somewhere inside them, which bounds how exactly its window is known).
    """
    if shim.error:
        return {"error": shim.error}
    import time

    from codecarbon import OfflineEmissionsTracker

    fleet = SimulatedFleet(1, seed=11)
    shim.point_at(fleet)
    sensor = NvmlSensor(fleet.module())
    options: dict[str, Any] = {
        "country_iso_code": "USA",
        "save_to_file": False,
        "log_level": "error",
        "allow_multiple_runs": True,
        "gpu_ids": [0],
        "tracking_mode": "machine",
    }
    warm = OfflineEmissionsTracker(**options)  # hardware detection (~1 s) happens here, not in the window
    warm.start()
    warm.stop()
    fleet.set_activity(0, "training", time.time() + 0.2)
    tracker = OfflineEmissionsTracker(**options)
    time.sleep(0.5)
    began = time.time()
    tracker.start()
    start_took_s = time.time() - began
    (first,) = sensor.read_at(began)
    time.sleep(seconds)
    ended = time.time()
    tracker.stop()
    stop_took_s = time.time() - ended
    (last,) = sensor.read_at(ended)
    sensor.close()
    exact_j = fleet.exact_energy_j(0, began, ended)
    return {
        "seconds": seconds,
        "exact_j": exact_j,
        "codecarbon_j": float(tracker.final_emissions_data.gpu_energy) * J_PER_KWH,
        "wattwatch_j": last.energy_j - first.energy_j,
        "tracker_start_s": start_took_s,
        "tracker_stop_s": stop_took_s,
    }
