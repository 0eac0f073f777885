"""RAPL over a fixture powercap tree (tests/fixtures/powercap), and the CPU preference chain."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from wattwatch.errors import DeviceNotFound, PermissionDenied
from wattwatch.sensors.base import Sensor
from wattwatch.sensors.discovery import discover
from wattwatch.sensors.rapl import RaplSensor
from wattwatch.sim.clock import FakeClock
from wattwatch.sim.fleet import SimulatedFleet

FIXTURE = Path(__file__).parent / "fixtures" / "powercap"
T0 = 1_700_000_000.0
PACKAGE_RANGE_UJ = 262143328850
DRAM_RANGE_UJ = 65712999613


@pytest.fixture
def powercap(tmp_path: Path) -> Path:
    root = tmp_path / "powercap"
    shutil.copytree(FIXTURE, root)
    return root


def set_uj(root: Path, zone: str, value_uj: int) -> None:
    (root / zone / "energy_uj").write_text(f"{value_uj}\n")


def test_zones_become_cpu_and_dram_devices(powercap: Path) -> None:
    sensor = RaplSensor(powercap, FakeClock())
    assert isinstance(sensor, Sensor)
    assert [(d.key, d.kind, d.index) for d in sensor.devices()] == [
        ("cpu0", "cpu", 0),
        ("cpu1", "cpu", 1),
        ("dram0", "dram", 0),
        ("dram1", "dram", 1),
    ]
    with_psys = RaplSensor(powercap, FakeClock(), include_psys=True)
    assert "psys0" in [d.key for d in with_psys.devices()]


def test_cumulative_energy_and_wraparound(powercap: Path) -> None:
    clock = FakeClock()
    sensor = RaplSensor(powercap, clock)
    first = {r.device: r for r in sensor.read()}
    assert all(r.energy_j == 0.0 and r.source == "counter" for r in first.values())
    clock.t_s += 1.0
    set_uj(powercap, "intel-rapl:0", 100_000_000 + 150_000_000)  # 150 J
    set_uj(powercap, "intel-rapl:1", 1_671_150)  # wrapped: 328850 uJ to the top, then 1671150 uJ
    second = {r.device: r for r in sensor.read()}
    assert second["cpu0"].energy_j == pytest.approx(150.0)
    assert second["cpu1"].energy_j == pytest.approx(2.0)
    assert second["dram0"].energy_j == 0.0
    clock.t_s += 1.0
    set_uj(powercap, "intel-rapl:1", 11_671_150)
    assert {r.device: r for r in sensor.read()}["cpu1"].energy_j == pytest.approx(12.0)


def test_read_at_takes_off_the_energy_since_the_boundary(powercap: Path) -> None:
    clock = FakeClock()
    sensor = RaplSensor(powercap, clock)
    clock.t_s += 1.0
    set_uj(powercap, "intel-rapl:0", 200_000_000)  # 100 W over the last second
    sensor.read()
    clock.t_s += 0.5
    set_uj(powercap, "intel-rapl:0", 250_000_000)
    boundary = {r.device: r for r in sensor.read_at(T0 + 1.4)}["cpu0"]
    assert boundary.t_s == T0 + 1.4
    assert boundary.energy_j == pytest.approx(140.0)
    assert sensor.read()[0].energy_j == pytest.approx(150.0)
    assert sensor.read_at(T0)[0].energy_j == pytest.approx(150.0)  # never below a previous reading


def test_unreadable_energy_is_permission_denied_with_the_fix(powercap: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests may run as root, which chmod cannot lock out: refuse the read at the file boundary instead.
    real_read_text = Path.read_text

    def refuse(self: Path, *args: object, **kwargs: object) -> str:
        if self.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(PermissionDenied, match="run the agent as root") as info:
        RaplSensor(powercap, FakeClock())
    assert "udev" in str(info.value) and "energy_uj" in str(info.value)

    found = discover(powercap_root=powercap, simulate_fleet=one_simulated_gpu())
    (rapl,) = [s for s in found.skipped if s.name == "rapl"]
    assert rapl.reason == "RAPL energy counters are not readable" and "udev" in rapl.fix
    assert [s.name for s in found.sensors][-2:] == ["estimate", "dram-estimate"]


def test_no_rapl_is_device_not_found(tmp_path: Path) -> None:
    with pytest.raises(DeviceNotFound, match="no RAPL"):
        RaplSensor(tmp_path / "missing")
    (tmp_path / "intel-rapl").mkdir()
    with pytest.raises(DeviceNotFound):
        RaplSensor(tmp_path)


def one_simulated_gpu() -> SimulatedFleet:
    """Keeps discovery away from the real NVML, whatever this machine has."""
    return SimulatedFleet(1)


def test_poll_period_is_derived_from_the_range_and_max_power(powercap: Path) -> None:
    sensor = RaplSensor(powercap, FakeClock())
    periods = sensor.wrap_periods_s()
    assert periods["cpu0"] == pytest.approx(PACKAGE_RANGE_UJ / 205e6)  # constraint_0_max_power_uw: 205 W
    assert periods["cpu1"] == pytest.approx(PACKAGE_RANGE_UJ / 500e6)  # none given: DEFAULT_MAX_POWER_W
    assert periods["dram0"] == pytest.approx(DRAM_RANGE_UJ / 205e6)  # 0 = unknown: its package's 205 W
    assert periods["dram1"] == pytest.approx(DRAM_RANGE_UJ / 500e6)
    assert sensor.max_poll_interval_s == pytest.approx(DRAM_RANGE_UJ / 500e6 / 2)  # ~66 s


def small_range_package(root: Path, range_uj: int, max_power_w: float) -> None:
    """Package 0 with a small counter range, so a test can wrap it in seconds; package 1 and DRAM removed."""
    for zone in ("intel-rapl:1", "intel-rapl:1:0", "intel-rapl:0:1"):
        shutil.rmtree(root / zone)
    (root / "intel-rapl:0" / "max_energy_range_uj").write_text(f"{range_uj}\n")
    (root / "intel-rapl:0" / "constraint_0_max_power_uw").write_text(f"{round(max_power_w * 1e6)}\n")
    set_uj(root, "intel-rapl:0", 0)


def run_steady_load(root: Path, poll_s: float, power_w: float, duration_s: float, range_uj: int) -> tuple[float, bool]:
    """Energy measured (J) by reading every ``poll_s`` while the package draws ``power_w``; and whether
    any reading was flagged ``wrap_ambiguous``."""
    set_uj(root, "intel-rapl:0", 0)
    clock = FakeClock()
    sensor = RaplSensor(root, clock)
    start = sensor.read()[0].energy_j
    flagged = False
    elapsed_s = 0.0
    while elapsed_s < duration_s:
        elapsed_s = min(duration_s, elapsed_s + poll_s)
        clock.t_s = T0 + elapsed_s
        set_uj(root, "intel-rapl:0", round(power_w * 1e6 * elapsed_s) % range_uj)
        reading = sensor.read()[0]
        flagged = flagged or "wrap_ambiguous" in reading.flags
    return reading.energy_j - start, flagged


def test_double_wrap_is_prevented_by_polling_at_the_derived_period(powercap: Path) -> None:
    range_uj = 1_000_000_000  # 1 kJ: at 250 W the counter wraps every 4 s
    small_range_package(powercap, range_uj, max_power_w=250.0)
    sensor = RaplSensor(powercap, FakeClock())
    assert sensor.max_poll_interval_s == pytest.approx(2.0)
    # 10 s at full power is 2.5 kJ, two and a half wraps.
    measured_j, flagged = run_steady_load(powercap, sensor.max_poll_interval_s, 250.0, 10.0, range_uj)
    assert measured_j == pytest.approx(2500.0) and not flagged
    # Read too slowly and the two wraps look like none: 2 kJ vanish, and the reading says it may have.
    measured_j, flagged = run_steady_load(powercap, 10.0, 250.0, 10.0, range_uj)
    assert measured_j == pytest.approx(500.0) and flagged
    # One read per 5 s is 1.25 ranges at full power: each interval loses a whole range, and says so.
    measured_j, flagged = run_steady_load(powercap, 5.0, 250.0, 10.0, range_uj)
    assert measured_j == pytest.approx(500.0) and flagged


def test_missing_dram_zone_is_estimated_and_said(powercap: Path) -> None:
    shutil.rmtree(powercap / "intel-rapl:0:1")
    shutil.rmtree(powercap / "intel-rapl:1:0")
    sensor = RaplSensor(powercap, FakeClock())
    assert [d.key for d in sensor.devices()] == ["cpu0", "cpu1"]
    found = discover(powercap_root=powercap, simulate_fleet=one_simulated_gpu())
    assert [s.name for s in found.sensors] == ["nvml", "rapl", "dram-estimate"]
    (note,) = found.skipped
    assert note.name == "rapl-dram" and "no DRAM zone" in note.reason and "estimated" in note.fix
    found = discover(powercap_root=powercap, simulate_fleet=one_simulated_gpu(), estimate_dram=False)
    assert [s.name for s in found.sensors] == ["nvml", "rapl"]
