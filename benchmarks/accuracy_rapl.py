"""The RAPL double-wrap trace: a CPU package whose ``energy_uj`` wraps every few seconds at full load.

A powercap tree is written to a temporary directory: one package zone with a 2^32 uJ (4.29 kJ)
counter range and a 400 W maximum power, drawing 250-380 W (piecewise constant per 100 ms, from a
fixed seed). Before every read, ``energy_uj`` is set to the exact cumulative energy modulo the range,
so a reader sees what the kernel would show. Compared: ``RaplSensor`` read at its derived
``max_poll_interval_s`` and at the agent's 1 s tick, the same sensor read every 30 s (too slowly:
two wraps fit in one interval), and CodeCarbon's ``RAPLFile`` read every 15 s (its default).
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path

from accuracy_traces import T_START

from wattwatch.sensors.rapl import RaplSensor
from wattwatch.sim.clock import FakeClock

RANGE_UJ = 2**32
MAX_POWER_W = 400.0
STEP_S = 0.1
JOB_START_S = T_START + 3.21
JOB_S = 60.0


class Package:
    """A simulated package: exact energy and the counter file that shows it."""

    def __init__(self, root: Path, seed: int = 5) -> None:
        rng = random.Random(seed)
        self.power_w = [rng.uniform(250.0, 380.0) for _ in range(int((JOB_S + 60.0) / STEP_S))]
        self.prefix_j = [0.0, *accumulate(p * STEP_S for p in self.power_w)]
        self.zone = root / "intel-rapl:0"
        self.zone.mkdir(parents=True)
        (self.zone / "name").write_text("package-0\n")
        (self.zone / "max_energy_range_uj").write_text(f"{RANGE_UJ}\n")
        (self.zone / "constraint_0_max_power_uw").write_text(f"{round(MAX_POWER_W * 1e6)}\n")
        self.show(T_START)

    def energy_j(self, t_s: float) -> float:
        """Exact energy from T_START to ``t_s``."""
        x = (t_s - T_START) / STEP_S
        k = min(int(x), len(self.power_w) - 1)
        return self.prefix_j[k] + self.power_w[k] * (x - k) * STEP_S

    def show(self, t_s: float) -> None:
        """Write ``energy_uj`` as the kernel would show it at ``t_s`` (wrapped, integer uJ)."""
        value_uj = (123_456_789 + int(self.energy_j(t_s) * 1e6)) % RANGE_UJ
        (self.zone / "energy_uj").write_text(f"{value_uj}\n")


def _wattwatch(poll_s: float | None) -> Callable[[Package, Path, FakeClock], tuple[float, bool]]:
    def measure(package: Package, root: Path, clock: FakeClock) -> tuple[float, bool]:
        clock.t_s = T_START
        package.show(clock.t_s)
        sensor = RaplSensor(root, clock)
        period_s = sensor.max_poll_interval_s if poll_s is None else poll_s
        flagged = False
        energies: list[float] = []
        t_s = T_START
        for boundary_s in (JOB_START_S, JOB_START_S + JOB_S):
            while t_s + period_s < boundary_s:
                t_s += period_s
                clock.t_s = t_s
                package.show(t_s)
                flagged = flagged or any(r.flags for r in sensor.read())
            clock.t_s = t_s = boundary_s + 0.002  # the boundary read comes a moment later
            package.show(t_s)
            (reading,) = sensor.read_at(boundary_s)
            flagged = flagged or bool(reading.flags)
            energies.append(reading.energy_j)
        return energies[1] - energies[0], flagged

    return measure


def _codecarbon(package: Package, root: Path, clock: FakeClock) -> tuple[float, bool]:
    from codecarbon.core.rapl import RAPLFile
    from codecarbon.core.units import Time

    clock.t_s = JOB_START_S
    package.show(clock.t_s)
    zone = str(package.zone)
    counter = RAPLFile("package-0", f"{zone}/energy_uj", f"{zone}/max_energy_range_uj")
    counter.start()
    energy_j, last_s, t_s = 0.0, JOB_START_S, JOB_START_S
    while t_s < JOB_START_S + JOB_S:
        t_s = min(JOB_START_S + JOB_S, t_s + 15.0)
        package.show(t_s)
        counter.delta(Time.from_seconds(t_s - last_s))
        energy_j += counter.energy_delta.kWh * 3.6e6
        last_s = t_s
    return energy_j, False


def run_rapl() -> tuple[float, list[tuple[str, float | str, bool]]]:
    """(exact J, [(method, measured J or why not, flagged)]) for the double-wrap trace."""
    rows: list[tuple[str, float | str, bool]] = []
    methods: list[tuple[str, Callable[[Package, Path, FakeClock], tuple[float, bool]]]] = [
        ("wattwatch, read at max_poll_interval_s", _wattwatch(None)),
        ("wattwatch, read every 1 s (agent tick)", _wattwatch(1.0)),
        ("wattwatch, read every 30 s (too slow)", _wattwatch(30.0)),
        ("CodeCarbon RAPLFile, every 15 s", _codecarbon),
    ]
    exact_j = 0.0
    for name, method in methods:
        with tempfile.TemporaryDirectory(prefix="wattwatch-rapl-") as tmp:
            root = Path(tmp)
            package = Package(root)
            exact_j = package.energy_j(JOB_START_S + JOB_S) - package.energy_j(JOB_START_S)
            try:
                measured_j, flagged = method(package, root, FakeClock(T_START))
            except ImportError as exc:
                rows.append((name, f"unavailable ({exc})", False))
                continue
            rows.append((name, measured_j, flagged))
    return exact_j, rows


def derived_poll_interval_s() -> float:
    """The sensor's ``max_poll_interval_s`` for this package (for the table's caption)."""
    with tempfile.TemporaryDirectory(prefix="wattwatch-rapl-") as tmp:
        Package(Path(tmp))
        return RaplSensor(Path(tmp), FakeClock(T_START)).max_poll_interval_s
