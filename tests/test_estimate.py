"""The CPU estimate: TDP lookup from codecarbon's table, and TDP x max(idle floor, utilisation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wattwatch.sensors.base import Sensor
from wattwatch.sensors.estimate import (
    DEFAULT_W_PER_CORE,
    DRAM_W_PER_GIB,
    IDLE_FRACTION,
    CpuEstimateSensor,
    CpuTimesUtilisation,
    DramEstimateSensor,
    codecarbon_cpu_table,
    installed_memory_gib,
    match_cpu_tdp_w,
    read_cpuinfo,
)
from wattwatch.sim.clock import FakeClock

T0 = 1_700_000_000.0


class Utilisation:
    """Injected CPU busy percent, changed by the test."""

    def __init__(self, percent: float) -> None:
        self.percent = percent

    def __call__(self) -> float:
        return self.percent


TABLE = "Name,TDP\nIntel Xeon Gold 6248,150\nIntel Xeon Gold 6248R,205\nAMD EPYC 7763,280\nAMD EPYC 7763X,bad\n"

CPUINFO_2_SOCKETS = "".join(
    f"processor\t: {i}\nmodel name\t: Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz\n"
    f"physical id\t: {i // 4}\ncore id\t\t: {i % 4}\n\n"
    for i in range(8)
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_arithmetic_with_injected_utilisation_and_tdp() -> None:
    clock, util = FakeClock(), Utilisation(50.0)
    sensor = CpuEstimateSensor(tdp_w=200.0, clock=clock, cpu_percent=util)
    assert isinstance(sensor, Sensor)
    assert [d.key for d in sensor.devices()] == ["cpu0"] and sensor.devices()[0].kind == "cpu"
    assert sensor.tdp_source == "TDP 200 W as configured"
    first = sensor.read()[0]
    assert first.source == "estimate" and first.energy_j == 0.0
    clock.t_s += 2.0
    assert sensor.read()[0].energy_j == pytest.approx(200.0 * 0.5 * 2.0)
    util.percent = 3.0  # below the idle floor
    clock.t_s += 10.0
    assert sensor.read()[0].energy_j == pytest.approx(200.0 + 200.0 * IDLE_FRACTION * 10.0)
    util.percent = 250.0  # nonsense from a broken source is capped at TDP
    clock.t_s += 1.0
    assert sensor.read()[0].energy_j == pytest.approx(200.0 + 240.0 + 200.0)
    assert sensor.power_w(0.0) == pytest.approx(24.0) and sensor.power_w(100.0) == 200.0


def test_read_at_is_consistent_with_ticks() -> None:
    clock, util = FakeClock(), Utilisation(100.0)
    sensor = CpuEstimateSensor(tdp_w=100.0, clock=clock, cpu_percent=util)
    clock.t_s += 1.0
    tick = sensor.read()[0]
    clock.t_s += 1.0
    boundary = sensor.read_at(T0 + 1.5)[0]  # inside the interval [1, 2] just closed
    assert boundary.t_s == T0 + 1.5 and boundary.energy_j == pytest.approx(150.0)
    assert sensor.read()[0].energy_j == pytest.approx(200.0)
    assert tick.energy_j == pytest.approx(100.0)
    assert sensor.read_at(T0 + 2.5)[0].energy_j == pytest.approx(250.0)  # extrapolated at current power
    assert sensor.read_at(T0 + 0.5)[0].energy_j >= 250.0  # never below what was returned
    sensor.close()


def test_tdp_from_the_table_times_sockets(tmp_path: Path) -> None:
    table = write(tmp_path, "cpu_power.csv", TABLE)
    cpuinfo = write(tmp_path, "cpuinfo", CPUINFO_2_SOCKETS)
    assert read_cpuinfo(cpuinfo) == ("Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz", 2, 8)
    sensor = CpuEstimateSensor(cpuinfo_path=cpuinfo, cpu_table=table, cpu_percent=Utilisation(0))
    assert sensor.tdp_w == 300.0
    assert "150 W x 2 socket(s)" in sensor.tdp_source and "Intel Xeon Gold 6248" in sensor.tdp_source
    assert sensor.devices()[0].power_limit_w == 300.0


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz", "Intel Xeon Gold 6248"),
        ("Intel(R) Xeon(R) Gold 6248R CPU @ 3.00GHz", "Intel Xeon Gold 6248R"),  # most specific row wins
        ("AMD EPYC 7763 64-Core Processor", "AMD EPYC 7763"),
        ("AMD EPYC 7713 64-Core Processor", None),  # another model number is not a match
        ("AMD EPYC", None),  # no model number at all
        ("", None),
    ],
)
def test_model_matching(tmp_path: Path, model: str, name: str | None) -> None:
    match = match_cpu_tdp_w(model, write(tmp_path, "t.csv", TABLE))
    assert (match[0] if match else None) == name


def test_the_installed_codecarbon_table_is_found_and_read() -> None:
    table = codecarbon_cpu_table()
    if table is None:
        pytest.skip("codecarbon is not installed")
    assert match_cpu_tdp_w("AMD EPYC 7763 64-Core Processor", table) == ("AMD EPYC 7763", 280.0)
    assert match_cpu_tdp_w("Intel(R) Core(TM) i7-8700K CPU @ 3.70GHz", table) == ("Intel Core i7-8700K", 95.0)


def test_unknown_cpu_falls_back_to_a_documented_default_per_core(tmp_path: Path) -> None:
    table = write(tmp_path, "t.csv", TABLE)
    cpuinfo = write(tmp_path, "cpuinfo", CPUINFO_2_SOCKETS.replace("Gold 6248", "Gold 9999"))
    sensor = CpuEstimateSensor(cpuinfo_path=cpuinfo, cpu_table=table, cpu_percent=Utilisation(0))
    assert sensor.tdp_w == DEFAULT_W_PER_CORE * 8
    assert "default" in sensor.tdp_source and "not in codecarbon's CPU table" in sensor.tdp_source
    nothing = CpuEstimateSensor(cpuinfo_path=tmp_path / "missing", cpu_table=table, cpu_percent=Utilisation(0))
    assert "no CPU model" in nothing.tdp_source and nothing.tdp_w >= 15.0


def test_cpu_times_utilisation_is_a_percentage() -> None:
    util = CpuTimesUtilisation()
    sum(i * i for i in range(200_000))  # some work between the two samples
    assert 0.0 <= util() <= 100.0


def test_cpu_times_utilisation_reads_proc_stat_between_calls(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice (ticks), then per-CPU lines.
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 100 0 50 800 50 0 0 0 0 0\n")
    util = CpuTimesUtilisation(str(stat))
    stat.write_text("cpu  160 0 70 900 70 0 0 0 0 0\ncpu0 160 0 70 900 70 0 0 0 0 0\n")
    assert util() == pytest.approx(100.0 * 80 / 200)  # 80 busy ticks of 200
    assert util() == 0.0  # nothing elapsed since
    missing = CpuTimesUtilisation(str(tmp_path / "no-such-stat"))  # not Linux: psutil's times instead
    assert 0.0 <= missing() <= 100.0


def test_dram_rule_is_a_constant_per_installed_gib(tmp_path: Path) -> None:
    meminfo = write(tmp_path, "meminfo", "MemTotal:       527958384 kB\nMemFree:        1000 kB\n")
    assert installed_memory_gib(meminfo) == pytest.approx(503.5, abs=0.1)
    assert installed_memory_gib(tmp_path / "missing") is None
    clock = FakeClock()
    sensor = DramEstimateSensor(clock=clock, meminfo_path=meminfo)
    assert isinstance(sensor, Sensor)
    assert sensor.power_w == pytest.approx(DRAM_W_PER_GIB * 503.5, abs=0.02)  # ~63 W for 512 GB
    assert [(d.key, d.kind) for d in sensor.devices()] == [("dram0", "dram")]
    assert "W/GiB" in sensor.rule
    first = sensor.read()[0]
    assert first.source == "estimate" and first.energy_j == 0.0
    clock.t_s += 10.0
    assert sensor.read()[0].energy_j == pytest.approx(10.0 * sensor.power_w)
    assert sensor.read_at(T0 + 4.0)[0].energy_j == pytest.approx(10.0 * sensor.power_w)  # never goes down
    assert sensor.read_at(T0 + 12.0)[0].energy_j == pytest.approx(12.0 * sensor.power_w)
    fixed = DramEstimateSensor(memory_gib=64.0, clock=clock)
    assert fixed.power_w == 8.0  # one 64 GiB RDIMM
    assert DramEstimateSensor(meminfo_path=tmp_path / "missing").memory_gib > 0  # psutil fallback
