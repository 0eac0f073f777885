"""Which sensors work on this host, and why the others don't: the preference chain.

GPUs: the simulated fleet when asked for, else NVML. CPUs: RAPL counters when readable, else the
TDP x utilisation estimate (never both for the same package: the sum would count it twice). DRAM:
RAPL's DRAM zones, else the per-GiB rule of ``estimate.DramEstimateSensor``. Every
source not used is listed in ``Discovery.skipped`` with the reason and the fix, for ``wattwatch
doctor`` and the agent's start-up log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wattwatch.errors import DeviceNotFound, PermissionDenied, SensorError
from wattwatch.sensors.base import Sensor
from wattwatch.sensors.nvml import NO_DRIVER, NO_DRIVER_FIX, NvmlSensor

if TYPE_CHECKING:
    from wattwatch.sim.fleet import SimulatedFleet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Skipped:
    """A source that is not used here: what went wrong and what would make it work.

    ``problem`` is True when the source exists but is unusable for a reason the user can fix
    (permissions, a failing driver); False when it is simply absent (no NVIDIA driver, RAPL in a VM).
    """

    name: str
    reason: str
    fix: str = ""
    detail: str = ""
    problem: bool = False


@dataclass
class Discovery:
    """The sensors to use, the ones skipped (with reasons), and the NVML sensor for process lookups."""

    sensors: list[Sensor] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    nvml: NvmlSensor | None = None


def discover(
    *,
    simulate_fleet: SimulatedFleet | None = None,
    powercap_root: Path = Path("/sys/class/powercap"),
    nvml: Any | None = None,
    estimate_dram: bool = True,
    cpu_tdp_w: float | None = None,
) -> Discovery:
    """Build the sensors this host supports, preferring counters to estimates, and say why for the rest.

    ``estimate_dram=False`` leaves DRAM unmeasured where no RAPL DRAM zone exists, instead of estimating it.
    ``cpu_tdp_w`` overrides the CPU's TDP looked up for the estimate (``WATTWATCH_CPU_TDP``).
    """
    found = Discovery()
    _discover_gpus(found, simulate_fleet, nvml)
    _discover_cpus(found, powercap_root, estimate_dram, cpu_tdp_w)
    for s in found.skipped:
        log.info("sensor %s skipped: %s (fix: %s)", s.name, s.reason, s.fix)
    return found


def _discover_gpus(found: Discovery, fleet: SimulatedFleet | None, nvml: Any | None) -> None:
    try:
        sensor = NvmlSensor(fleet.module(), clock=fleet.clock) if fleet is not None else NvmlSensor(nvml)
    except DeviceNotFound as exc:
        found.skipped.append(Skipped("nvml", NO_DRIVER, NO_DRIVER_FIX, str(exc)))
        return
    except PermissionDenied as exc:
        fix = "run the agent as a user that may open /dev/nvidia* (root, or the group owning them)"
        found.skipped.append(Skipped("nvml", "the NVIDIA driver refused access", fix, str(exc), problem=True))
        return
    except SensorError as exc:
        fix = "check the driver with `nvidia-smi`; reinstall it if that fails too"
        found.skipped.append(Skipped("nvml", "NVML failed to start", fix, str(exc), problem=True))
        return
    if not sensor.devices():
        sensor.close()
        found.skipped.append(
            Skipped("nvml", "NVML works but lists no GPU", "check `nvidia-smi -L`; or try --simulate N")
        )
        return
    found.sensors.append(sensor)
    found.nvml = sensor


def _discover_cpus(found: Discovery, powercap_root: Path, estimate_dram: bool, cpu_tdp_w: float | None = None) -> None:
    from wattwatch.sensors.estimate import CpuEstimateSensor, DramEstimateSensor
    from wattwatch.sensors.rapl import PERMISSION_FIX, RaplSensor

    try:
        rapl = RaplSensor(powercap_root)
        found.sensors.append(rapl)
        if not any(d.kind == "dram" for d in rapl.devices()):
            found.skipped.append(
                Skipped(
                    "rapl-dram",
                    "RAPL has no DRAM zone here (common on AMD and client CPUs)",
                    "nothing to fix: DRAM is estimated by rule" if estimate_dram else "DRAM is not measured",
                )
            )
            if estimate_dram:
                found.sensors.append(DramEstimateSensor())
        return
    except PermissionDenied as exc:
        found.skipped.append(
            Skipped("rapl", "RAPL energy counters are not readable", PERMISSION_FIX, str(exc), problem=True)
        )
    except DeviceNotFound as exc:
        found.skipped.append(
            Skipped(
                "rapl",
                f"no RAPL energy counters under {powercap_root}",
                "on bare metal: modprobe intel_rapl_common; in a VM RAPL is usually unavailable "
                "(CPU energy is then estimated from TDP and utilisation)",
                str(exc),
            )
        )
    except SensorError as exc:
        found.skipped.append(
            Skipped("rapl", "RAPL counters failed to read", "check the powercap sysfs", str(exc), problem=True)
        )
    # Never alongside RAPL: both would report the same packages.
    found.sensors.append(CpuEstimateSensor(tdp_w=cpu_tdp_w))
    if estimate_dram:
        found.sensors.append(DramEstimateSensor())
