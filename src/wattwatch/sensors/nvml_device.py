"""One GPU as the NVML sensor sees it: opening it, its state and learned timing, the NVML calls that read
it (counter reads timed, for the timing model and ``wattwatch doctor``), and the power integral of GPUs
without an energy counter."""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from wattwatch.errors import DeviceLost, NotSupported, SensorError
from wattwatch.protocol.units import Source, mj_to_j, mw_to_w
from wattwatch.sensors.base import DeviceInfo, EnergyReading
from wattwatch.sensors.nvml_errors import nvml_errors, translate_nvml_error
from wattwatch.sensors.nvml_grid import Change, CounterRead
from wattwatch.sensors.nvml_processes import SamplePeriod
from wattwatch.sensors.nvml_timing import CounterTiming

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuCapabilities:
    """What one GPU offers wattwatch (for ``wattwatch doctor``)."""

    key: str
    model: str | None
    uuid: str | None
    power_limit_w: float | None
    energy_counter: bool  # nvmlDeviceGetTotalEnergyConsumption works: the exact path
    power_instant: bool  # NVML_FI_DEV_POWER_INSTANT works: boundary corrections, power-only integration
    lost: bool


@dataclass(frozen=True)
class GpuTiming:
    """What the sensor has learned about one GPU's timing (for ``wattwatch doctor``); None: not learned."""

    key: str
    energy_counter: bool
    refresh_period_s: float | None
    refresh_period_err_s: float | None  # worst-case error of refresh_period_s
    refreshes_seen: int  # counter refreshes bracketed by polling so far
    phase_window_s: float | None  # width of the window the next refresh is predicted in
    phase_trusted: bool  # narrow and recent enough to extrapolate tick reads from
    refresh_why_not: str  # why the period is not learned ("" when it is)
    instant_power: str  # "live", "held" (refreshes with the counter), "unknown" or "none"
    process_sample_period_s: float | None
    process_stamps_seen: int
    call_latency_s: tuple[float, float, int] | None  # median, p95, calls (counter and power reads)


class Latency:
    """Durations of recent NVML calls (bounded), for ``wattwatch doctor``."""

    def __init__(self, keep: int = 512) -> None:
        self._seconds: deque[float] = deque(maxlen=keep)

    def add(self, seconds: float) -> None:
        """Record one call's duration."""
        self._seconds.append(seconds if seconds > 0.0 else 0.0)

    def summary(self) -> tuple[float, float, int] | None:
        """(median, 95th percentile, calls) in seconds; None before any call."""
        if not self._seconds:
            return None
        ordered = sorted(self._seconds)
        return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], len(ordered)


