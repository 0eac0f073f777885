"""Fold a batch of intervals into the totals reports read: per job and device, per job on a host, idle.

Storage adds these totals onto its rollup tables, so a report reads O(jobs) rows instead of every
interval ever measured. Pure: device keys go in, plain dicts come out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from wattwatch.accounting.attribution import split_interval

HOUR_S = 3600.0


@dataclass(frozen=True)
class IntervalIn:
    """One device interval, as the rollup needs it. ``device`` is any key unique within the batch."""

    device: str
    t_start_s: float
    t_end_s: float
    energy_j: float
    source: str
    shares: Mapping[str, float]
    idle_weight: float = 0.0


@dataclass
class JobDeviceTotals:
    """What one batch adds for one job on one device."""

    energy_j: float = 0.0
    max_power_w: float = 0.0
    sources: set[str] = field(default_factory=set)


@dataclass
class JobHostTotals:
    """What one batch adds for one job on the batch's host. Peak power is over whole-host ticks."""

    peak_power_w: float = 0.0
    first_s: float = math.inf
    last_s: float = -math.inf
    # Power over the job's latest RECENT_POWER_S of ticks in the batch, and the end of those ticks.
    recent_power_w: float | None = None
    recent_at_s: float | None = None


@dataclass
class BatchRollup:
    """Totals of one batch. ``idle_j`` is keyed by ``(device, hour_s)``, hour_s = start floored to the hour.

    ``job_ticks_j`` is each job's energy per tick on this host, keyed by ``(job, t_start_s, t_end_s)``
    and summed over the host's devices: the job's energy timeline that per-span energies are shared
    from (``accounting.spans``), a device-count times smaller than the raw intervals.
    """

    job_device: dict[tuple[str, str], JobDeviceTotals] = field(default_factory=dict)
    job_host: dict[str, JobHostTotals] = field(default_factory=dict)
    idle_j: dict[tuple[str, float], float] = field(default_factory=dict)
    job_ticks_j: dict[tuple[str, float, float], float] = field(default_factory=dict)


# An energy counter advances about every 100 ms, so the power of a short interval (a job boundary just
# before a tick, or the 0.1 s ticks while requests flow) is mostly counter noise. Peak power is taken
# over windows: the intervals starting in the same PEAK_WINDOW_S bucket are added up, and a window
# counts once it spans at least MIN_POWER_WINDOW_S. The report never shows a peak below the average.
PEAK_WINDOW_S = 1.0
MIN_POWER_WINDOW_S = 0.5
# "Power now" for /metrics: the job's energy over its latest ticks covering at least this long (or all of
# the batch's ticks when they cover less), over the span they cover.
RECENT_POWER_S = 1.0


@dataclass
class _Window:
    energy_j: float = 0.0
    start_s: float = math.inf
    end_s: float = -math.inf

    def add(self, energy_j: float, start_s: float, end_s: float) -> None:
        self.energy_j += energy_j
        self.start_s = min(self.start_s, start_s)
        self.end_s = max(self.end_s, end_s)

    def power_w(self) -> float | None:
        span_s = self.end_s - self.start_s
        return self.energy_j / span_s if span_s >= MIN_POWER_WINDOW_S else None


def hour_floor_s(t_s: float) -> float:
    """Start of the UTC hour containing ``t_s`` (epoch seconds)."""
    return math.floor(t_s / HOUR_S) * HOUR_S


def rollup_intervals(intervals: Iterable[IntervalIn]) -> BatchRollup:
    """Attribute every interval with ``split_interval`` and sum the parts into rollup totals.

    A job's peak power on the host is the largest, over ``PEAK_WINDOW_S`` windows, of its energy summed
    over the host's devices divided by the window's span; a device's ``max_power_w`` likewise per device.
    Windows spanning less than ``MIN_POWER_WINDOW_S`` add energy but no peak.
    """
    out = BatchRollup()
    device_windows: dict[tuple[str, str, int], _Window] = {}
    host_windows: dict[tuple[str, int], _Window] = {}
    for iv in intervals:
        jobs_j, idle_j = split_interval(iv.energy_j, iv.shares, iv.idle_weight)
        for job_id, part_j in jobs_j.items():
            jd = out.job_device.setdefault((job_id, iv.device), JobDeviceTotals())
            jd.energy_j += part_j
            jd.sources.add(iv.source)
            bucket = math.floor(iv.t_start_s / PEAK_WINDOW_S)
            device_windows.setdefault((job_id, iv.device, bucket), _Window()).add(part_j, iv.t_start_s, iv.t_end_s)
            host_windows.setdefault((job_id, bucket), _Window()).add(part_j, iv.t_start_s, iv.t_end_s)
            tick = (job_id, iv.t_start_s, iv.t_end_s)
            out.job_ticks_j[tick] = out.job_ticks_j.get(tick, 0.0) + part_j
            jh = out.job_host.setdefault(job_id, JobHostTotals())
            jh.first_s = min(jh.first_s, iv.t_start_s)
            jh.last_s = max(jh.last_s, iv.t_end_s)
        if idle_j > 0.0 or not jobs_j:
            key = (iv.device, hour_floor_s(iv.t_start_s))
            out.idle_j[key] = out.idle_j.get(key, 0.0) + idle_j
    for (job_id, device, _), window in device_windows.items():
        power_w = window.power_w()
        if power_w is not None:
            jd = out.job_device[(job_id, device)]
            jd.max_power_w = max(jd.max_power_w, power_w)
    for (job_id, _), window in host_windows.items():
        power_w = window.power_w()
        if power_w is not None:
            jh = out.job_host[job_id]
            jh.peak_power_w = max(jh.peak_power_w, power_w)
    _add_recent_power(out)
    return out


def recent_power(ticks: Iterable[tuple[float, float, float]]) -> tuple[float, float] | None:
    """``(power_w, end_s)`` over the latest ``(t_start_s, t_end_s, energy_j)`` ticks that cover at least
    ``RECENT_POWER_S`` (all of them if they cover less); None when they cover no time."""
    energy_j, start_s, end_s = 0.0, math.inf, -math.inf
    for t_start_s, t_end_s, tick_j in sorted(ticks, key=lambda t: t[1], reverse=True):
        if end_s - start_s >= RECENT_POWER_S:
            break
        energy_j += tick_j
        start_s, end_s = min(start_s, t_start_s), max(end_s, t_end_s)
    span_s = end_s - start_s
    return (energy_j / span_s, end_s) if span_s > 0 else None


def _add_recent_power(out: BatchRollup) -> None:
    per_job: dict[str, list[tuple[float, float, float]]] = {}
    for (job_id, t_start_s, t_end_s), energy_j in out.job_ticks_j.items():
        per_job.setdefault(job_id, []).append((t_start_s, t_end_s, energy_j))
    for job_id, ticks in per_job.items():
        found = recent_power(ticks)
        if found is not None:
            jh = out.job_host[job_id]
            jh.recent_power_w, jh.recent_at_s = found
