"""Fold a batch of intervals into the totals reports read: per job and device, per job on a host, idle.

Storage adds these totals onto its rollup tables, so a report reads O(jobs) rows instead of every
interval ever measured. Pure: device keys go in, plain dicts come out.
"""

from __future__ import annotations

import math
import operator
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
    # The collector runs this for every interval it stores, so the loop over intervals does the least it
    # can: per part, one dict lookup for its (job, device) and one for its job, and an append of the part
    # to each. Windows, ticks and "power now" are computed afterwards from those lists, in the order the
    # parts arrived, so every sum adds the same numbers in the same order as adding them up on the way.
    out = BatchRollup()
    idle = out.idle_j
    # Per (job, device): [sources, last source, parts as (t_start_s, t_end_s, energy_j)].
    pairs: dict[tuple[str, str], list[Any]] = {}
    # Per job: its parts on every device, in arrival order.
    per_job: dict[str, list[tuple[float, float, float]]] = {}
    floor = math.floor
    hour_s = HOUR_S
    inf = math.inf
    for iv in intervals:
        shares = iv.shares
        if len(shares) == 1 and iv.idle_weight == 0.0:
            # The common case, a device held by one job: all of it is that job's. ``split_interval`` does
            # the same (and checks the energy, which decoding has bounded already); inlined, it is half
            # the loop's cost.
            ((job_id, weight),) = shares.items()
            part_j = iv.energy_j
            if not (0.0 <= part_j < inf and 0.0 <= weight < inf):
                split_interval(part_j, shares, 0.0)  # raises the ValueError naming it
            part = (iv.t_start_s, iv.t_end_s, part_j)
            source = iv.source
            pair = pairs.get((job_id, iv.device))
            if pair is None:
                pairs[(job_id, iv.device)] = [{source}, source, [part]]
            else:
                if source != pair[1]:
                    pair[0].add(source)
                    pair[1] = source
                pair[2].append(part)
            job_parts = per_job.get(job_id)
            if job_parts is None:
                per_job[job_id] = [part]
            else:
                job_parts.append(part)
            continue
        t0, t1 = iv.t_start_s, iv.t_end_s
        jobs_j, idle_j = split_interval(iv.energy_j, shares, iv.idle_weight)
        if jobs_j:
            source = iv.source
            device = iv.device
            for job_id, part_j in jobs_j.items():
                part = (t0, t1, part_j)
                pair = pairs.get((job_id, device))
                if pair is None:
                    pairs[(job_id, device)] = [{source}, source, [part]]
                else:
                    if source != pair[1]:
                        pair[0].add(source)
                        pair[1] = source
                    pair[2].append(part)
                job_parts = per_job.get(job_id)
                if job_parts is None:
                    per_job[job_id] = [part]
                else:
                    job_parts.append(part)
        if idle_j > 0.0 or not jobs_j:
            ikey = (iv.device, floor(t0 / hour_s) * hour_s)
            idle[ikey] = idle.get(ikey, 0.0) + idle_j
    job_device = out.job_device
    device_ticks: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for key, (sources, _, held_parts) in pairs.items():
        energy_j, peak_w = _energy_and_peak(held_parts)
        job_device[key] = JobDeviceTotals(energy_j=energy_j, max_power_w=peak_w, sources=sources)
        device_ticks[key] = held_parts
    for job_id, job_parts in per_job.items():
        out.job_host[job_id] = _job_ticks(job_id, job_parts, out.job_ticks_j)
    _add_recent_power(out, device_ticks)
    return out


def _energy_and_peak(parts: list[tuple[float, float, float]]) -> tuple[float, float]:
    """The parts' energy (added in arrival order) and their largest power over ``PEAK_WINDOW_S`` windows (a
    part belongs to the window its start falls in; 0.0 when no window spans ``MIN_POWER_WINDOW_S``), in
    one pass: parts come window after window, each window a run of consecutive parts summed in place."""
    floor = math.floor
    window_s, min_span_s = PEAK_WINDOW_S, MIN_POWER_WINDOW_S
    total_j = best_w = 0.0
    bucket = None
    energy_j = start_s = end_s = 0.0
    for t0, t1, part_j in parts:
        total_j += part_j
        b = floor(t0 / window_s)
        if b == bucket:
            energy_j += part_j
            if t0 < start_s:
                start_s = t0
            if t1 > end_s:
                end_s = t1
            continue
        if bucket is not None:
            if b < bucket:  # a window seen before may come back: add them up by window instead
                return _sum_j(parts), _peak_power_any_order_w(parts)
            span_s = end_s - start_s
            if span_s >= min_span_s and energy_j / span_s > best_w:
                best_w = energy_j / span_s
        bucket, energy_j, start_s, end_s = b, part_j, t0, t1
    if bucket is not None:
        span_s = end_s - start_s
        if span_s >= min_span_s and energy_j / span_s > best_w:
            best_w = energy_j / span_s
    return total_j, best_w


