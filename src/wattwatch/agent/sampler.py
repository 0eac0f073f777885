"""Turns cumulative sensor readings into intervals, closing one at every tick and every job boundary.

Sensors present cumulative joules per device (``sensors.base``); an interval is the difference of two
consecutive readings of one device, tagged with who held the device in between. Because a job's
start and end are read with ``Sensor.read_at`` (pinned to the counter's own update), a job's energy is
exact to the counter's resolution whatever the tick, and a job shorter than one tick still gets its
energy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import msgspec

from wattwatch.agent.restore import DeviceMark, no_limit
from wattwatch.protocol import wire
from wattwatch.sensors.base import DeviceInfo, EnergyReading, Sensor

log = logging.getLogger(__name__)

# (device, t_start_s, t_end_s) -> (shares, idle_weight) for the interval that is being closed.
SharesFn = Callable[[DeviceInfo, float, float], tuple[dict[str, float], float]]


# Readings remembered per device for ``marks_at`` (an interval held for weighing is released within a
# second or so; this covers ticks of 0.05 s).
MARK_HISTORY = 64

# Upper bounds of the sample-duration histogram (s): a tick read takes well under a millisecond per
# device, a boundary read waits for the NVML counter's next update (up to about 0.25 s).
SAMPLE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class SampleStats:
    """How long reading every sensor took (a histogram) and how many reads failed per sensor.

    The sampler's thread writes, the metrics scrape reads: a lock keeps a histogram's buckets, count and
    sum consistent with each other.
    """

    def __init__(self, sensor_names: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._in_bucket = [0] * len(SAMPLE_BUCKETS_S)  # not cumulative; index len(...) would be +Inf
        self._count = 0
        self._sum_s = 0.0
        # Every sensor from the start, so an alert on its error rate has a series before the first error.
        self._errors = dict.fromkeys(sensor_names, 0)

    def observe(self, duration_s: float, failed: Sequence[str]) -> None:
        """Record one sample that took ``duration_s`` and in which the sensors ``failed`` raised."""
        with self._lock:
            for i, bound_s in enumerate(SAMPLE_BUCKETS_S):
                if duration_s <= bound_s:
                    self._in_bucket[i] += 1
                    break
            self._count += 1
            self._sum_s += duration_s
            for name in failed:
                self._errors[name] = self._errors.get(name, 0) + 1

    def histogram(self) -> tuple[list[tuple[float, int]], int, float]:
        """(cumulative count per upper bound, count, sum in seconds); ``count`` is the +Inf bucket."""
        with self._lock:
            cumulative, running = [], 0
            for bound_s, n in zip(SAMPLE_BUCKETS_S, self._in_bucket, strict=True):
                running += n
                cumulative.append((bound_s, running))
            return cumulative, self._count, self._sum_s

    def errors(self) -> dict[str, int]:
        """Failed reads per sensor name since the start."""
        with self._lock:
            return dict(self._errors)


@dataclass
class _Last:
    t_s: float
    energy_j: float
    extrapolated_j: float = 0.0  # of energy_j, estimated past the hardware's count (EnergyReading)
    held: wire.Interval | None = None  # the interval ending here, kept until the next reading confirms it


class Sampler:
    """Reads every sensor and emits one ``wire.Interval`` per device since its previous reading.

    Not thread-safe on purpose: the agent drives it from a single worker thread, so readings are taken
    in event order. ``stats`` (duration and failures of every sample) may be read from any thread.
    """

    def __init__(self, sensors: Sequence[Sensor]) -> None:
        self.sensors = list(sensors)
        self._devices: dict[str, DeviceInfo] = {}
        self._max_gap_s: dict[str, float | None] = {}
        for sensor in self.sensors:
            # A wrapping counter (RAPL) is only unambiguous over gaps shorter than its poll limit.
            limit_s = getattr(sensor, "max_poll_interval_s", None)
            for dev in sensor.devices():
                self._devices[dev.key] = dev
                self._max_gap_s[dev.key] = no_limit(limit_s) if isinstance(limit_s, int | float) else None
        self._last: dict[str, _Last] = {}
        # Each device's recent readings, for the restart checkpoint; written by the sampling thread, read
        # by whichever thread hands intervals to the outbox (the share settler's, too).
        self._marks: dict[str, deque[DeviceMark]] = {}
        self._marks_lock = threading.Lock()
        self.last_t_s = 0.0
        self.stats = SampleStats([s.name for s in self.sensors])
        # The devices are fixed at construction: their wire form is built once (every staged tick and every
        # batch lists them).
        self._wire_devices = [
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

    @property
    def devices(self) -> Mapping[str, DeviceInfo]:
        """Every measured device, by key."""
        return self._devices

    def sample(self, shares: SharesFn, at_s: float | None = None, *, final: bool = False) -> list[wire.Interval]:
        """Read all sensors (exactly at ``at_s`` for a boundary, else now) and close the open intervals.

        ``shares`` says who held each device during the interval being closed; call it before applying
        the boundary's change to the job registry.

        An interval whose end reading is partly extrapolated (a tick read of an NVML counter adds the power
        since the counter's last refresh) is returned with the next sample instead, once the next reading
        confirms it: where the next one is a boundary read and comes in lower, the estimate overshot, and
        the held interval is lowered. Raising the next reading instead (the sensors' old monotonic clamp)
        moved the overshoot across a job boundary read right after the tick: +8 % on 1 s jobs at a 200 ms
        refresh
        (``benchmarks/timing_sweep.py``). A boundary read (``at_s``) and a ``final`` sample hold nothing.
        """
        readings: list[EnergyReading] = []
        failed: list[str] = []
        started_s = time.perf_counter()
        for sensor in self.sensors:
            try:
                # A boundary earlier than the last reading (two events racing) is moved onto it:
                # intervals never overlap and never run backwards.
                if at_s is not None:
                    readings.extend(sensor.read_at(max(at_s, self.last_t_s)))
                else:
                    readings.extend(sensor.read())
            except Exception:  # one broken sensor must not stop the others
                failed.append(sensor.name)
                log.exception("sensor %s failed to read; its devices get no interval this time", sensor.name)
        self.stats.observe(time.perf_counter() - started_s, failed)
        # One stamp per sample: identical interval bounds let the collector add a job's devices up tick by
        # tick (peak power over all its GPUs).
        stamp_s = max((r.t_s for r in readings), default=0.0)
        intervals: list[wire.Interval] = []
        read: set[str] = set()
        for reading in readings:
            last = self._last.get(reading.device)
            t_s = max(stamp_s, last.t_s if last else stamp_s)
            energy_j = reading.energy_j
            if last is not None and last.t_s < reading.t_s < t_s:
                # Read before the stamp (the NVML sensor may wait a few ms for one board's counter to refresh
                # before reading the next; a slow sensor after it): carried to the stamp at the power of the
                # interval it closes, else that much of its power would move across the tick.
                power_w = max(0.0, energy_j - last.energy_j) / (reading.t_s - last.t_s)
                energy_j += power_w * (t_s - reading.t_s)
            self.last_t_s = max(self.last_t_s, t_s)
            extrapolated_j = min(reading.extrapolated_j, max(0.0, energy_j))
            read.add(reading.device)
            if last is None:
                # A device's first reading starts its intervals at its own time: there is no power to carry
                # it to the stamp with yet. Not lowered later: a restart has already sent its gap up to it.
                self._last[reading.device] = _Last(reading.t_s, energy_j)
                self._remember(reading, reading.t_s, energy_j)
                continue
            if energy_j < last.energy_j and last.held is not None and at_s is not None:
                # Only a reading whose interval is still held can be lowered (one sent is final), and only by
                # a boundary read, pinned to the counter's refresh after it. A later tick read is an estimate
                # too, and one that extrapolates a power that has just dropped back over the time since the
                # refresh is the one that is wrong (-3 % on a vLLM server's J/query when it was trusted).
                self._lower(reading.device, last, max(energy_j, last.energy_j - last.extrapolated_j))
            if last.held is not None:
                intervals.append(last.held)
                last.held = None
            # Sensors promise monotonic energy; clamp anyway so one bad read can't make energy negative.
            energy_j = max(energy_j, last.energy_j)
            if t_s <= last.t_s and energy_j == last.energy_j:
                continue
            device = self._devices.get(reading.device)
            if device is None:
                continue
            self._remember(reading, t_s, energy_j)
            job_shares, idle_weight = shares(device, last.t_s, t_s)
            interval = wire.Interval(
                device=reading.device,
                t_start_s=last.t_s,
                t_end_s=t_s,
                energy_j=energy_j - last.energy_j,
                source=reading.source,
                shares=job_shares,
                idle_weight=idle_weight,
                flags=list(reading.flags),
            )
            extrapolated_j = min(extrapolated_j, interval.energy_j)
            hold = extrapolated_j > 0.0 and at_s is None and not final
            if not hold:
                intervals.append(interval)
            if hold:
                self._last[reading.device] = _Last(t_s, energy_j, extrapolated_j, interval)
            else:
                self._last[reading.device] = _Last(t_s, energy_j)
        # A device that gave no reading this time (a failed read, a lost GPU) releases what it held: it may
        # give none for long, and what is held is not in the restart checkpoint.
        intervals.extend(self.flush(keep=frozenset() if at_s is not None or final else frozenset(read)))
        return intervals

    @property
    def settled_t_s(self) -> float:
        """Up to when every device's intervals have been returned (a held one starts where they stop)."""
        held = [last.held.t_start_s for last in self._last.values() if last.held is not None]
        return min(held, default=self.last_t_s)

    def flush(self, keep: frozenset[str] = frozenset()) -> list[wire.Interval]:
        """The intervals still held (see ``sample``), as they are, but those of the devices in ``keep``;
        they are final from then on (a later reading cannot lower them)."""
        out: list[wire.Interval] = []
        for key, last in self._last.items():
            if last.held is not None and key not in keep:
                out.append(last.held)
                last.held = None
                last.extrapolated_j = 0.0
        return out

    def _lower(self, key: str, last: _Last, to_j: float) -> None:
        """Lower the reading ``last`` (and the interval held up to it) to ``to_j``: its extrapolation overshot."""
        cut_j = last.energy_j - to_j
        if last.held is not None:
            cut_j = min(cut_j, last.held.energy_j)
            last.held = msgspec.structs.replace(last.held, energy_j=last.held.energy_j - cut_j)
        last.energy_j -= cut_j
        last.extrapolated_j = max(0.0, last.extrapolated_j - cut_j)
        with self._marks_lock:
            history = self._marks.get(key)
            if history and history[-1].t_s == last.t_s:
                mark = history[-1]
                counter_j = None if mark.counter_j is None else mark.counter_j - cut_j
                history[-1] = replace(mark, energy_j=mark.energy_j - cut_j, counter_j=counter_j)

    def _remember(self, reading: EnergyReading, t_s: float, energy_j: float) -> None:
        device = self._devices.get(reading.device)
        counter_j = reading.counter_j
        if counter_j is not None:
            counter_j += energy_j - reading.energy_j  # the sampler's clamp, if any, on the counter's scale too
            if reading.counter_wrap_j > 0:
                counter_j %= reading.counter_wrap_j
        mark = DeviceMark(
            key=reading.device,
            t_s=t_s,
            energy_j=energy_j,
            source=reading.source,
            uuid=device.uuid if device else None,
            counter_j=counter_j,
            wrap_j=reading.counter_wrap_j,
            max_gap_s=self._max_gap_s.get(reading.device),
            power_limit_w=device.power_limit_w if device else None,
        )
        with self._marks_lock:
            self._marks.setdefault(reading.device, deque(maxlen=MARK_HISTORY)).append(mark)

    def marks(self) -> dict[str, DeviceMark]:
        """Every device's latest reading (where the next interval starts)."""
        with self._marks_lock:
            return {key: history[-1] for key, history in self._marks.items() if history}

    def marks_at(self, intervals: Iterable[wire.Interval]) -> dict[str, DeviceMark]:
        """Per device, the reading at the end of its latest interval in ``intervals`` (for the checkpoint
        that goes with them)."""
        ends: dict[str, float] = {}
        for iv in intervals:
            ends[iv.device] = max(ends.get(iv.device, iv.t_end_s), iv.t_end_s)
        out: dict[str, DeviceMark] = {}
        with self._marks_lock:
            for key, end_s in ends.items():
                for mark in reversed(self._marks.get(key, ())):
                    if mark.t_s == end_s:
                        out[key] = mark
                        break
        return out

    def wire_devices(self) -> list[wire.Device]:
        """The measured devices in wire form (a new list; the devices in it are shared, not to be changed)."""
        return list(self._wire_devices)
