"""RAPL over a fixture powercap tree (tests/fixtures/powercap), and the CPU preference chain."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from wattwatch.errors import DeviceNotFound, PermissionDenied
from wattwatch.sensors.base import Sensor
from wattwatch.sensors.discovery import discover
from wattwatch.sensors.rapl import RaplSensor
from wattwatch.sensors.simulated import SimulatedFleet

FIXTURE = Path(__file__).parent / "fixtures" / "powercap"
T0 = 1_700_000_000.0
PACKAGE_RANGE_UJ = 262143328850


class FakeClock:
    """Simulated time."""

    def __init__(self, t_s: float = T0) -> None:
        self.t_s = t_s

    def __call__(self) -> float:
        return self.t_s


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
    assert [s.name for s in found.sensors][-1] == "estimate"


def test_no_rapl_is_device_not_found(tmp_path: Path) -> None:
    with pytest.raises(DeviceNotFound, match="no RAPL"):
        RaplSensor(tmp_path / "missing")
    (tmp_path / "intel-rapl").mkdir()
    with pytest.raises(DeviceNotFound):
        RaplSensor(tmp_path)


def test_cpu_chain_prefers_rapl_and_never_adds_the_estimate_too(powercap: Path, tmp_path: Path) -> None:
    found = discover(powercap_root=powercap, simulate_fleet=one_simulated_gpu())
    assert [s.name for s in found.sensors] == ["nvml", "rapl"]
    assert not found.skipped

    found = discover(powercap_root=tmp_path / "none", simulate_fleet=one_simulated_gpu())
    assert [s.name for s in found.sensors] == ["nvml", "estimate"]
    (rapl,) = found.skipped
    assert rapl.name == "rapl" and "no RAPL" in rapl.reason and rapl.fix


def one_simulated_gpu() -> SimulatedFleet:
    """Keeps discovery away from the real NVML, whatever this machine has."""
    return SimulatedFleet(1)