@dataclass
class GpuDevice:
    """A measured GPU: its handle, what it supports, its counter bookkeeping and its learned timing."""

    info: DeviceInfo
    handle: Any
    has_counter: bool
    has_instant: bool
    # Counter devices: cumulative_j = base_j + raw_mj / 1000; base_j absorbs counter resets.
    raw_mj: int | None = None
    raw_t_s: float = 0.0
    last_read: CounterRead | None = None  # the last tick read (to check it against the phase)
    base_j: float = 0.0
    # Power-only devices: trapezoid integral of sampled power, and recent (t_s, energy_j) for read_at.
    power_t_s: float | None = None
    power_w: float = 0.0
    integral_j: float = 0.0
    history: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=256))
    # Never return less than this (monotonic promise): the counter-backed part of what was returned, so an
    # extrapolated tick read that overshot can be corrected by the next reading (``EnergyReading``).
    returned_j: float = 0.0
    # Seen the power reading change between two counter refreshes: it is live. Seen it change only with
    # the counter: it is held (a part-time sample or an average, refreshed with the counter).
    instant_live: bool = False
    instant_held: bool = False
    pending_flags: set[str] = field(default_factory=set)
    # The last short poll (``NvmlSensor.read``) saw no refresh: it came too late for it (``_poll_too_late``).
    short_poll_missed: bool = False
    timing: CounterTiming = field(default_factory=CounterTiming)
    process_samples: SamplePeriod = field(default_factory=SamplePeriod)
    latency: Latency = field(default_factory=Latency)
    # ``gpu0``, ``gpu1``... (``info.key``: a plain attribute, looked up several times per GPU every tick).
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = self.info.key

    @property
    def cumulative_j(self) -> float:
        """Energy since the counter's origin, resets bridged."""
        return self.base_j + mj_to_j(self.raw_mj or 0)

    def describe_timing(self, now_s: float) -> GpuTiming:
        """What has been learned about this GPU's timing, as of ``now_s``."""
        t = self.timing
        fit = t.fit
        why = "no energy counter" if not self.has_counter else "" if t.period_s is not None else t.why_not
        if not self.has_instant:
            instant = "none"
        else:
            instant = "live" if self.instant_live else "held" if self.instant_held else "unknown"
        return GpuTiming(
            key=self.key,
            energy_counter=self.has_counter,
            refresh_period_s=t.period_s,
            refresh_period_err_s=None if fit is None else fit.period_err_s,
            refreshes_seen=t.refreshes_seen,
            phase_window_s=t.window_s(now_s),
            phase_trusted=t.trusted(now_s),
            refresh_why_not=why,
            instant_power=instant,
            process_sample_period_s=self.process_samples.period_s,
            process_stamps_seen=self.process_samples.stamps_seen,
            call_latency_s=self.latency.summary(),
        )


class NvmlReads:
    """The NVML calls that read a GPU's energy and power, errors translated, counter reads timed."""

    def __init__(self, nvml: Any, clock: Callable[[], float]) -> None:
        self.nvml = nvml
        self.clock = clock

    def counter(self, dev: GpuDevice) -> CounterRead:
        """``nvmlDeviceGetTotalEnergyConsumption`` with the clock before and after the call."""
        # The hottest call of the agent (every tick, every poll): errors are caught inline, and the
        # message built only when one happens.
        nvml = self.nvml
        start_s = self.clock()
        try:
            raw_mj = int(nvml.nvmlDeviceGetTotalEnergyConsumption(dev.handle))
        except nvml.NVMLError as exc:
            raise translate_nvml_error(nvml, exc, f"reading {dev.key}'s energy counter") from exc
        end_s = self.clock()
        dev.latency.add(end_s - start_s)
        return CounterRead(raw_mj, start_s, end_s)

    def counter_mj(self, dev: GpuDevice) -> int:
        """The counter's value in mJ."""
        return self.counter(dev).raw_mj

    def instant_power_w(self, dev: GpuDevice) -> float:
        """``NVML_FI_DEV_POWER_INSTANT`` in W."""
        nvml = self.nvml
        start_s = self.clock()
        try:
            value = nvml.nvmlDeviceGetFieldValues(dev.handle, [nvml.NVML_FI_DEV_POWER_INSTANT])[0]
        except nvml.NVMLError as exc:
            raise translate_nvml_error(nvml, exc, f"reading {dev.key}'s instant power") from exc
        dev.latency.add(self.clock() - start_s)
        if value.nvmlReturn != nvml.NVML_SUCCESS:
            raise translate_nvml_error(nvml, nvml.NVMLError(value.nvmlReturn), f"reading {dev.key}'s instant power")
        return mw_to_w(value.value.uiVal)

    def average_power_w(self, dev: GpuDevice) -> float:
        """``nvmlDeviceGetPowerUsage`` in W (an average over the board's window)."""
        start_s = self.clock()
        with nvml_errors(self.nvml, f"reading {dev.key}'s power"):
            power_mw = self.nvml.nvmlDeviceGetPowerUsage(dev.handle)
        dev.latency.add(self.clock() - start_s)
        return mw_to_w(power_mw)

    def power_w(self, dev: GpuDevice) -> float:
        """Instant power when the GPU offers it, else the average."""
        return self.instant_power_w(dev) if dev.has_instant else self.average_power_w(dev)

    def timed_power_w(self, dev: GpuDevice) -> tuple[float, float]:
        """(power_w, the middle of the call): the instant the reading is taken as of."""
        start_s = self.clock()
        power_w = self.power_w(dev)
        return power_w, (start_s + self.clock()) / 2.0

    def observe(self, dev: GpuDevice, raw_mj: int, t_s: float) -> None:
        """Take a counter value; a counter that went down was reset (driver reload), never wrapped."""
        if dev.raw_mj is not None and raw_mj < dev.raw_mj:
            # What the GPU drew between our last read and now is unknowable from the counter: bridge it
            # with the average power (the best estimate over a tick-long gap), then follow the new one.
            try:
                power_w = self.average_power_w(dev)
            except NotSupported:
                power_w = self.instant_power_w(dev)
            bridged_j = power_w * max(0.0, t_s - dev.raw_t_s)
            dev.base_j = dev.cumulative_j + bridged_j - mj_to_j(raw_mj)
            dev.pending_flags.add("counter_reset")
            log.warning(
                "%s: energy counter went from %d mJ to %d mJ (driver reload?); bridged %.1f J from power",
                dev.key,
                dev.raw_mj,
                raw_mj,
                bridged_j,
            )
        dev.raw_mj, dev.raw_t_s = raw_mj, t_s

    def sample_power(self, dev: GpuDevice) -> None:
        """Trapezoid step of a power-only device's integral up to now."""
        power_w = self.power_w(dev)
        t_s = self.clock()
        if dev.power_t_s is not None and t_s > dev.power_t_s:
            dev.integral_j += (power_w + dev.power_w) / 2.0 * (t_s - dev.power_t_s)
        if dev.power_t_s is None or t_s >= dev.power_t_s:
            dev.power_t_s, dev.power_w = t_s, power_w
            dev.history.append((t_s, dev.integral_j))
        if not dev.has_instant:
            dev.pending_flags.add("power_averaged")


