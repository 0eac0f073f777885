"""NVIDIA GPUs through NVML: cumulative joules from the energy counter, boundary reads pinned to its updates.

``nvmlDeviceGetTotalEnergyConsumption`` (mJ since driver load, Volta and newer) is the source of truth.
It only refreshes every so often (its period and phase are learned per GPU from the reads themselves,
``nvml_timing``), so a boundary read (``read_at``) polls until the counter moves and subtracts the
energy drawn between the boundary and that update, estimated from the power sampled while polling
(``nvml_boundary``). Devices without the counter are integrated from ``NVML_FI_DEV_POWER_INSTANT`` by a
background thread. Tick reads (``read``) add the energy since the counter's last update, from the
instant power and the learned phase. Per-process utilisation is read in ``nvml_processes``; NVML's
errors are translated once, in ``nvml_errors``; ``CUDA_VISIBLE_DEVICES`` is resolved in ``visible``.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from wattwatch.errors import DeviceLost, DeviceNotFound, SensorError
from wattwatch.protocol.units import Source
from wattwatch.sensors.base import DeviceInfo, EnergyReading
from wattwatch.sensors.nvml_boundary import CounterPoller
from wattwatch.sensors.nvml_device import (
    GpuCapabilities,
    GpuDevice,
    GpuTiming,
    NvmlReads,
    emit,
    integral_at,
    open_device,
    text,
    tick_read,
)
from wattwatch.sensors.nvml_errors import NO_DRIVER, NO_DRIVER_FIX, nvml_errors, translate_nvml_error
from wattwatch.sensors.nvml_processes import gpu_utilization, list_pids, mean_utilization, read_samples
from wattwatch.sensors.nvml_timing import SHORT_POLL_MAX_S
from wattwatch.sensors.visible import resolve_visible

__all__ = [
    "NO_DRIVER",
    "NO_DRIVER_FIX",
    "POWER_SAMPLE_INTERVAL_S",
    "GpuCapabilities",
    "GpuTiming",
    "NvmlSensor",
    "jittered_interval_s",
    "nvml_errors",
    "resolve_visible",
    "translate_nvml_error",
]

log = logging.getLogger(__name__)

# Integrator pace for GPUs without an energy counter (see NvmlSensor).
POWER_SAMPLE_INTERVAL_S = 0.01
# How far back learn_process_samples asks NVML for per-process samples (its buffer is finite anyway).
PROCESS_LOOKBACK_S = 30.0


def _poll_too_late(dev: GpuDevice, now_s: float) -> bool:
    """Whether a short poll of ``dev`` now would come after the refresh it is for, as its last one did: that
    one saw no refresh (it had come before the first read), and the window the refresh is predicted in
    opens before now again. A tick that is a whole number of refresh periods long (1 s and 100 ms) meets
    the refresh at the same offset every time, so without this the same GPU is polled every tick, three to
    seven counter reads and two sleeps each (0.3-0.4 ms of the agent's CPU a second), for no bracket; its
    phase is relearned by a calibration poll once the window has widened (``CounterTiming.tick_plan``)."""
    if not dev.short_poll_missed:
        return False
    window = dev.timing.aim(now_s)
    return window is not None and window[0] < now_s


def jittered_interval_s(mean_s: float, rng: random.Random) -> float:
    """The wait before the integrator's next power sample: uniform in [0.5, 1.5] x ``mean_s``.

    A fixed pace locks onto loads that repeat at a multiple of it (10 ms samples see a 50 ms square
    wave at the same five phases forever, +7 % on the accuracy benchmark); a random pace samples every
    phase, so the integral has no bias, only noise that averages out (+0.6 % on the same trace).
    """
    return mean_s * (0.5 + rng.random())


class NvmlSensor:
    """Every NVIDIA GPU on the host, through NVML (``pynvml`` from nvidia-ml-py, or a fake of it).

    ``visible`` (a CUDA_VISIBLE_DEVICES-style string) restricts the devices; the agent leaves it unset
    and measures all GPUs. ``clock`` and ``sleep`` are injectable so tests run on simulated time. A GPU
    that cannot be opened is left out (``unopened`` says why) unless none can, which raises.
    ``power_sample_interval_s`` paces the integrator of GPUs without an energy counter: 10 ms on
    average, randomly jittered (``jittered_interval_s``), because a slower or fixed pace aliases with
    loads that repeat near it (a 20 Hz sampler reads a 50 ms square wave at the same phase every time).
    Nothing about the boards' timing is configured: it is learned from them (``timing()``).
    """

    name = "nvml"

    def __init__(
        self,
        nvml: Any | None = None,
        *,
        visible: str | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
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
        self.poll_interval_s = poll_interval_s
        self.simulated = bool(getattr(nvml, "WATTWATCH_SIMULATED", False))
        self._reads = NvmlReads(nvml, clock)
        self._power_interval_s = power_sample_interval_s or POWER_SAMPLE_INTERVAL_S
        self._poller = CounterPoller(
            self._reads, self._sleep_for_poller, poll_interval_s, self._fail, self._sample_power_only
        )
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
        self._poller.calibrate([d for d in devices if d.has_counter])
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if power_sample_interval_s is not None and any(not d.has_counter for d in devices):
            self._thread = threading.Thread(
                target=self._integrate_loop, args=(power_sample_interval_s,), name="wattwatch-nvml-power", daemon=True
            )
            self._thread.start()

    def _sleep_for_poller(self, seconds: float) -> None:
        self._sleep(seconds)  # looked up at each call, so a test may swap ``_sleep``

    def _sample_power_only(self) -> None:
        """Sample the GPUs without a counter that are due, while a counter poll holds the lock (their
        integrator thread waits on it; a gap of a poll's length would be bridged by one straight line)."""
        now_s = self._clock()
        for dev in self._live():
            if dev.has_counter or (dev.power_t_s is not None and now_s - dev.power_t_s < self._power_interval_s):
                continue
            try:
                self._reads.sample_power(dev)
            except SensorError as exc:
                self._fail(dev, exc)

    # -- setup --------------------------------------------------------------------------------------

    def _enumerate(self) -> list[GpuDevice]:
        nvml = self._nvml
        with nvml_errors(nvml, "counting GPUs"):
            count = int(nvml.nvmlDeviceGetCount())
        devices: list[GpuDevice] = []
        errors: list[SensorError] = []
        for i in range(count):
            try:
                devices.append(open_device(self._reads, i))
            except SensorError as exc:
                # One broken GPU must not cost the others their measurements.
                log.warning("gpu%d is not measured: %s", i, exc)
                self.unopened[i] = str(exc)
                errors.append(exc)
        if errors and not devices:
            raise errors[0]
        return devices

    # -- bookkeeping --------------------------------------------------------------------------------

    def _emit(
        self, dev: GpuDevice, t_s: float, energy_j: float, *flags: str, extrapolated_j: float = 0.0
    ) -> EnergyReading:
        return emit(dev, t_s, energy_j, self._source(dev), flags, extrapolated_j)

    def _source(self, dev: GpuDevice) -> Source:
        if self.simulated:
            return "simulated"
        return "counter" if dev.has_counter else "power"

    def _live(self) -> list[GpuDevice]:
        return [d for k, d in self._devices.items() if k not in self._lost]

    def _fail(self, dev: GpuDevice, exc: SensorError) -> None:
        """A read of ``dev`` failed: a lost GPU is dropped for good, anything else skips this reading."""
        if isinstance(exc, DeviceLost):
            self._mark_lost(dev, exc)
        else:
            self._warn_once(dev, exc)

    def _mark_lost(self, dev: GpuDevice, exc: DeviceLost) -> None:
        if dev.key not in self._lost:
            self._lost.add(dev.key)
            log.error("%s (%s) is lost and no longer measured; the other GPUs are: %s", dev.key, dev.info.uuid, exc)

    def _warn_once(self, dev: GpuDevice, exc: SensorError) -> None:
        message = f"{dev.key}: {exc}"
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s (skipping this reading)", message)

    def _device(self, key: str) -> GpuDevice:
        dev = self._devices.get(key)
        if dev is None:
            raise DeviceNotFound(f"no GPU {key!r} here; known: {', '.join(self._devices) or 'none'}")
        return dev

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
                return text(self._nvml.nvmlSystemGetDriverVersion())
        except SensorError:
            return None

    def capabilities(self) -> list[GpuCapabilities]:
        """Per measured GPU: model, UUID, power limit, and whether the energy counter and POWER_INSTANT work."""
        return [
            GpuCapabilities(
                key=d.key,
                model=d.info.model,
                uuid=d.info.uuid,
                power_limit_w=d.info.power_limit_w,
                energy_counter=d.has_counter,
                power_instant=d.has_instant,
                lost=d.key in self._lost,
            )
            for d in self._devices.values()
        ]

    def timing(self) -> dict[str, GpuTiming]:
        """What has been learned about each GPU's timing so far (see ``GpuTiming``)."""
        with self._lock:
            now_s = self._clock()
            return {key: dev.describe_timing(now_s) for key, dev in self._devices.items()}

    def read(self) -> list[EnergyReading]:
        """Cumulative J per live GPU, now (each reading stamped when it was taken).

        The counter only refreshes every period, so its value is as of its last refresh ``t_u``. Where
        the refresh phase is known (learned by a calibration poll at start, refreshed when it goes stale,
        and from every change that ``read_at``'s polling sees) and instant power answers, the read adds
        what was drawn since: ``E(t_u) + P_instant x (now - t_u)``; a read that may straddle a
        predicted refresh waits until past it (a few ms). A read that contradicts the phase drops it
        (recalibrated at the next read); without it, or without instant power, the counter's value is
        returned as of the read. On part-time boards the instant reading is held (the sampled end of
        the last period): it still extrapolates the gap better than leaving it out.
        """
        with self._lock:
            now_s = self._clock()
            live = self._live()
            counters = [d for d in live if d.has_counter]
            # GPUs due for a calibration poll are polled first. Full ones are rare (nothing learned, or not
            # trusted for PHASE_MAX_AGE_S); short ones wait at most SHORT_POLL_MAX_S, for a refresh that is
            # due anyway, to keep the phase narrow.
            calibrated: set[str] = set()
            plans = [(d, d.timing.tick_plan(now_s)) for d in counters]  # one look at each GPU's grid
            wanted = [d for d, (wants, _) in plans if wants]
            if wanted:
                self._poller.calibrate(wanted, lambda dev: calibrated.add(dev.key))
                for d in wanted:
                    d.short_poll_missed = False
            now_s = self._clock()  # those polls may have taken up to a period
            due = {
                d.key: until_s - now_s
                for d, (_, until_s) in plans
                if until_s is not None and d.key not in calibrated and until_s > now_s
            }
            short = [
                d for d in counters if due.get(d.key, math.inf) <= SHORT_POLL_MAX_S and not _poll_too_late(d, now_s)
            ]
            if short:
                limit_s = max(due[d.key] for d in short) + 2 * self.poll_interval_s
                seen = [d.timing.refreshes_seen for d in short]
                self._poller.calibrate(short, limit_s=limit_s)
                for d, before in zip(short, seen, strict=True):
                    d.short_poll_missed = d.timing.refreshes_seen == before
            if wanted or short:
                live = self._live()  # a poll may have found a GPU lost
            # Then every GPU is read, back to back, so the readings are of one instant: the agent stamps a
            # sample's readings alike, and a GPU read as its poll ended, up to a poll's length (~0.2 s)
            # before the others, would have that much of its power moved across the tick.
            out: list[EnergyReading] = []
            reads, sleep = self._reads, self._sleep
            for dev in live:
                try:
                    if dev.has_counter:
                        t_s, energy_j, extrapolated_j = tick_read(reads, dev, sleep)
                        out.append(self._emit(dev, t_s, energy_j, extrapolated_j=extrapolated_j))
                    else:
                        reads.sample_power(dev)
                        assert dev.power_t_s is not None
                        out.append(self._emit(dev, dev.power_t_s, dev.integral_j))
                except SensorError as exc:
                    self._fail(dev, exc)
            return out

    def read_at(self, t_s: float) -> list[EnergyReading]:
        """Cumulative J per live GPU as of ``t_s`` (just past), pinned to each counter's next update.

        Polls every ``poll_interval_s`` until each counter changes after ``t_s`` (at ``t_u``), then
        returns ``E(t_u)`` minus the energy in ``[t_s, t_u]`` integrated from power sampled while polling.
        When polling starts late, the counter's own window around ``t_s`` bounds the estimate. Gives up
        after 2.5 learned refresh periods (0.6 s while the period is not learned), and extrapolates when
        ``t_s`` is older than the update the first poll saw; both are flagged ``boundary_unrefined`` (the
        latter when over half a period is extrapolated). A reading made without a learned period is
        flagged ``period_unlearned``.
        """
        with self._lock:
            live = self._live()
            values: dict[str, tuple[float, tuple[str, ...]]] = {}
            counters = [d for d in live if d.has_counter]
            if counters:
                values.update(self._poller.boundary(counters, t_s))
            for dev in live:
                if not dev.has_counter:
                    try:
                        self._reads.sample_power(dev)
                        values[dev.key] = integral_at(dev, t_s)
                    except SensorError as exc:
                        self._fail(dev, exc)
            out: list[EnergyReading] = []
            for dev in live:
                if dev.key in values:
                    energy_j, flags = values[dev.key]
                    out.append(self._emit(dev, t_s, energy_j, *flags))
            return out

    # -- processes ----------------------------------------------------------------------------------

    def running_pids(self, key: str) -> set[int]:
        """Pids of compute processes NVML lists on GPU ``key`` (empty when unsupported or lost).

        Not behind the sensor's lock (NVML is thread-safe): the agent asks it as a job ends, from the
        thread answering that job, while a boundary read may be polling for tens of milliseconds."""
        dev = self._device(key)
        if key in self._lost:
            return set()
        try:
            return list_pids(self._nvml, dev.handle, key)
        except DeviceLost as exc:
            with self._lock:
                self._mark_lost(dev, exc)
            return set()

    def utilization_ratio(self, key: str) -> float | None:
        """NVML's GPU utilisation of GPU ``key`` (``nvmlDeviceGetUtilizationRates().gpu``) as 0-1.

        One NVML call, for the agent's /metrics at scrape time. None when the GPU is lost or the driver
        does not report it (e.g. some vGPU/MIG setups); other NVML errors are logged once and give None
        too: a scrape must never fail on one GPU. Unknown ``key`` raises DeviceNotFound.
        """
        dev = self._device(key)
        with self._lock:
            if key in self._lost or self._closed:
                return None
            try:
                return gpu_utilization(self._nvml, dev.handle, key)
            except SensorError as exc:
                self._fail(dev, exc)
                return None

    def process_utilization(self, key: str, since_s: float, until_s: float | None = None) -> dict[int, float]:
        """Mean SM utilisation (percent, 0-100) per pid on GPU ``key`` over ``(since_s, until_s]`` (None: now).

        From NVML's per-process samples, weighed by the sample period learned from their timestamps
        (``nvml_processes.mean_utilization``; the samples covering ``until_s`` arrive up to one period
        later). For sharing a GPU among the jobs on it. Empty when NVML has no sample since then (an
        idle GPU), does not support per-process utilisation (e.g. some vGPU/MIG setups), or the GPU is
        lost: the caller then splits equally. Unknown ``key`` raises DeviceNotFound.
        """
        dev = self._device(key)
        with self._lock:
            if key in self._lost:
                return {}
            try:
                samples = read_samples(self._nvml, dev.handle, key, since_s)
            except SensorError as exc:
                self._fail(dev, exc)
                return {}
            now_s = self._clock()
            dev.process_samples.add(s.stamp_s for s in samples)
            period_s = dev.process_samples.period_s
        return mean_utilization(samples, since_s, now_s if until_s is None else until_s, now_s, period_s)

    def learn_process_samples(self, key: str, lookback_s: float = PROCESS_LOOKBACK_S) -> None:
        """Learn GPU ``key``'s per-process sample period from what NVML's buffer holds (for ``doctor``,
        which has not watched the GPU for long); nothing to learn when no process was busy."""
        self.process_utilization(key, self._clock() - lookback_s)

    # -- shutdown -----------------------------------------------------------------------------------

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
                        self._reads.sample_power(dev)
                    except SensorError as exc:
                        self._fail(dev, exc)
