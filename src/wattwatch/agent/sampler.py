"""Turns cumulative sensor readings into intervals, closing one at every tick and every job boundary.

Sensors present cumulative joules per device (``sensors.base``); an interval is the difference of two
consecutive readings of one device, tagged with who held the device in between. Because a job's
start and end are read with ``Sensor.read_at`` (pinned to the counter's own update), a job's energy is
exact to the counter's resolution whatever the tick, and a job shorter than one tick still gets its
energy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from wattwatch import wire
from wattwatch.sensors.base import DeviceInfo, EnergyReading, Sensor

log = logging.getLogger(__name__)

# (device, t_start_s, t_end_s) -> (shares, idle_weight) for the interval that is being closed.
SharesFn = Callable[[DeviceInfo, float, float], tuple[dict[str, float], float]]


@dataclass
class _Last:
    t_s: float
    energy_j: float


class Sampler:
    """Reads every sensor and emits one ``wire.Interval`` per device since its previous reading.

    Not thread-safe on purpose: the agent drives it from a single worker thread, so readings are taken
    in event order.
    """

    def __init__(self, sensors: Sequence[Sensor]) -> None:
        self.sensors = list(sensors)
        self._devices: dict[str, DeviceInfo] = {}
        for sensor in self.sensors:
            for dev in sensor.devices():
                self._devices[dev.key] = dev
        self._last: dict[str, _Last] = {}
        self.last_t_s = 0.0

    @property
    def devices(self) -> Mapping[str, DeviceInfo]:
        """Every measured device, by key."""
        return self._devices

    def sample(self, shares: SharesFn, at_s: float | None = None) -> list[wire.Interval]:
        """Read all sensors (exactly at ``at_s`` for a boundary, else now) and close the open intervals.

        ``shares`` says who held each device during the interval being closed; call it before applying
        the boundary's change to the job registry.
        """
        readings: list[EnergyReading] = []
        for sensor in self.sensors:
            try:
                # A boundary earlier than the last reading (two events racing) is moved onto it:
                # intervals never overlap and never run backwards.
                if at_s is not None:
                    readings.extend(sensor.read_at(max(at_s, self.last_t_s)))
                else:
                    readings.extend(sensor.read())
            except Exception:  # one broken sensor must not stop the others
                log.exception("sensor %s failed to read; its devices get no interval this time", sensor.name)
        # One stamp per sample: the sensors were read microseconds apart, and identical interval bounds
        # let the collector add a job's devices up tick by tick (peak power over all its GPUs).
        stamp_s = max((r.t_s for r in readings), default=0.0)
        intervals: list[wire.Interval] = []
        for reading in readings:
            last = self._last.get(reading.device)
            t_s = max(stamp_s, last.t_s if last else stamp_s)
            energy_j = reading.energy_j
            self.last_t_s = max(self.last_t_s, t_s)
            if last is None:
                self._last[reading.device] = _Last(t_s, energy_j)
                continue
            # Sensors promise monotonic energy; clamp anyway so one bad read can't make energy negative.
            energy_j = max(energy_j, last.energy_j)
            if t_s <= last.t_s and energy_j == last.energy_j:
                continue
            device = self._devices.get(reading.device)
            if device is None:
                continue
            job_shares, idle_weight = shares(device, last.t_s, t_s)
            intervals.append(
                wire.Interval(
                    device=reading.device,
                    t_start_s=last.t_s,
                    t_end_s=t_s,
                    energy_j=energy_j - last.energy_j,
                    source=reading.source,
                    shares=job_shares,
                    idle_weight=idle_weight,
                    flags=list(reading.flags),
                )
            )
            self._last[reading.device] = _Last(t_s, energy_j)
        return intervals

    def wire_devices(self) -> list[wire.Device]:
        """The measured devices in wire form."""
        return [
            wire.Device(
                key=d.key,
                kind=d.kind,
                index=d.index,
                uuid=d.uuid,
                model=d.model,
                power_limit_w=d.power_limit_w,
            )
            for d in self._devices.values()
        ]
