"""Energy per span (inference request, training step or epoch): share a job's energy among what is in flight.

The rule (DESIGN.md, "Measurement semantics" 7): at every instant, the job's energy is shared
equally by the spans in flight then; energy at instants with no span in flight is the job's
*waiting* energy (a server holding its GPU while serving nothing). Within one of the job's energy
ticks the job's power is taken as constant: the tick's energy / its duration.

``split_job_energy`` is a sweep line over tick bounds and span endpoints. Between two consecutive
breakpoints the job's power and the number ``n`` of spans in flight are both constant, so that
elementary segment's energy ``E`` is known exactly; each span in flight gets ``E / n``. Instead of
adding ``E / n`` to every span in flight (O(spans x concurrency)), the sweep keeps one running total
``A`` of "energy per span in flight" and a span's energy is ``A(end) - A(start)``: O(events log events).

Conservation is exact up to float rounding: sum over spans + waiting == the ticks' energy inside
the window. Each tick's energy is handed out through a cumulative function that reaches the tick's
energy exactly at its end, so no tick loses or gains more than a rounding error however finely the
spans cut it.

Conventions: a span is in flight on ``[t_start_s, t_end_s)``; a zero-length span gets 0 J. A
zero-length tick (a counter read at one instant, energy ``E``) is energy at that instant: the spans
with ``t_start_s <= t < t_end_s`` share it, or it is waiting. Pure: no I/O, plain tuples in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Event codes: at one instant, spans that end leave before spans that start join (half-open spans),
# a bucket edge switches the waiting bucket, and energy at that very instant is shared last.
_TICK_END, _SPAN_END, _EDGE, _SPAN_START, _TICK_START, _POINT = range(6)


@dataclass(frozen=True)
class EnergySplit:
    """How ``split_job_energy`` shared the energy of one window.

    ``span_energy_j[i]`` is span ``i``'s energy inside the window (same order as the spans given);
    ``waiting_energy_j`` the energy with no span in flight; ``energy_j`` all the ticks' energy inside
    the window, which equals the sum of the other two up to rounding. ``waiting_by_bucket_j`` maps a
    bucket's start (a multiple of ``bucket_s``) to its waiting joules; empty without ``bucket_s``.
    """

    span_energy_j: list[float]
    waiting_energy_j: float
    energy_j: float
    waiting_by_bucket_j: dict[float, float] = field(default_factory=dict)


def bucket_floor_s(t_s: float, bucket_s: float) -> float:
    """Start of the ``bucket_s``-long bucket containing ``t_s`` (buckets are aligned to epoch 0)."""
    return math.floor(t_s / bucket_s) * bucket_s


def split_job_energy(
    ticks: Sequence[tuple[float, float, float]],
    spans: Sequence[tuple[float, float]],
    *,
    window_start_s: float = -math.inf,
    window_end_s: float = math.inf,
    bucket_s: float | None = None,
) -> EnergySplit:
    """Share one job's energy among its spans in flight, instant by instant, inside a window.

    ``ticks`` are ``(t_start_s, t_end_s, energy_j)``: the job's attributed energy per interval (one
    row per tick and host; rows may overlap, e.g. two hosts or two devices with different bounds).
    ``spans`` are ``(t_start_s, t_end_s)`` of one kind (queries, or steps, or epochs). Only energy in
    ``[window_start_s, window_end_s)`` is shared: ticks crossing the window's edges count for the
    part inside (at constant power), and a span crossing them gets only its share inside. With
    ``bucket_s``, waiting energy is also given per bucket (the window's start should then be a
    bucket edge, so every bucket touched lies wholly in the window or at its end).

    Raises ValueError for a tick or span that ends before it starts, or a negative/non-finite energy.
    """
    w0, w1 = window_start_s, window_end_s
    if w1 < w0:
        raise ValueError(f"window ends ({w1}) before it starts ({w0})")
    if bucket_s is not None and not bucket_s > 0:
        raise ValueError(f"bucket_s must be positive, got {bucket_s!r}")
    events: list[tuple[float, int, int]] = []
    # Per tick: (t_start_s, t_end_s, energy_j).
    tick_data: list[tuple[float, float, float]] = []
    inside_j: list[float] = []
    for t0, t1, energy_j in ticks:
        if not (t1 >= t0) or not math.isfinite(energy_j) or energy_j < 0:
            raise ValueError(f"tick ({t0}, {t1}, {energy_j}) must have t_end_s >= t_start_s and finite energy >= 0")
        if energy_j == 0.0:
            continue
        i = len(tick_data)
        if t1 == t0:
            if w0 <= t0 < w1:
                tick_data.append((t0, t1, energy_j))
                events.append((t0, _POINT, i))
                inside_j.append(energy_j)
            continue
        lo, hi = max(t0, w0), min(t1, w1)
        if hi <= lo:
            continue
        tick_data.append((t0, t1, energy_j))
        events.append((lo, _TICK_START, i))
        events.append((hi, _TICK_END, i))
        inside_j.append(_cumulative_j(t0, t1, energy_j, hi) - _cumulative_j(t0, t1, energy_j, lo))
    for i, (s, e) in enumerate(spans):
        if not (e >= s):
            raise ValueError(f"span {i} ends ({e}) before it starts ({s})")
        lo, hi = max(s, w0), min(e, w1)
        if hi > lo:  # a zero-length span, or one outside the window, is never in flight here
            events.append((lo, _SPAN_START, i))
            events.append((hi, _SPAN_END, i))
    span_energy_j = [0.0] * len(spans)
    if not events:
        return EnergySplit(span_energy_j, 0.0, 0.0, {})
    events.sort()
    first_s, last_s = events[0][0], events[-1][0]
    bucket_j: dict[float, float] = {}
    bucket = -math.inf
    if bucket_s is not None:
        bucket = bucket_floor_s(first_s, bucket_s)
        k0, k1 = math.floor(first_s / bucket_s) + 1, math.floor(last_s / bucket_s)
        events.extend((k * bucket_s, _EDGE, 0) for k in range(k0, k1 + 1) if first_s < k * bucket_s < last_s)
        events.sort()

    active: dict[int, float] = {}  # tick index -> its cumulative energy handed out so far
    per_span_j = 0.0  # the running total A: energy each span in flight has received since the window began
    start_total: dict[int, float] = {}
    in_flight = 0
    prev_s = first_s
    for t_s, code, i in events:
        if t_s > prev_s and active:
            segment_j = 0.0
            for j, handed_j in active.items():
                t0, t1, energy_j = tick_data[j]
                now_j = _cumulative_j(t0, t1, energy_j, t_s)
                segment_j += now_j - handed_j
                active[j] = now_j
            if in_flight:
                per_span_j += segment_j / in_flight
            elif segment_j:
                bucket_j[bucket] = bucket_j.get(bucket, 0.0) + segment_j
        prev_s = t_s
        if code == _TICK_END:
            del active[i]
        elif code == _SPAN_END:
            in_flight -= 1
            # A only grows, but keep rounding from ever producing -0.0 or a negative crumb.
            span_energy_j[i] = max(per_span_j - start_total.pop(i), 0.0)
        elif code == _EDGE:
            bucket = t_s
        elif code == _SPAN_START:
            in_flight += 1
            start_total[i] = per_span_j
        elif code == _TICK_START:
            t0, t1, energy_j = tick_data[i]
            active[i] = _cumulative_j(t0, t1, energy_j, t_s)
        else:  # _POINT
            energy_j = tick_data[i][2]
            if in_flight:
                per_span_j += energy_j / in_flight
            else:
                bucket_j[bucket] = bucket_j.get(bucket, 0.0) + energy_j
    waiting_j = math.fsum(bucket_j.values())
    return EnergySplit(span_energy_j, waiting_j, math.fsum(inside_j), bucket_j if bucket_s is not None else {})


def _cumulative_j(t0_s: float, t1_s: float, energy_j: float, t_s: float) -> float:
    """The tick's energy from its start to ``t_s`` at constant power; exactly ``energy_j`` at its end.

    Monotone in ``t_s`` (every operation rounds monotonically), so no segment gets negative energy.
    """
    if t_s >= t1_s:
        return energy_j
    return energy_j * ((t_s - t0_s) / (t1_s - t0_s))
