"""GPU processes through NVML: which run on a GPU, how busy the GPU is, and per-process utilisation
(``nvmlDeviceGetProcessUtilization``), for sharing a GPU's energy among the jobs on it.

NVML keeps a buffer of samples, each a process's mean SM utilisation over the sample period before its
timestamp, listing only the processes busy in it. The period is not assumed: it is learned per GPU from
the timestamps themselves (``nvml_timing.SamplePeriod``). Until it is, each sample in the window counts
whole (the plain mean of the samples), which needs no period but resolves the window's edges only to a
sample.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from wattwatch.errors import DeviceNotFound, NotSupported
from wattwatch.sensors.nvml_errors import nvml_errors, translate_nvml_error
from wattwatch.sensors.nvml_grid import Change, coarse_period

# Per-process samples stamped closer than this are one sampling instant (several processes listed).
SAME_SAMPLE_S = 0.001


@dataclass(frozen=True)
class ProcessSample:
    """One NVML per-process sample: ``pid``'s mean SM utilisation (percent) over the period before ``stamp_s``."""

    pid: int
    stamp_s: float
    sm_util: float


def list_pids(nvml: Any, handle: Any, key: str) -> set[int]:
    """Pids of the compute processes NVML lists on GPU ``key`` (empty when it does not support the
    call); other NVML errors raise, translated."""
    # Every GPU, every tick: errors are caught inline and their message built only when one happens.
    try:
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError as exc:
        error = translate_nvml_error(nvml, exc, f"listing processes on {key}")
        if isinstance(error, NotSupported):
            return set()
        raise error from exc
    return {int(p.pid) for p in procs}


def gpu_utilization(nvml: Any, handle: Any, key: str) -> float | None:
    """NVML's GPU utilisation of GPU ``key`` as 0-1 (None when the driver does not report it); other NVML
    errors raise, translated."""
    try:
        with nvml_errors(nvml, f"reading {key}'s utilisation"):
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    except NotSupported:
        return None
    return min(max(float(rates.gpu) / 100.0, 0.0), 1.0)


def read_samples(nvml: Any, handle: Any, key: str, since_s: float) -> list[ProcessSample]:
    """NVML's samples for GPU ``key`` since ``since_s`` (NVML may add older ones from its buffer); empty when
    there is none (NVML's NotFound). Other NVML errors raise, translated."""
    since_us = max(0, int(since_s * 1e6))
    try:
        with nvml_errors(nvml, f"reading per-process utilisation on {key}"):
            raw = nvml.nvmlDeviceGetProcessUtilization(handle, since_us)
    except DeviceNotFound:  # NVML_ERROR_NOT_FOUND: no sample since since_s
        return []
    return [ProcessSample(int(s.pid), int(s.timeStamp) / 1e6, float(s.smUtil)) for s in raw]


def mean_utilization(
    samples: list[ProcessSample], since_s: float, until_s: float, now_s: float, period_s: float | None
) -> dict[int, float]:
    """Mean SM utilisation (percent) per pid over ``(since_s, until_s]`` from NVML's samples.

    With the sample period known, a sample counts by how much of its period lies in the window, so the
    edges are resolved finer than the sampling grid; a sample without a pid counts as 0 % for it, every
    pid being averaged over the same samples (those returned, or the grid through them, as far as NVML
    can have sampled it by ``now_s``, if that has more), so a process idle for part of the window is not
    weighed as if busy throughout. Without the period, every sample stamped in the window counts whole.
    """
    # NVML may hand back older entries from its buffer; only the window asked for counts.
    since_us = max(0, int(since_s * 1e6))

    def weight(stamp_s: float) -> float:  # the part of the sample's period inside the window
        if period_s is None:
            return 1.0 if since_s < stamp_s <= until_s else 0.0
        return max(0.0, min(stamp_s, until_s) - max(stamp_s - period_s, since_s)) / period_s

    per_pid: dict[int, float] = {}
    stamps: dict[float, float] = {}
    for sample in samples:
        w = weight(sample.stamp_s)
        if int(sample.stamp_s * 1e6) <= since_us or w <= 0.0:
            continue
        stamps[sample.stamp_s] = w
        per_pid[sample.pid] = per_pid.get(sample.pid, 0.0) + w * sample.sm_util
    if not stamps:
        return {}
    total_w = sum(stamps.values())
    if period_s is not None:
        # Instants where no process was busy are missing altogether: add up the grid through a sample.
        first_s = min(stamps)
        k = math.floor((since_s - first_s) / period_s)
        grid_w = 0.0
        while (g := first_s + k * period_s) <= min(until_s + period_s, now_s):
            grid_w += weight(g)
            k += 1
        total_w = max(total_w, grid_w)
    return {pid: value / total_w for pid, value in per_pid.items()}


class SamplePeriod:
    """The period of NVML's per-process utilisation samples, from the timestamps NVML puts on them.

    Samples from one answer are stamped on NVML's sampling grid; only instants where some process was
    busy appear, so the gaps between consecutive distinct stamps are whole multiples of the period
    (``coarse_period`` over each answer's stamps). Bounded history; None until two gaps were seen.
    """

    def __init__(self, keep: int = 32) -> None:
        self._answers: deque[list[Change]] = deque(maxlen=keep)
        self._estimate: tuple[float, float] | None = None
        self.stamps_seen = 0

    def add(self, stamps_s: Iterable[float]) -> None:
        """Learn from the distinct stamps of one answer."""
        distinct: list[float] = []
        for t_s in sorted(stamps_s):  # one sampling instant, whatever number of processes it lists
            if not distinct or t_s - distinct[-1] > SAME_SAMPLE_S:
                distinct.append(t_s)
        if len(distinct) < 2:
            return
        self.stamps_seen += len(distinct)
        self._answers.append([Change(t, t, t) for t in distinct[-64:]])
        self._estimate = coarse_period(self._answers)

    @property
    def period_s(self) -> float | None:
        """The learned sample period; None when not learned."""
        return None if self._estimate is None else self._estimate[0]
