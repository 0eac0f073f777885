"""The Sensor protocol: every source presents cumulative joules per device.

A sensor hides its hardware's quirks (NVML millijoules, RAPL wraparound, counter resets, power-only
devices it must integrate) behind one promise: ``read()`` returns, per device, a cumulative energy in
joules that never goes down, and the sampler turns consecutive readings into interval energy by
subtraction. The origin of the cumulative value is arbitrary; only differences mean anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from wattwatch.protocol.units import DeviceKind, Source


@dataclass(frozen=True)
class DeviceInfo:
    """A measured device. ``key`` is unique on the host: ``gpu0``, ``cpu0`` (package 0), ``dram0``."""

    key: str
    kind: DeviceKind
    index: int
    uuid: str | None = None
    model: str | None = None
    power_limit_w: float | None = None


@dataclass(frozen=True)
class EnergyReading:
    """Cumulative energy of one device as of ``t_s`` (Unix seconds).

    ``energy_j`` is monotonic per device, except that a reading may be below the one before by at most
    that one's ``extrapolated_j``. ``flags`` names anything the consumer should know about the
    energy added since the previous reading (``counter_reset``: bridged from power after a reset;
    ``boundary_unrefined``: a boundary read that could not be pinned to the counter's update).
    ``counter_j`` is the same reading on the hardware counter's own scale (see the field).
    """

    device: str
    t_s: float
    energy_j: float
    source: Source
    flags: tuple[str, ...] = field(default=())
    # The hardware counter's own value at ``t_s`` in joules, from its own origin (NVML: since driver load
    # or its last reset; RAPL: the wrapping ``energy_uj``): it keeps counting while no agent runs, so a
    # restarted agent can measure the gap (``agent.restore``). None where there is no counter.
    counter_j: float | None = None
    # The counter wraps after this many joules (RAPL's ``max_energy_range_uj``); 0: it does not wrap.
    counter_wrap_j: float = 0.0
    # The part of ``energy_j`` estimated past what the hardware has counted (a tick read adds the instant
    # power since the counter's last refresh). A later reading may come in up to this much lower (the
    # estimate overshot): the consumer then lowers this reading, not the next one (``agent.sampler``).
    extrapolated_j: float = 0.0


@runtime_checkable
class Sensor(Protocol):
    """A source of cumulative energy for one or more devices."""

    name: str

    def devices(self) -> Sequence[DeviceInfo]:
        """The devices this sensor measures (fixed for the sensor's lifetime)."""
        ...

    def read(self) -> list[EnergyReading]:
        """Cumulative energy of every device, now. Cheap: called on every tick."""
        ...

    def read_at(self, t_s: float) -> list[EnergyReading]:
        """Cumulative energy of every device as of ``t_s`` (a moment just past, ``t_s <= now``).

        Called at job boundaries, where attribution changes, so it should be as exact as the
        hardware allows (for NVML: wait for the counter's next update and correct by the instant
        power for the time since ``t_s``). Readings are stamped ``t_s``.
        """
        ...

    def close(self) -> None:
        """Release the hardware handle; idempotent."""
        ...
