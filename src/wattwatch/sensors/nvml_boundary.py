"""The arithmetic of an NVML boundary read: E(t_s) from the energy counter's next update and the power
sampled while polling for it. Pure functions, so every case is testable without a board.

The counter refreshes every ``update_period_s`` (100 ms on H100); at a boundary ``t_s`` the reader polls
until the counter moves (at ``t_u``) and records the power at each poll. Its first poll saw the update
before, ``t_p = t_u - update_period_s``, so the counter knows the energy of [t_p, t_u] exactly; what is
estimated is only how that period's energy splits around ``t_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise


@dataclass
class BoundaryProbe:
    """What a boundary read gathered from one GPU while polling."""

    first_j: float | None = None  # cumulative J at the first poll (the counter's update before it)
    first_t_s: float = 0.0
    samples: list[tuple[float, float]] = field(default_factory=list)  # (t_s, power_w) at each poll
    changed_with_counter: bool = False  # the power reading changed at the poll that saw the counter move


def pin_boundary(
    probe: BoundaryProbe,
    u_j: float,
    t_s: float,
    t_u: float,
    held: bool,
    update_period_s: float,
    poll_interval_s: float,
) -> tuple[float, tuple[str, ...]]:
    """E(t_s), given the cumulative ``u_j`` at the counter update ``t_u``; flags ``boundary_unrefined``
    when more than half an update period had to be extrapolated.

    ``held``: the power readings only change with the counter (part-time samples or averages), so
    they lag a load step; then the period is split as a step (``split_period``) instead of integrated.
    """
    first_t_s, first_p_w = probe.samples[0]
    t_p = t_u - update_period_s
    if held and probe.first_j is not None and first_t_s < t_u:
        if t_p <= t_s <= first_t_s:
            return split_period(probe, u_j, t_s, t_u, update_period_s), ()
        if t_s < t_p:
            # The first poll came just after the update following t_s: step back from that update at
            # the first reading, a sample of the power right before it (not the later, stale ones).
            unpinned = t_p - t_s > update_period_s / 2
            return probe.first_j - first_p_w * (t_p - t_s), ("boundary_unrefined",) if unpinned else ()
    if first_t_s - t_s <= poll_interval_s:
        # Polling began at the boundary: the samples cover [t_s, t_u].
        return u_j - integrate_w(probe.samples, t_s, t_u), ()
    # We looked late, so [t_s, first poll] was not sampled, but the counter knows the energy of
    # [t_p, first poll] exactly; if t_s lies in it, only its split around t_s is estimated.
    sampled_j = integrate_w(probe.samples, first_t_s, t_u)
    first_j = u_j if probe.first_j is None else probe.first_j
    gap_j = max(0.0, u_j - first_j - sampled_j)
    if t_p <= t_s < first_t_s:
        # The nearest power sample, capped by what the counter says that stretch used (measured
        # better than splitting it evenly, which smears a training dip over the whole window).
        before_j = min(gap_j, first_p_w * (first_t_s - t_s))
        return u_j - sampled_j - before_j, ()
    # t_s is before that update too: extrapolate the first power sample, and say so when that
    # covers more than half an update period.
    unpinned = first_t_s - t_s > update_period_s / 2
    return u_j - integrate_w(probe.samples, t_s, t_u), ("boundary_unrefined",) if unpinned else ()


def split_period(probe: BoundaryProbe, u_j: float, t_s: float, t_u: float, update_period_s: float) -> float:
    """E(t_s) when the power readings are not live (held part-time samples, or averages).

    Such a reading lags: through a load step at the boundary it still shows the power before it,
    so integrating it would put the step's energy on the wrong side. Instead split the exact energy
    of the refresh period holding ``t_s`` (the counter's [t_p, t_u]) as a step at ``t_s`` from the
    power before it (the first reading, taken before ``t_u``) to the power after it (the reading
    at ``t_u``, which covers the end of that period). Exact for steady power, bounded by the
    period's energy whatever happens.
    """
    assert probe.first_j is not None  # checked by the caller
    t_p = t_u - update_period_s
    before_s, after_s = max(0.0, t_s - t_p), max(0.0, t_u - t_s)
    before_w, after_w = probe.samples[0][1] * before_s, probe.samples[-1][1] * after_s
    total = before_w + after_w
    fraction = before_w / total if total > 0 else before_s / max(before_s + after_s, 1e-9)
    return probe.first_j + (u_j - probe.first_j) * fraction


def integrate_w(samples: list[tuple[float, float]], a_s: float, b_s: float) -> float:
    """Integral (J) of power over ``[a_s, b_s]`` from (t_s, power_w) samples: linear between samples,
    held constant outside them."""
    if b_s <= a_s or not samples:
        return 0.0
    total = 0.0
    first_t, first_p = samples[0]
    if a_s < first_t:
        total += first_p * (min(b_s, first_t) - a_s)
    for (t0, p0), (t1, p1) in pairwise(samples):
        lo, hi = max(a_s, t0), min(b_s, t1)
        if hi <= lo or t1 <= t0:
            continue
        p_lo = p0 + (p1 - p0) * (lo - t0) / (t1 - t0)
        p_hi = p0 + (p1 - p0) * (hi - t0) / (t1 - t0)
        total += (p_lo + p_hi) / 2.0 * (hi - lo)
    last_t, last_p = samples[-1]
    if b_s > last_t:
        total += last_p * (b_s - max(a_s, last_t))
    return total