def _sum_j(parts: list[tuple[float, float, float]]) -> float:
    """The parts' energy, added in arrival order."""
    total_j = 0.0
    for _, _, part_j in parts:
        total_j += part_j
    return total_j


def _peak_power_any_order_w(parts: list[tuple[float, float, float]]) -> float:
    """The largest power over ``PEAK_WINDOW_S`` windows of ``(t_start_s, t_end_s, energy_j)`` parts in any
    order (a part belongs to the window its start falls in); 0.0 when no window spans ``MIN_POWER_WINDOW_S``."""
    windows: dict[int, list[float]] = {}
    for t0, t1, part_j in parts:
        b = math.floor(t0 / PEAK_WINDOW_S)
        w = windows.get(b)
        if w is None:
            windows[b] = [part_j, t0, t1]
        else:
            w[0] += part_j
            w[1] = min(w[1], t0)
            w[2] = max(w[2], t1)
    best_w = 0.0
    for window in windows.values():
        power_w = _window_power_w(window)
        if power_w is not None:
            best_w = max(best_w, power_w)
    return best_w


def _job_ticks(
    job_id: str, parts: list[tuple[float, float, float]], ticks: dict[tuple[str, float, float], float]
) -> JobHostTotals:
    """Add the job's parts (every device's, in arrival order) to ``ticks`` per ``(job, t_start_s, t_end_s)``;
    the job's totals on the host: first start, last end, peak power over ``PEAK_WINDOW_S`` windows."""
    floor = math.floor
    window_s, min_span_s = PEAK_WINDOW_S, MIN_POWER_WINDOW_S
    first_s, last_s = math.inf, -math.inf
    mine: dict[tuple[str, float, float], float] = {}
    tick_t0 = tick_t1 = math.nan  # no tick yet: NaN equals nothing
    tick_j = 0.0
    # The peak's windows, as in _energy_and_peak, in the same pass.
    best_w = 0.0
    bucket = None
    window_j = start_s = end_s = 0.0
    in_order = True
    for t0, t1, part_j in parts:
        if t0 < first_s:
            first_s = t0
        if t1 > last_s:
            last_s = t1
        b = floor(t0 / window_s)
        if b == bucket:
            window_j += part_j
            if t0 < start_s:
                start_s = t0
            if t1 > end_s:
                end_s = t1
        else:
            if bucket is not None:
                if b < bucket:
                    in_order = False  # a window seen before may come back: add them up by key instead
                    break
                span_s = end_s - start_s
                if span_s >= min_span_s and window_j / span_s > best_w:
                    best_w = window_j / span_s
            bucket, window_j, start_s, end_s = b, part_j, t0, t1
        # Devices read at the same times: a tick's parts come together, one run per tick.
        if t0 == tick_t0 and t1 == tick_t1:
            tick_j += part_j
            continue
        if tick_t0 == tick_t0:  # a tick before this one (not NaN)
            if (t0, t1) < (tick_t0, tick_t1):
                in_order = False  # a tick seen before may come back: add them up by tick instead
                break
            mine[(job_id, tick_t0, tick_t1)] = tick_j
        tick_t0, tick_t1, tick_j = t0, t1, part_j
    if in_order:
        if tick_t0 == tick_t0:
            mine[(job_id, tick_t0, tick_t1)] = tick_j
        if bucket is not None:
            span_s = end_s - start_s
            if span_s >= min_span_s and window_j / span_s > best_w:
                best_w = window_j / span_s
    else:
        mine = {}
        for t0, t1, part_j in parts:
            key = (job_id, t0, t1)
            mine[key] = mine.get(key, 0.0) + part_j
        first_s = min(p[0] for p in parts)
        last_s = max(p[1] for p in parts)
        best_w = _peak_power_any_order_w(parts)
    ticks.update(mine)
    return JobHostTotals(peak_power_w=best_w, first_s=first_s, last_s=last_s)


def _window_power_w(window: list[float]) -> float | None:
    span_s = window[2] - window[1]
    return window[0] / span_s if span_s >= MIN_POWER_WINDOW_S else None


_END = operator.itemgetter(1)


def recent_power(ticks: Iterable[tuple[float, float, float]]) -> tuple[float, float] | None:
    """``(power_w, end_s)`` over the latest ``(t_start_s, t_end_s, energy_j)`` ticks that cover at least
    ``RECENT_POWER_S`` (all of them if they cover less); None when they cover no time."""
    energy_j, start_s, end_s = 0.0, math.inf, -math.inf
    for t_start_s, t_end_s, tick_j in sorted(ticks, key=_END, reverse=True):
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
