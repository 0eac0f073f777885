"""Fold a batch of intervals into the totals reports read: per job and device, per job on a host, idle.

Storage adds these totals onto its rollup tables, so a report reads O(jobs) rows instead of every
interval ever measured. Pure: device keys go in, plain dicts come out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    # The job's power over each device's latest RECENT_POWER_S in the batch, summed, and the latest end.
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
# "Power now" for /metrics: per device, the job's energy over its latest intervals covering at least this
# long (or all of the batch's when they cover less), over the span they cover; summed over its devices.
RECENT_POWER_S = 1.0


def hour_floor_s(t_s: float) -> float:
    """Start of the UTC hour containing ``t_s`` (epoch seconds)."""
    return math.floor(t_s / HOUR_S) * HOUR_S


class IntervalLike(Protocol):
    """What ``rollup_intervals`` reads of an interval: an IntervalIn, or a ``wire.Interval`` as decoded."""

    @property
    def device(self) -> str: ...
    @property
    def t_start_s(self) -> float: ...
    @property
    def t_end_s(self) -> float: ...
    @property
    def energy_j(self) -> float: ...
    @property
    def source(self) -> str: ...
    @property
    def shares(self) -> Mapping[str, float]: ...
    @property
    def idle_weight(self) -> float: ...


def rollup_intervals(intervals: Iterable[IntervalLike]) -> BatchRollup:
    """Attribute every interval with ``split_interval`` and sum the parts into rollup totals.

    A job's peak power on the host is the largest, over ``PEAK_WINDOW_S`` windows, of its energy summed
    over the host's devices divided by the window's span; a device's ``max_power_w`` likewise per device.
    Windows spanning less than ``MIN_POWER_WINDOW_S`` add energy but no peak.
    """
    # The collector runs this for every interval it stores: the loop keeps its state in plain dicts and
    # lists (windows as [energy_j, start_s, end_s]) rather than objects, which halves its cost.
    out = BatchRollup()
    job_device, job_host, idle, ticks = out.job_device, out.job_host, out.idle_j, out.job_ticks_j
    device_windows: dict[tuple[str, str, int], list[float]] = {}
    host_windows: dict[tuple[str, int], list[float]] = {}
    # Each job's parts per device, for "power now": devices are read at their own times (an energy
    # counter's refresh, RAPL's), so the job's ticks summed over devices do not line up.
    device_ticks: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    floor = math.floor
    hour_s = HOUR_S
    window_s = PEAK_WINDOW_S
    inf = math.inf
    for iv in intervals:
        shares = iv.shares
        t0, t1, device = iv.t_start_s, iv.t_end_s, iv.device
        if len(shares) == 1 and iv.idle_weight == 0.0:
            # The common case, a device held by one job: all of it is that job's. ``split_interval`` does
            # the same (and checks the energy, which decoding has bounded already); inlined, it is half
            # the loop's cost.
            ((only, weight),) = shares.items()
            energy_j = iv.energy_j
            if not (0.0 <= energy_j < inf and 0.0 <= weight < inf):
                split_interval(energy_j, shares, 0.0)  # raises the ValueError naming it
            parts: Any = ((only, energy_j),)
            idle_j = 0.0
            held = True
        else:
            jobs_j, idle_j = split_interval(iv.energy_j, shares, iv.idle_weight)
            parts = jobs_j.items()
            held = bool(jobs_j)
        if held:
            source = iv.source
            bucket = floor(t0 / window_s)
            for job_id, part_j in parts:
                key = (job_id, device)
                jd = job_device.get(key)
                if jd is None:
                    jd = job_device[key] = JobDeviceTotals()
                jd.energy_j += part_j
                jd.sources.add(source)
                # Windows as [energy_j, start_s, end_s], updated in place (a call each cost a tenth of the loop).
                wkey = (job_id, device, bucket)
                w = device_windows.get(wkey)
                if w is None:
                    device_windows[wkey] = [part_j, t0, t1]
                else:
                    w[0] += part_j
                    if t0 < w[1]:
                        w[1] = t0
                    if t1 > w[2]:
                        w[2] = t1
                hkey = (job_id, bucket)
                w = host_windows.get(hkey)
                if w is None:
                    host_windows[hkey] = [part_j, t0, t1]
                else:
                    w[0] += part_j
                    if t0 < w[1]:
                        w[1] = t0
                    if t1 > w[2]:
                        w[2] = t1
                tick = (job_id, t0, t1)
                ticks[tick] = ticks.get(tick, 0.0) + part_j
                held_ticks = device_ticks.get(key)
                if held_ticks is None:
                    device_ticks[key] = [(t0, t1, part_j)]
                else:
                    held_ticks.append((t0, t1, part_j))
                jh = job_host.get(job_id)
                if jh is None:
                    jh = job_host[job_id] = JobHostTotals()
                if t0 < jh.first_s:
                    jh.first_s = t0
                if t1 > jh.last_s:
                    jh.last_s = t1
        if idle_j > 0.0 or not held:
            ikey = (device, floor(t0 / hour_s) * hour_s)
            idle[ikey] = idle.get(ikey, 0.0) + idle_j
    for (job_id, device, _), window in device_windows.items():
        power_w = _window_power_w(window)
        if power_w is not None:
            jd = job_device[(job_id, device)]
            jd.max_power_w = max(jd.max_power_w, power_w)
    for (job_id, _), window in host_windows.items():
        power_w = _window_power_w(window)
        if power_w is not None:
            jh = job_host[job_id]
            jh.peak_power_w = max(jh.peak_power_w, power_w)
    _add_recent_power(out, device_ticks)
    return out


def _window_power_w(window: list[float]) -> float | None:
    span_s = window[2] - window[1]
    return window[0] / span_s if span_s >= MIN_POWER_WINDOW_S else None


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


def _add_recent_power(out: BatchRollup, device_ticks: dict[tuple[str, str], list[tuple[float, float, float]]]) -> None:
    """Each job's power now: the sum over its devices of each device's power over its own latest
    ``RECENT_POWER_S`` of intervals, as of the latest of those ends.

    Summing first and taking the latest second after would let one device's later read stand for the
    job: a CPU package read 0.3 s after the GPUs, holding a sliver of the job, made a 600 W job read
    0.0015 W."""
    per_job: dict[str, tuple[float, float]] = {}
    for (job_id, _device), ticks in device_ticks.items():
        found = recent_power(ticks)
        if found is None:
            continue
        power_w, end_s = found
        total_w, at_s = per_job.get(job_id, (0.0, -math.inf))
        per_job[job_id] = (total_w + power_w, max(at_s, end_s))
    for job_id, (power_w, at_s) in per_job.items():
        jh = out.job_host[job_id]
        jh.recent_power_w, jh.recent_at_s = power_w, at_s