def tick_read(reads: NvmlReads, dev: GpuDevice, sleep: Callable[[float], None]) -> tuple[float, float, float]:
    """(t_s, E(t_s), the extrapolated part of it) for a tick read of a counter GPU (see
    ``NvmlSensor.read``): the counter as of its last refresh, plus the instant power over the time since,
    where the learned phase places it."""
    before = dev.last_read
    timing = dev.timing
    if dev.has_instant and before is not None:
        # Planned before reading: when the phase puts a refresh inside the read (its last one's length
        # ahead) or just after it, wait past that refresh first, then read once (reading first and again
        # after the wait costs a counter read per GPU near a refresh, every tick).
        now_s = reads.clock()
        wait_s = timing.trusted_wait_s(now_s, now_s, now_s + max(0.0, before.end_s - before.start_s))
        if wait_s is not None and wait_s > 0.0:
            sleep(wait_s)
    read = reads.counter(dev)
    # None: the phase is not trusted as of the read (no extrapolation); else how long to wait past a
    # refresh the read may straddle (or be just before).
    wait_s = timing.trusted_wait_s(read.end_s, read.start_s, read.end_s) if dev.has_instant else None
    if wait_s is None:
        dev.last_read = read
        reads.observe(dev, read.raw_mj, read.end_s)
        return read.end_s, dev.cumulative_j, 0.0
    rereads = 0
    while wait_s > 0.0:
        # Read again past that refresh; if the value moved in between, that brackets the refresh, so
        # learn from it. At most three times.
        sleep(wait_s)
        first, read = read, reads.counter(dev)
        if read.raw_mj > first.raw_mj:
            timing.add(Change.between(first, read), timing.new_run())
        rereads += 1
        if rereads == 3:
            break
        wait_s = timing.wait_before_read_s(read.start_s, read.end_s)
    power_w = reads.instant_power_w(dev)
    dev.last_read = read
    since_s = timing.tick_since_s(before, read)  # trusted: the grid is there
    if since_s is None:
        log.debug("%s: the counter's refresh phase no longer fits its reads; relearning it", dev.key)
        timing.drop_phase("the counter's refreshes stopped fitting the learned phase; relearning")
        reads.observe(dev, read.raw_mj, read.end_s)
        return read.end_s, dev.cumulative_j, 0.0
    reads.observe(dev, read.raw_mj, read.end_s)
    return read.end_s, dev.cumulative_j + power_w * since_s, power_w * since_s


