"""The preference chain: which sensors discovery picks, and why (and how to fix) for the ones it skips."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pynvml
import pytest

from wattwatch.sensors.discovery import discover
from wattwatch.sim.fleet import SimulatedFleet

FIXTURE = Path(__file__).parent / "fixtures" / "powercap"


@pytest.fixture
def powercap(tmp_path: Path) -> Path:
    root = tmp_path / "powercap"
    shutil.copytree(FIXTURE, root)
    return root


def one_simulated_gpu() -> SimulatedFleet:
    """Keeps discovery away from the real NVML, whatever this machine has."""
    return SimulatedFleet(1)


def no_driver_module(code: int) -> Any:
    module = SimulatedFleet(1).module()

    def fail() -> None:
        raise pynvml.NVMLError(code)

    module.nvmlInit = fail
    return module


def test_discovery_gpu_chain(tmp_path: Any) -> None:
    found = discover(nvml=no_driver_module(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), powercap_root=tmp_path)
    assert found.nvml is None
    (gpu,) = [s for s in found.skipped if s.name == "nvml"]
    assert gpu.reason == "NVML library not found / no NVIDIA driver"
    assert gpu.fix == "install the NVIDIA driver, or try --simulate N"
    assert [s.name for s in found.sensors] == ["estimate", "dram-estimate"]

    fleet = SimulatedFleet(2, seed=1)
    found = discover(simulate_fleet=fleet, powercap_root=tmp_path)
    assert found.nvml is not None and found.sensors[0] is found.nvml
    assert [d.key for d in found.nvml.devices()] == ["gpu0", "gpu1"]
    assert not any(s.name == "nvml" for s in found.skipped)
    for sensor in found.sensors:
        sensor.close()

    found = discover(nvml=no_driver_module(pynvml.NVML_ERROR_NO_PERMISSION), powercap_root=tmp_path)
    (gpu,) = [s for s in found.skipped if s.name == "nvml"]
    assert "/dev/nvidia" in gpu.fix
    assert gpu.problem  # the driver is there but refuses: fixable


def test_cpu_chain_prefers_rapl_and_never_adds_the_estimate_too(powercap: Path, tmp_path: Path) -> None:
    found = discover(powercap_root=powercap, simulate_fleet=one_simulated_gpu())
    assert [s.name for s in found.sensors] == ["nvml", "rapl"]
    assert not found.skipped

    found = discover(powercap_root=tmp_path / "none", simulate_fleet=one_simulated_gpu())
    assert [s.name for s in found.sensors] == ["nvml", "estimate", "dram-estimate"]
    assert [d.kind for d in found.sensors[2].devices()] == ["dram"]
    (rapl,) = found.skipped
    assert rapl.name == "rapl" and "no RAPL" in rapl.reason and rapl.fix


def test_absent_hardware_is_not_a_problem_but_refusals_are(powercap: Path, tmp_path: Path) -> None:
    found = discover(nvml=no_driver_module(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), powercap_root=tmp_path / "x")
    assert {s.name: s.problem for s in found.skipped} == {"nvml": False, "rapl": False}
    found = discover(nvml=no_driver_module(pynvml.NVML_ERROR_UNKNOWN), powercap_root=powercap)
    (gpu,) = found.skipped
    assert gpu.reason == "NVML failed to start" and gpu.problem and "nvidia-smi" in gpu.fix


def test_simulated_generations_are_discovered_with_their_capabilities(tmp_path: Path) -> None:
    found = discover(simulate_fleet=SimulatedFleet(2, generation="p100"), powercap_root=tmp_path)
    assert found.nvml is not None
    caps = found.nvml.capabilities()
    assert [(c.model, c.energy_counter, c.power_instant) for c in caps] == [("Tesla P100-PCIE-16GB", False, False)] * 2
    for sensor in found.sensors:
        sensor.close()
