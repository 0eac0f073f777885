"""NVIDIA GPUs through NVML: cumulative joules from the energy counter, boundary reads pinned to its updates.

``nvmlDeviceGetTotalEnergyConsumption`` (mJ since driver load, Volta and newer) is the source of truth.
It only refreshes every ~100 ms, so a boundary read (``read_at``) polls until the counter moves and
subtracts the energy drawn between the boundary and that update, estimated from the power sampled
while polling (``nvml_boundary``: integrated when the instant power is live, split as a step when the
reading only changes with the counter, as on part-time-sampled boards). Devices without the counter
are integrated from ``NVML_FI_DEV_POWER_INSTANT`` by a background thread. Tick reads (``read``) add
the energy since the counter's last update, from the instant power and the update phase learned from
the counter changes that polling sees (a calibration poll at start, every boundary read). NVML's errors are
translated once, in ``nvml_errors``; ``CUDA_VISIBLE_DEVICES`` is resolved in ``visible``.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from wattwatch.errors import DeviceLost, DeviceNotFound, NotSupported, SensorError
from wattwatch.sensors.base import DeviceInfo, EnergyReading
from wattwatch.sensors.nvml_boundary import BoundaryProbe, pin_boundary
from wattwatch.sensors.nvml_errors import NO_DRIVER, NO_DRIVER_FIX, nvml_errors, translate_nvml_error
from wattwatch.sensors.visible import resolve_visible
from wattwatch.units import Source, mj_to_j, mw_to_w

__all__ = [
    "NO_DRIVER",
    "NO_DRIVER_FIX",
    "POWER_SAMPLE_INTERVAL_S",
    "PROCESS_SAMPLE_PERIOD_S",
    "GpuCapabilities",
    "NvmlSensor",
    "jittered_interval_s",
    "nvml_errors",
    "resolve_visible",
    "translate_nvml_error",
]

log = logging.getLogger(__name__)

# Integrator pace for GPUs without an energy counter (see NvmlSensor).
POWER_SAMPLE_INTERVAL_S = 0.01
# NVML samples per-process utilisation about six times a second.
PROCESS_SAMPLE_PERIOD_S = 1.0 / 6.0
# Learning each counter's update phase (see NvmlSensor.read): the longest calibration poll, the slack
# added around an observed change (NVML call latency, per-device order in a poll loop), the widest
# phase bracket trusted, and how long a phase is trusted without a fresh observation of an update.
PHASE_CALIBRATION_S = 0.25
PHASE_SLACK_S = 0.0005
PHASE_MAX_WIDTH_S = 0.01
PHASE_MAX_AGE_S = 60.0


def jittered_interval_s(mean_s: float, rng: random.Random) -> float:
    """The wait before the integrator's next power sample: uniform in [0.5, 1.5] x ``mean_s``.

    A fixed pace locks onto loads that repeat at a multiple of it (10 ms samples see a 50 ms square
    wave at the same five phases forever, +7 % on the accuracy benchmark); a random pace samples every
    phase, so the integral has no bias, only noise that averages out (+0.6 % on the same trace).
    """
    return mean_s * (0.5 + rng.random())


# -- the sensor -------------------------------------------------------------------------------------


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


@dataclass
class _Device:
    info: DeviceInfo
    handle: Any
    has_counter: bool
    has_instant: bool
    # Counter devices: cumulative_j = base_j + raw_mj / 1000; base_j absorbs counter resets.
    raw_mj: int | None = None
    raw_t_s: float = 0.0
    base_j: float = 0.0
    # Power-only devices: trapezoid integral of sampled power, and recent (t_s, energy_j) for read_at.
    power_t_s: float | None = None
    power_w: float = 0.0
    integral_j: float = 0.0
    history: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=256))
    returned_j: float = 0.0  # never return less than this (monotonic promise)
    # Seen the power reading change between two counter updates: it is live. Seen it change only with
    # the counter: it is held (a part-time sample or an average, refreshed with the counter).
    instant_live: bool = False
    instant_held: bool = False
    pending_flags: set[str] = field(default_factory=set)
    # The counter's update phase: one update instant lies in (phase_lo, phase_hi], the others on the
    # update-period grid through it. None: not known (calibrate). phase_seen_s: when last confirmed.
    phase_lo: float | None = None
    phase_hi: float = 0.0
    phase_seen_s: float = -math.inf
    phase_tried_s: float = -math.inf  # last calibration attempt (a failed one is not retried at once)

    @property
    def cumulative_j(self) -> float:
        return self.base_j + mj_to_j(self.raw_mj or 0)


class NvmlSensor:
    """Every NVIDIA GPU on the host, through NVML (``pynvml`` from nvidia-ml-py, or a fake of it).

    ``visible`` (a CUDA_VISIBLE_DEVICES-style string) restricts the devices; the agent leaves it unset
    and measures all GPUs. ``clock`` and ``sleep`` are injectable so tests run on simulated time. A GPU
    that cannot be opened is left out (``unopened`` says why) unless none can, which raises.
    ``power_sample_interval_s`` paces the integrator of GPUs without an energy counter: 10 ms on
    average, randomly jittered (``jittered_interval_s``), because a slower or fixed pace aliases with
    loads that repeat near it (a 20 Hz sampler reads a 50 ms square wave at the same phase every time).
    """

    name = "nvml"

    def __init__(
        self,
        nvml: Any | None = None,
        *,
        visible: str | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        update_period_s: float = 0.1,
        poll_interval_s: float = 0.002,
        power_sample_interval_s: float | None = POWER_SAMPLE_INTERVAL_S,
    ) -> None:
        if nvml is None:
            try:
                import pynvml
            except ImportError:
                raise DeviceNotFound(
                    f"{NO_DRIVER}: the nvidia-ml-py package (module pynvml) is not installed; "
                    "pip install nvidia-ml-py, or try --simulate N"
                ) from None
            nvml = pynvml
        self._nvml = nvml
        self._clock = clock
        self._sleep = sleep
        self.update_period_s = update_period_s
        self.poll_interval_s = poll_interval_s
        self.simulated = bool(getattr(nvml, "WATTWATCH_SIMULATED", False))
        self._lock = threading.RLock()
        self._lost: set[str] = set()
        self._warned: set[str] = set()
        self.unopened: dict[int, str] = {}  # NVML index -> why it is not measured
        self._closed = False
        with nvml_errors(nvml, "initialising NVML"):
            nvml.nvmlInit()
        try:
            devices = self._enumerate()
            if visible is not None:
                keep = set(resolve_visible(visible, [d.info for d in devices]))
                devices = [d for d in devices if d.info.key in keep]
        except BaseException:
            self._shutdown()
            raise
        self._devices = {d.info.key: d for d in devices}
        self._calibrate([d for d in devices if d.has_counter and d.has_instant])
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if power_sample_interval_s is not None and any(not d.has_counter for d in devices):
            self._thread = threading.Thread(
                target=self._integrate_loop, args=(power_sample_interval_s,), name="wattwatch-nvml-power", daemon=True
            )
            self._thread.start()

    # -- setup --------------------------------------------------------------------------------------

    def _enumerate(self) -> list[_Device]:
        nvml = self._nvml
        with nvml_errors(nvml, "counting GPUs"):
            count = int(nvml.nvmlDeviceGetCount())
        devices: list[_Device] = []
        errors: list[SensorError] = []
        for i in range(count):
            try:
                devices.append(self._probe(i))
            except SensorError as exc:
                # One broken GPU must not cost the others their measurements.
                log.warning("gpu%d is not measured: %s", i, exc)
                self.unopened[i] = str(exc)
                errors.append(exc)
        if errors and not devices:
            raise errors[0]
        return devices

    def _probe(self, i: int) -> _Device:
        nvml = self._nvml
        with nvml_errors(nvml, f"opening GPU {i}"):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            index = int(nvml.nvmlDeviceGetIndex(handle))
            model = _text(nvml.nvmlDeviceGetName(handle))
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        limit_w: float | None = None
        for getter in ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit"):
            try:
                with nvml_errors(nvml, f"reading gpu{index}'s power limit"):
                    limit_w = mw_to_w(getattr(nvml, getter)(handle))
                break
            except NotSupported:
                continue
        info = DeviceInfo(key=f"gpu{index}", kind="gpu", index=index, uuid=uuid, model=model, power_limit_w=limit_w)
        dev = _Device(info=info, handle=handle, has_counter=True, has_instant=True)
        # Anything but a lost GPU just means "not this reading": measure with what works.
        try:
            self._instant_power_w(dev)
        except DeviceLost:
            raise
        except SensorError as exc:
            dev.has_instant = False
            log.debug("%s: no instant power (%s)", info.key, exc)
        try:
            dev.raw_mj = self._counter_mj(dev)
            dev.raw_t_s = self._clock()
        except DeviceLost:
            raise
        except SensorError:
            dev.has_counter = False
            how = "instant power" if dev.has_instant else "the 1 s average power (no instant power either)"
            log.info("%s has no energy counter (pre-Volta?); integrating %s at >= 10 Hz", info.key, how)
        return dev

    # -- NVML reads ---------------------------------------------------------------------------------

    def _counter_mj(self, dev: _Device) -> int:
        with nvml_errors(self._nvml, f"reading {dev.info.key}'s energy counter"):
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(dev.handle))

    def _instant_power_w(self, dev: _Device) -> float:
        nvml = self._nvml
        with nvml_errors(nvml, f"reading {dev.info.key}'s instant power"):
            value = nvml.nvmlDeviceGetFieldValues(dev.handle, [nvml.NVML_FI_DEV_POWER_INSTANT])[0]
        if value.nvmlReturn != nvml.NVML_SUCCESS:
            raise translate_nvml_error(
                nvml, nvml.NVMLError(value.nvmlReturn), f"reading {dev.info.key}'s instant power"
            )
        return mw_to_w(value.value.uiVal)

    def _average_power_w(self, dev: _Device) -> float:
        with nvml_errors(self._nvml, f"reading {dev.info.key}'s power"):
            return mw_to_w(self._nvml.nvmlDeviceGetPowerUsage(dev.handle))

    def _power_w(self, dev: _Device) -> float:
        """Instant power when the GPU offers it, else the 1 s average."""
        return self._instant_power_w(dev) if dev.has_instant else self._average_power_w(dev)

    # -- bookkeeping --------------------------------------------------------------------------------

    def _observe(self, dev: _Device, raw_mj: int, t_s: float) -> None:
        """Take a counter value; a counter that went down was reset (driver reload), never wrapped."""
        if dev.raw_mj is not None and raw_mj < dev.raw_mj:
            # What the GPU drew between our last read and now is unknowable from the counter: bridge it
            # with the 1 s average power (the best estimate over a tick-long gap), then follow the new one.
            try:
                power_w = self._average_power_w(dev)
            except NotSupported:
                power_w = self._instant_power_w(dev)
            bridged_j = power_w * max(0.0, t_s - dev.raw_t_s)
            dev.base_j = dev.cumulative_j + bridged_j - mj_to_j(raw_mj)
            dev.pending_flags.add("counter_reset")
            log.warning(
                "%s: energy counter went from %d mJ to %d mJ (driver reload?); bridged %.1f J from power",
                dev.info.key,
                dev.raw_mj,
                raw_mj,
                bridged_j,
            )
        dev.raw_mj, dev.raw_t_s = raw_mj, t_s

    def _sample_power(self, dev: _Device) -> None:
        """Trapezoid step of a power-only device's integral up to now."""
        power_w = self._power_w(dev)
        t_s = self._clock()
        if dev.power_t_s is not None and t_s > dev.power_t_s:
            dev.integral_j += (power_w + dev.power_w) / 2.0 * (t_s - dev.power_t_s)
        if dev.power_t_s is None or t_s >= dev.power_t_s:
            dev.power_t_s, dev.power_w = t_s, power_w
            dev.history.append((t_s, dev.integral_j))
        if not dev.has_instant:
            dev.pending_flags.add("power_averaged")

    def _emit(self, dev: _Device, t_s: float, energy_j: float, *flags: str) -> EnergyReading:
        value_j = max(energy_j, dev.returned_j)
        dev.returned_j = value_j
        all_flags = tuple(sorted(dev.pending_flags.union(flags)))
        dev.pending_flags.clear()
        # On the counter's own scale (since driver load): base_j only holds what resets added.
        counter_j = value_j - dev.base_j if dev.has_counter else None
        return EnergyReading(
            device=dev.info.key,
            t_s=t_s,
            energy_j=value_j,
            source=self._source(dev),
            flags=all_flags,
            counter_j=counter_j,
        )

    def _source(self, dev: _Device) -> Source:
        if self.simulated:
            return "simulated"
        return "counter" if dev.has_counter else "power"

    def _live(self) -> list[_Device]:
        return [d for k, d in self._devices.items() if k not in self._lost]

    def _mark_lost(self, dev: _Device, exc: DeviceLost) -> None:
        if dev.info.key not in self._lost:
            self._lost.add(dev.info.key)
            log.error(
                "%s (%s) is lost and no longer measured; the other GPUs are: %s", dev.info.key, dev.info.uuid, exc
            )

    def _warn_once(self, dev: _Device, exc: SensorError) -> None:
        text = f"{dev.info.key}: {exc}"
        if text not in self._warned:
            self._warned.add(text)
            log.warning("%s (skipping this reading)", text)

    # -- Sensor protocol ----------------------------------------------------------------------------

    def devices(self) -> Sequence[DeviceInfo]:
        """The GPUs measured (fixed at construction; a lost GPU stays listed but yields no readings)."""
        return [d.info for d in self._devices.values()]

    @property
    def lost(self) -> frozenset[str]:
        """Keys of GPUs that fell off the bus since the sensor started."""
        return frozenset(self._lost)

    def driver_version(self) -> str | None:
        """The NVIDIA driver version NVML reports (None when it cannot say)."""
        try:
            with nvml_errors(self._nvml, "reading the driver version"):
                return _text(self._nvml.nvmlSystemGetDriverVersion())
        except SensorError:
            return None

    def capabilities(self) -> list[GpuCapabilities]:
        """Per measured GPU: model, UUID, power limit, and whether the energy counter and POWER_INSTANT work."""
        return [
            GpuCapabilities(
                key=d.info.key,
                model=d.info.model,
                uuid=d.info.uuid,
                power_limit_w=d.info.power_limit_w,
                energy_counter=d.has_counter,
                power_instant=d.has_instant,
                lost=d.info.key in self._lost,
            )
            for d in self._devices.values()
        ]

    def read(self) -> list[EnergyReading]:
        """Cumulative J per live GPU, now (each reading stamped when it was taken).

        The counter only refreshes every update period, so its value is as of its last update ``t_u``,
        up to 100 ms before the read. Where the counter's update phase is known (learned by a short
        calibration poll at start and from every change that ``read_at``'s polling sees) and instant
        power answers, the read adds what was drawn since: ``E(t_u) + P_instant x (now - t_u)``; a
        read too close to a predicted update to tell which side of it the counter is waits until past
        it (a few ms). A read that contradicts the phase drops it (recalibrated at the next read);
        without it, or without instant power, the counter's value is returned as of the read. On
        part-time boards the instant reading is held (the sampled end of the last period): it still
        extrapolates the gap better than leaving it out (median interval error 0.5 % vs 1.9 %).
        """
        out: list[EnergyReading] = []
        with self._lock:
            now_s = self._clock()
            self._calibrate(
                [
                    d
                    for d in self._live()
                    if d.has_counter
                    and d.has_instant
                    and not self._phase_trusted(d, now_s)
                    and now_s - d.phase_tried_s >= PHASE_MAX_AGE_S
                ]
            )
            for dev in self._live():
                try:
                    if dev.has_counter:
                        t_s, energy_j = self._tick_counter(dev)
                        out.append(self._emit(dev, t_s, energy_j))
                    else:
                        self._sample_power(dev)
                        assert dev.power_t_s is not None
                        out.append(self._emit(dev, dev.power_t_s, dev.integral_j))
                except DeviceLost as exc:
                    self._mark_lost(dev, exc)
                except SensorError as exc:
                    self._warn_once(dev, exc)
        return out

    def _tick_counter(self, dev: _Device) -> tuple[float, float]:
        """(t_s, E(t_s)) for a tick read of a counter device (see ``read``)."""
        prev_raw, prev_t_s = dev.raw_mj, dev.raw_t_s
        raw_mj = self._counter_mj(dev)
        t_s = self._clock()
        if not (dev.has_instant and self._phase_trusted(dev, t_s)):
            self._observe(dev, raw_mj, t_s)
            return t_s, dev.cumulative_j
        wait_s = self._ambiguous_for(dev, t_s)
        if wait_s > 0.0:
            # Too close to an update to tell whether the counter has it: read again once past it.
            self._sleep(wait_s)
            raw_mj = self._counter_mj(dev)
            t_s = self._clock()
        power_w = self._instant_power_w(dev)
        if prev_raw is not None and not self._phase_consistent(dev, raw_mj != prev_raw, prev_t_s, t_s):
            log.debug("%s: the counter's update phase no longer fits its reads; relearning it", dev.info.key)
            dev.phase_lo, dev.phase_tried_s = None, -math.inf
            self._observe(dev, raw_mj, t_s)
            return t_s, dev.cumulative_j
        self._observe(dev, raw_mj, t_s)
        t_u = self._last_update_s(dev, t_s)
        since_s = min(max(0.0, t_s - t_u), self.update_period_s)
        return t_s, dev.cumulative_j + power_w * since_s

    # -- the counter's update phase -------------------------------------------------------------------

    def _phase_trusted(self, dev: _Device, now_s: float) -> bool:
        return (
            dev.phase_lo is not None
            and dev.phase_hi - dev.phase_lo <= PHASE_MAX_WIDTH_S
            and now_s - dev.phase_seen_s < PHASE_MAX_AGE_S
        )

    def _learn_phase(self, dev: _Device, after_s: float, at_s: float) -> None:
        """The counter changed between a read at ``after_s`` and one at ``at_s``: narrow the phase
        bracket with it, or start again from it when it contradicts the bracket (drift, a new period)."""
        if at_s - after_s > PHASE_MAX_WIDTH_S:
            return  # too coarse to teach anything
        lo_s, hi_s = after_s - PHASE_SLACK_S, at_s + PHASE_SLACK_S
        dev.phase_seen_s = at_s
        if dev.phase_lo is not None:
            period_s = self.update_period_s
            k = round(((lo_s + hi_s) - (dev.phase_lo + dev.phase_hi)) / 2.0 / period_s)
            new_lo, new_hi = max(lo_s, dev.phase_lo + k * period_s), min(hi_s, dev.phase_hi + k * period_s)
            if new_lo < new_hi:
                dev.phase_lo, dev.phase_hi = new_lo, new_hi
                return
            log.debug("%s: counter update outside its learned phase; relearning", dev.info.key)
        dev.phase_lo, dev.phase_hi = lo_s, hi_s

    def _ambiguous_for(self, dev: _Device, t_s: float) -> float:
        """How long until ``t_s`` is past the predicted update it may be right at (0: not near one)."""
        assert dev.phase_lo is not None
        period_s = self.update_period_s
        k = math.floor((t_s - dev.phase_hi) / period_s)  # the last update surely before t_s is k
        next_lo, next_hi = dev.phase_lo + (k + 1) * period_s, dev.phase_hi + (k + 1) * period_s
        return next_hi - t_s if t_s >= next_lo else 0.0

    def _last_update_s(self, dev: _Device, t_s: float) -> float:
        """The predicted last counter update at or before ``t_s`` (mid-bracket)."""
        assert dev.phase_lo is not None
        period_s = self.update_period_s
        k = math.floor((t_s - dev.phase_hi) / period_s)
        return (dev.phase_lo + dev.phase_hi) / 2.0 + k * period_s

    def _phase_consistent(self, dev: _Device, changed: bool, prev_t_s: float, t_s: float) -> bool:
        """Whether the counter changing (or not) between reads at ``prev_t_s`` and ``t_s`` fits the phase."""
        assert dev.phase_lo is not None
        lo, hi, period_s = dev.phase_lo, dev.phase_hi, self.update_period_s
        most = math.floor((t_s - lo) / period_s) - math.floor((prev_t_s - hi) / period_s)
        least = math.floor((t_s - hi) / period_s) - math.floor((prev_t_s - lo) / period_s)
        return most > 0 if changed else least <= 0

    def _calibrate(self, devs: list[_Device]) -> None:
        """Poll the counters of ``devs`` (all in one loop, every ``poll_interval_s``, at most
        ``PHASE_CALIBRATION_S``) until each changes, to learn its update phase."""
        if not devs:
            return
        start_s = self._clock()
        for dev in devs:
            dev.phase_tried_s = start_s
        last: dict[str, tuple[int, float]] = {}
        pending = {d.info.key: d for d in devs}
        polls_left = int(PHASE_CALIBRATION_S / self.poll_interval_s) + 2  # a stuck clock cannot hang us
        while pending and polls_left > 0:
            for key, dev in list(pending.items()):
                try:
                    raw_mj = self._counter_mj(dev)
                except DeviceLost as exc:
                    self._mark_lost(dev, exc)
                    del pending[key]
                    continue
                except SensorError as exc:
                    self._warn_once(dev, exc)
                    del pending[key]
                    continue
                t_s = self._clock()
                self._observe(dev, raw_mj, t_s)
                if key in last and raw_mj != last[key][0]:
                    dev.phase_lo = None  # a fresh calibration replaces the old phase
                    self._learn_phase(dev, last[key][1], t_s)
                    del pending[key]
                    continue
                last[key] = (raw_mj, t_s)
            polls_left -= 1
            if not pending or self._clock() - start_s >= PHASE_CALIBRATION_S:
                break
            self._sleep(self.poll_interval_s)
        for key in pending:
            log.debug("%s: counter did not move within %.2f s; reads stay as of its updates", key, PHASE_CALIBRATION_S)

    def read_at(self, t_s: float) -> list[EnergyReading]:
        """Cumulative J per live GPU as of ``t_s`` (just past), pinned to each counter's next update.

        Polls every ``poll_interval_s`` until each counter changes after ``t_s`` (at ``t_u``), then
        returns ``E(t_u)`` minus the energy in ``[t_s, t_u]`` integrated from power sampled while polling.
        When polling starts late, the counter's own window around ``t_s`` bounds the estimate. Gives up
        after 2.5 update periods, and extrapolates when ``t_s`` is older than the update the first poll
        saw; both are flagged ``boundary_unrefined`` (the latter when over half a period is extrapolated).
        """
        with self._lock:
            live = self._live()
            values: dict[str, tuple[float, tuple[str, ...]]] = {}
            counters = [d for d in live if d.has_counter]
            if counters:
                values.update(self._boundary_counters(counters, t_s))
            for dev in live:
                if not dev.has_counter:
                    try:
                        values[dev.info.key] = self._boundary_power(dev, t_s)
                    except DeviceLost as exc:
                        self._mark_lost(dev, exc)
                    except SensorError as exc:
                        self._warn_once(dev, exc)
            out: list[EnergyReading] = []
            for dev in live:
                if dev.info.key in values:
                    energy_j, flags = values[dev.info.key]
                    out.append(self._emit(dev, t_s, energy_j, *flags))
            return out

    def _boundary_counters(self, devs: list[_Device], t_s: float) -> dict[str, tuple[float, tuple[str, ...]]]:
        probes = {d.info.key: _Probe(d) for d in devs}
        start_s = self._clock()
        deadline_s = max(start_s, t_s) + 2.5 * self.update_period_s
        # Also bound the number of polls, so a clock that does not move cannot hang the agent.
        polls_left = 2 * int((deadline_s - start_s) / self.poll_interval_s) + 10
        done: dict[str, tuple[float, tuple[str, ...]]] = {}
        while probes:
            now_s = self._clock()
            for key, probe in list(probes.items()):
                dev = probe.dev
                try:
                    raw_mj = self._counter_mj(dev)
                    read_s = self._clock()
                    if probe.last_raw_mj is not None and raw_mj != probe.last_raw_mj:
                        self._learn_phase(dev, probe.last_read_s, read_s)
                    probe.last_read_s = read_s
                    self._observe(dev, raw_mj, now_s)
                    power_w = self._power_w(dev)
                    if probe.boundary.samples and power_w != probe.boundary.samples[-1][1]:
                        if raw_mj == probe.last_raw_mj:
                            dev.instant_live = True
                        else:
                            probe.boundary.changed_with_counter = True
                    probe.boundary.samples.append((now_s, power_w))
                    if probe.boundary.first_j is None:
                        probe.boundary.first_j, probe.boundary.first_t_s = dev.cumulative_j, now_s
                except DeviceLost as exc:
                    self._mark_lost(dev, exc)
                    del probes[key]
                    continue
                except SensorError as exc:
                    self._warn_once(dev, exc)
                    del probes[key]
                    continue
                if probe.last_raw_mj is not None and raw_mj != probe.last_raw_mj and probe.last_t_s >= t_s:
                    # The update happened in (last poll, this poll]: take the midpoint as its time.
                    t_u = (probe.last_t_s + now_s) / 2.0
                    done[key] = self._pin(probe, t_s, t_u)
                    del probes[key]
                    continue
                probe.last_raw_mj, probe.last_t_s = raw_mj, now_s
            if not probes:
                break
            polls_left -= 1
            if self._clock() >= deadline_s or polls_left <= 0:
                for key, probe in probes.items():
                    log.debug("%s: counter did not move within %.2f s of a boundary", key, 2.5 * self.update_period_s)
                    done[key] = (probe.dev.cumulative_j, ("boundary_unrefined",))
                break
            self._sleep(self.poll_interval_s)
        return done

    def _pin(self, probe: _Probe, t_s: float, t_u: float) -> tuple[float, tuple[str, ...]]:
        """E(t_s) from the counter update at ``t_u`` and the power sampled while polling."""
        dev = probe.dev
        if probe.boundary.changed_with_counter and not dev.instant_live:
            dev.instant_held = True
        held = not dev.instant_live and dev.instant_held
        return pin_boundary(
            probe.boundary, dev.cumulative_j, t_s, t_u, held, self.update_period_s, self.poll_interval_s
        )

    def _boundary_power(self, dev: _Device, t_s: float) -> tuple[float, tuple[str, ...]]:
        self._sample_power(dev)
        hist = list(dev.history)
        # Interpolate the integral at t_s between the samples around it (the thread samples >= 10 Hz).
        for (t0, e0), (t1, e1) in pairwise(hist):
            if t0 <= t_s <= t1:
                return (e0 + (e1 - e0) * (t_s - t0) / (t1 - t0) if t1 > t0 else e1), ()
        if hist and t_s >= hist[-1][0]:
            return hist[-1][1], ()
        return (hist[0][1] if hist else dev.integral_j), ("boundary_unrefined",)

    def running_pids(self, key: str) -> set[int]:
        """Pids of compute processes NVML lists on GPU ``key`` (empty when unsupported or lost)."""
        dev = self._devices.get(key)
        if dev is None:
            raise DeviceNotFound(f"no GPU {key!r} here; known: {', '.join(self._devices) or 'none'}")
        with self._lock:
            if key in self._lost:
                return set()
            try:
                with nvml_errors(self._nvml, f"listing processes on {key}"):
                    procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(dev.handle)
            except NotSupported:
                return set()
            except DeviceLost as exc:
                self._mark_lost(dev, exc)
                return set()
        return {int(p.pid) for p in procs}

    def utilization_ratio(self, key: str) -> float | None:
        """NVML's GPU utilisation of GPU ``key`` (``nvmlDeviceGetUtilizationRates().gpu``) as 0-1.

        One NVML call, for the agent's /metrics at scrape time. None when the GPU is lost or the driver
        does not report it (e.g. some vGPU/MIG setups); other NVML errors are logged once and give None
        too: a scrape must never fail on one GPU. Unknown ``key`` raises DeviceNotFound.
        """
        dev = self._devices.get(key)
        if dev is None:
            raise DeviceNotFound(f"no GPU {key!r} here; known: {', '.join(self._devices) or 'none'}")
        with self._lock:
            if key in self._lost or self._closed:
                return None
            try:
                with nvml_errors(self._nvml, f"reading {key}'s utilisation"):
                    rates = self._nvml.nvmlDeviceGetUtilizationRates(dev.handle)
            except NotSupported:
                return None
            except DeviceLost as exc:
                self._mark_lost(dev, exc)
                return None
            except SensorError as exc:
                self._warn_once(dev, exc)
                return None
        return min(max(float(rates.gpu) / 100.0, 0.0), 1.0)

    def process_utilization(self, key: str, since_s: float, until_s: float | None = None) -> dict[int, float]:
        """Mean SM utilisation (percent, 0-100) per pid on GPU ``key`` over ``(since_s, until_s]`` (None: now).

        Each NVML sample is a process's mean over the ``PROCESS_SAMPLE_PERIOD_S`` before its stamp; a
        sample counts by how much of its period lies in the window, so the edges are resolved finer than
        the sampling grid (the samples covering ``until_s`` arrive up to one period later). NVML lists a
        process only in the samples where it was busy: a sample without a pid counts as 0 % for it, every
        pid being averaged over the same samples (those returned, or the grid through them if that has
        more), so a process idle for part of the window is not weighed as if busy throughout.

        For sharing a GPU among the jobs on it. Empty when NVML has no sample since then (an idle GPU),
        does not support per-process utilisation (e.g. some vGPU/MIG setups), or the GPU is lost: the
        caller then splits equally. Unknown ``key`` raises DeviceNotFound.
        """
        dev = self._devices.get(key)
        if dev is None:
            raise DeviceNotFound(f"no GPU {key!r} here; known: {', '.join(self._devices) or 'none'}")
        since_us = max(0, int(since_s * 1e6))
        with self._lock:
            if key in self._lost:
                return {}
            try:
                with nvml_errors(self._nvml, f"reading per-process utilisation on {key}"):
                    samples = self._nvml.nvmlDeviceGetProcessUtilization(dev.handle, since_us)
            except DeviceNotFound:  # NVML_ERROR_NOT_FOUND: no sample since since_s
                return {}
            except DeviceLost as exc:
                self._mark_lost(dev, exc)
                return {}
            except SensorError as exc:
                self._warn_once(dev, exc)
                return {}
            now_s = self._clock()
        until = now_s if until_s is None else until_s
        period_s = PROCESS_SAMPLE_PERIOD_S

        def weight(stamp_s: float) -> float:  # the part of the sample's period inside the window
            return max(0.0, min(stamp_s, until) - max(stamp_s - period_s, since_s)) / period_s

        per_pid: dict[int, float] = {}
        stamps: dict[int, float] = {}
        for sample in samples:
            # NVML may hand back older entries from its buffer; only the window asked for counts.
            stamp_us = int(sample.timeStamp)
            w = weight(stamp_us / 1e6)
            if stamp_us <= since_us or w <= 0.0:
                continue
            stamps[stamp_us] = w
            per_pid[int(sample.pid)] = per_pid.get(int(sample.pid), 0.0) + w * float(sample.smUtil)
        if not stamps:
            return {}
        # Instants where no process was busy are missing altogether: add up the grid through a sample,
        # as far as NVML can have sampled it.
        first_s = min(stamps) / 1e6
        k = math.floor((since_s - first_s) / period_s)
        grid_w = 0.0
        while (g := first_s + k * period_s) <= min(until + period_s, now_s):
            grid_w += weight(g)
            k += 1
        total_w = max(sum(stamps.values()), grid_w)
        return {pid: value / total_w for pid, value in per_pid.items()}

    def close(self) -> None:
        """Stop the power integrator and shut NVML down; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            with nvml_errors(self._nvml, "shutting NVML down"):
                self._nvml.nvmlShutdown()
        except SensorError as exc:
            log.debug("%s", exc)

    def _integrate_loop(self, interval_s: float) -> None:
        rng = random.Random()
        # Real time on purpose (Event.wait), whatever clock the readings use.
        while not self._stop.wait(jittered_interval_s(interval_s, rng)):
            with self._lock:
                for dev in self._live():
                    if dev.has_counter:
                        continue
                    try:
                        self._sample_power(dev)
                    except DeviceLost as exc:
                        self._mark_lost(dev, exc)
                    except SensorError as exc:
                        self._warn_once(dev, exc)


@dataclass
class _Probe:
    """One device's state while a boundary read polls it."""

    dev: _Device
    last_raw_mj: int | None = None
    last_t_s: float = 0.0
    last_read_s: float = 0.0  # the clock right after the last counter read (for learning the phase)
    boundary: BoundaryProbe = field(default_factory=BoundaryProbe)


def _text(value: Any) -> str:
    """NVML strings are ``bytes`` in old bindings and ``str`` in new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)
