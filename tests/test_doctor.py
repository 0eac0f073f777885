"""``run_doctor`` against simulated GPUs (one without an energy counter) and fixture powercap trees."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pynvml
import pytest

from wattwatch.cli.doctor import run_doctor
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.sim.generations import H100

FIXTURE = Path(__file__).parent / "fixtures" / "powercap"


@pytest.fixture
def powercap(tmp_path: Path) -> Path:
    root = tmp_path / "powercap"
    shutil.copytree(FIXTURE, root)
    return root


def test_healthy_host_lists_every_gpu_and_zone(powercap: Path) -> None:
    fleet = SimulatedFleet(2, seed=1)
    fleet.set_energy_counter_supported(1, False)
    text, code = run_doctor(simulate_fleet=fleet, powercap_root=powercap)
    assert code == 0, text
    assert "2 SIMULATED GPUs, NVIDIA driver 550.54.15" in text
    for index in (0, 1):
        assert fleet.uuid(index) in text
    assert text.count("NVIDIA H100 80GB HBM3") == 2 and text.count("power limit 700 W") == 2
    gpu0, gpu1 = (text.split(f"gpu{i} ")[1].split("\n")[1] for i in (0, 1))
    assert "energy counter: yes" in gpu0 and "POWER_INSTANT: yes" in gpu0 and "exact" in gpu0
    assert "energy counter: NO" in gpu1 and "POWER_INSTANT: yes" in gpu1 and "vGPU/MIG" in gpu1
    assert "cpu0 (RAPL package-0)" in text and "dram1" in text and "read at least every 66 s" in text
    assert "Nothing to fix" in text and "FIX" not in text


def test_pre_volta_board_has_no_counter_and_no_instant_power(tmp_path: Path) -> None:
    text, code = run_doctor(simulate_fleet=SimulatedFleet(1, generation="p100"), powercap_root=tmp_path)
    assert code == 0, text  # old hardware and no RAPL are facts, not problems
    assert "1 SIMULATED GPU," in text and "Tesla P100-PCIE-16GB" in text and "power limit 250 W" in text
    assert "energy counter: NO   POWER_INSTANT: no" in text
    assert "skip  rapl" in text and "modprobe intel_rapl_common" in text
    assert "cpu0 ESTIMATED" in text and "dram0 ESTIMATED by rule" in text


def test_unreadable_rapl_is_a_problem_with_the_fix(powercap: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_read_text = Path.read_text

    def refuse(self: Path, *args: object, **kwargs: object) -> str:
        if self.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", refuse)
    text, code = run_doctor(simulate_fleet=SimulatedFleet(1), powercap_root=powercap)
    assert code == 1
    assert "FIX   rapl           RAPL energy counters are not readable" in text
    assert "udev rule" in text and "run the agent as root" in text
    assert "cpu0 ESTIMATED" in text  # measured meanwhile, by the estimate
    assert "1 problem(s) to fix" in text


def test_missing_dram_zone_is_noted_not_a_problem(powercap: Path) -> None:
    shutil.rmtree(powercap / "intel-rapl:0:1")
    shutil.rmtree(powercap / "intel-rapl:1:0")
    text, code = run_doctor(simulate_fleet=SimulatedFleet(1), powercap_root=powercap)
    assert code == 0, text
    assert "no DRAM zone" in text and "dram0 ESTIMATED by rule" in text


def failing_module(code: int) -> object:
    module = SimulatedFleet(1).module()

    def fail() -> None:
        raise pynvml.NVMLError(code)

    module.nvmlInit = fail
    return module


def test_nvml_failures(tmp_path: Path) -> None:
    text, code = run_doctor(nvml=failing_module(pynvml.NVML_ERROR_NO_PERMISSION), powercap_root=tmp_path)
    assert code == 1 and "FIX   nvml" in text and "/dev/nvidia" in text
    text, code = run_doctor(nvml=failing_module(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), powercap_root=tmp_path)
    assert code == 0 and "skip  nvml" in text and "install the NVIDIA driver, or try --simulate N" in text


def test_a_gpu_that_cannot_be_opened_is_a_problem_and_the_others_are_listed(tmp_path: Path) -> None:
    fleet = SimulatedFleet(3, seed=2)
    fleet.lose(1)
    text, code = run_doctor(simulate_fleet=fleet, powercap_root=tmp_path)
    assert code == 1
    assert "2 SIMULATED GPUs" in text and "gpu0 " in text and "gpu2 " in text
    assert "FIX   nvml           GPU 1 is not measured" in text and "fell off the bus" in text


def test_doctor_prints_the_timings_it_learned_from_each_gpu(tmp_path: Path) -> None:
    # A 20 ms board the sensor was never told about; a process was busy on it before the doctor ran.
    fleet = SimulatedFleet(1, seed=3, generation=dataclasses.replace(H100, update_period_s=0.02))
    now_s = fleet.clock()
    fleet.set_activity(0, "training", now_s - 5.0, pid=42)
    fleet.set_process_utilization(0, 42, 60.0, now_s - 5.0)
    text, code = run_doctor(simulate_fleet=fleet, powercap_root=tmp_path)
    assert code == 0, text
    refresh = re.search(r"counter refresh: every ([\d.]+) ms \(±([\d.]+) ms\), from (\d+) seen", text)
    assert refresh is not None, text
    assert float(refresh[1]) == pytest.approx(20.0, rel=0.02) and float(refresh[2]) < 0.4 and int(refresh[3]) >= 10
    assert "next refresh placed within ±" in text
    assert "instant power: live (it changes between counter refreshes)" in text
    samples = re.search(r"per-process samples: every ([\d.]+) ms", text)
    assert samples is not None and float(samples[1]) == pytest.approx(1000 / 6, rel=0.01), text
    latency = re.search(r"NVML call latency: median ([\d.]+) ms, p95 ([\d.]+) ms \(over (\d+) reads\)", text)
    assert latency is not None and float(latency[1]) <= float(latency[2]) and int(latency[3]) > 10


def test_doctor_says_why_a_timing_is_not_learned(tmp_path: Path) -> None:
    fleet = SimulatedFleet(2, seed=1, generation="h100-parttime")
    fleet.set_energy_counter_supported(1, False)
    module = fleet.module()
    real = module.nvmlDeviceGetTotalEnergyConsumption
    # gpu0's counter is stuck (it answers, always the same); gpu1 has none (NVML: NotSupported).
    module.nvmlDeviceGetTotalEnergyConsumption = lambda handle: 1000 if handle.index == 0 else real(handle)
    text, code = run_doctor(nvml=module, powercap_root=tmp_path)
    assert code == 0, text  # nothing to fix: measured meanwhile without the timing
    gpu0, gpu1 = text.split("gpu0 ")[1].split("gpu1 ")
    assert "counter refresh: not learned yet: the counter did not change in 1.00 s of polling" in gpu0
    assert "per-process samples: not learned yet: no process was busy" in gpu0
    assert "counter refresh: none (no energy counter)" in gpu1