def emit(
    dev: GpuDevice, t_s: float, energy_j: float, source: Source, flags: tuple[str, ...], extrapolated_j: float = 0.0
) -> EnergyReading:
    """The reading of ``dev`` at ``t_s``, with the flags gathered since: never below the counter-backed
    part of one returned before; ``extrapolated_j`` of it is estimated past the counter (see
    ``EnergyReading``)."""
    value_j = max(energy_j, dev.returned_j)
    extrapolated_j = min(max(0.0, extrapolated_j), value_j - dev.returned_j)
    dev.returned_j = value_j - extrapolated_j
    all_flags: tuple[str, ...] = ()
    if dev.pending_flags or flags:  # rare: most readings carry no flag
        all_flags = tuple(sorted(dev.pending_flags.union(flags)))
        dev.pending_flags.clear()
    # On the counter's own scale (since driver load): base_j only holds what resets added.
    counter_j = value_j - dev.base_j if dev.has_counter else None
    return EnergyReading(
        device=dev.key,
        t_s=t_s,
        energy_j=value_j,
        source=source,
        flags=all_flags,
        counter_j=counter_j,
        extrapolated_j=extrapolated_j,
    )


def integral_at(dev: GpuDevice, t_s: float) -> tuple[float, tuple[str, ...]]:
    """A power-only device's integral at ``t_s``, interpolated between the samples around it (the
    integrator samples at >= 10 Hz); flagged ``boundary_unrefined`` when ``t_s`` is older than them all."""
    hist = list(dev.history)
    for (t0, e0), (t1, e1) in pairwise(hist):
        if t0 <= t_s <= t1:
            return (e0 + (e1 - e0) * (t_s - t0) / (t1 - t0) if t1 > t0 else e1), ()
    if hist and t_s >= hist[-1][0]:
        return hist[-1][1], ()
    return (hist[0][1] if hist else dev.integral_j), ("boundary_unrefined",)


def open_device(reads: NvmlReads, i: int) -> GpuDevice:
    """Open GPU ``i`` and find out what it supports; a lost GPU raises DeviceLost, any other failure of
    an optional reading just means it is not used."""
    nvml = reads.nvml
    with nvml_errors(nvml, f"opening GPU {i}"):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        index = int(nvml.nvmlDeviceGetIndex(handle))
        model = text(nvml.nvmlDeviceGetName(handle))
        uuid = text(nvml.nvmlDeviceGetUUID(handle))
    limit_w: float | None = None
    for getter in ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit"):
        try:
            with nvml_errors(nvml, f"reading gpu{index}'s power limit"):
                limit_w = mw_to_w(getattr(nvml, getter)(handle))
            break
        except NotSupported:
            continue
    info = DeviceInfo(key=f"gpu{index}", kind="gpu", index=index, uuid=uuid, model=model, power_limit_w=limit_w)
    dev = GpuDevice(info=info, handle=handle, has_counter=True, has_instant=True)
    try:
        reads.instant_power_w(dev)
    except DeviceLost:
        raise
    except SensorError as exc:
        dev.has_instant = False
        log.debug("%s: no instant power (%s)", info.key, exc)
    try:
        read = reads.counter(dev)
        dev.raw_mj, dev.raw_t_s = read.raw_mj, read.end_s
    except DeviceLost:
        raise
    except SensorError:
        dev.has_counter = False
        how = "instant power" if dev.has_instant else "the 1 s average power (no instant power either)"
        log.info("%s has no energy counter (pre-Volta?); integrating %s at >= 10 Hz", info.key, how)
    return dev


def text(value: Any) -> str:
    """NVML strings are ``bytes`` in old bindings and ``str`` in new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)
