"""The refresh grid of an NVML energy counter, from brackets of its refreshes: pure arithmetic.

``nvmlDeviceGetTotalEnergyConsumption`` only changes when the board refreshes it, so two reads a few
ms apart that return different values bracket one refresh: it lies after the first call began and
before the second one ended (``Change``). From such brackets:

- ``coarse_period``: the period from the changes of uninterrupted polls, where consecutive changes are
  one period apart when their brackets are narrower than a period, and whole multiples of it otherwise;
- ``Chain``: brackets numbered on one grid; its ``fit`` bounds the period (by the pairs of early and
  late brackets, the end brackets and what was known before) and intersects all brackets, carried to
  the latest, in a window of a fraction of a ms (``PhaseFit``): where the next refreshes fall.

Every bound is a worst case (the refresh is somewhere in its bracket), so what the fit claims holds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

# Gaps within this fraction of a period of a whole number of periods count as that number (refresh
# jitter on real boards, call latency); anything further off is an outlier.
GAP_TOLERANCE = 0.2
# A bracket narrower than this share of the period holds one refresh, no more.
DENSE_SHARE = 0.9
PAIR_EDGE = 16  # brackets at each end of a chain whose pairs bound the period


@dataclass(frozen=True)
class CounterRead:
    """One read of the counter: its value and the clock just before and just after the NVML call."""

    raw_mj: int
    start_s: float
    end_s: float

    @property
    def mid_s(self) -> float:
        """Best guess of the instant the value is as of (NVML does not say)."""
        return (self.start_s + self.end_s) / 2.0


@dataclass(frozen=True)
class Change:
    """The counter refreshed in ``(lo_s, hi_s]``; ``at_s`` is the best guess of when."""

    lo_s: float
    hi_s: float
    at_s: float
    # How far ``at_s`` can be from the refresh, at worst. Computed once: every refit of the timing model
    # reads it for every bracket it keeps, several times.
    uncertainty_s: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "uncertainty_s", max(self.at_s - self.lo_s, self.hi_s - self.at_s))

    @classmethod
    def between(cls, before: CounterRead, after: CounterRead) -> Change:
        """The refresh between a read that still saw the old value and one that saw the new value."""
        return cls(before.start_s, after.end_s, (before.mid_s + after.mid_s) / 2.0)


def _telescope(runs: list[list[Change]], step: Callable[[Change, Change], int | None]) -> tuple[float, float, int]:
    """(period, worst-case error, refreshes counted) from the pieces of ``runs`` whose gaps ``step``
    counts (refreshes between two consecutive changes; None splits the run there). A piece's span has
    only the error of its two end brackets, so long pieces give precise periods."""
    span_s = err_s = 0.0
    count = 0
    for run in runs:
        first = last = run[0]
        k = 0
        for a, b in [*pairwise(run), (run[-1], None)]:
            m = None if b is None else step(a, b)
            if m is not None and b is not None:
                k, last = k + m, b
                continue
            if k:
                span_s, count = span_s + last.at_s - first.at_s, count + k
                err_s += first.uncertainty_s + last.uncertainty_s
            first = last = b if b is not None else a
            k = 0
    return (span_s / count, err_s / count, count) if count else (math.nan, math.inf, 0)


def one_period(a: Change, b: Change, period_s: float, limit_s: float) -> bool:
    """Whether consecutive changes ``a`` and ``b`` of one poll are one refresh apart: both brackets hold
    one refresh (narrower than ``limit_s``), and the gap is one ``period_s`` within them (a refresh
    that left the value unchanged would make it two)."""
    narrow = max(a.hi_s - a.lo_s, b.hi_s - b.lo_s) < limit_s
    slack_s = a.uncertainty_s + b.uncertainty_s + GAP_TOLERANCE * period_s
    return narrow and abs(b.at_s - a.at_s - period_s) <= slack_s


def coarse_period(polled: Iterable[Sequence[Change]]) -> tuple[float, float] | None:
    """(period, worst-case error) from runs of changes seen in uninterrupted polls; None with fewer than
    two gaps that can be counted.

    Between two consecutive changes of a poll the reads saw no change but in the second one's
    bracket; when both brackets are narrower than a period, each holds one refresh and exactly one
    period lies between them: such gaps count as one period each (the period that decides "narrower"
    is iterated from the median gap). Where the brackets are wider (polls slower than the period),
    gaps are whole multiples of the period: the median of the gaps, lowered to the median of the
    smaller ones while enough of them are clearly shorter (refreshes that left the value unchanged make
    a few gaps two periods long), is the base, and each gap counts as the nearest multiple of it (one
    that is no multiple of it splits its run).
    """
    runs: list[list[Change]] = [list(run) for run in polled if len(run) >= 2]
    gaps = [b.at_s - a.at_s for run in runs for a, b in pairwise(run)]
    if len(gaps) < 2:
        return None
    period_s = statistics.median(gaps)
    for _ in range(6):
        if not period_s > 0:
            break
        limit_s = DENSE_SHARE * period_s

        def one(a: Change, b: Change, limit_s: float = limit_s, period_s: float = period_s) -> int | None:
            return 1 if one_period(a, b, period_s, limit_s) else None

        dense_s, dense_err_s, count = _telescope(runs, one)
        if count < 2:
            break
        if abs(dense_s - period_s) <= 1e-9 * period_s or dense_s * DENSE_SHARE >= limit_s:
            return dense_s, dense_err_s  # every bracket counted is narrower than the period found
        period_s = dense_s
    resolved = [
        b.at_s - a.at_s
        for run in runs
        for a, b in pairwise(run)
        if b.at_s - a.at_s > 2.0 * (a.uncertainty_s + b.uncertainty_s)
    ]
    if len(resolved) < 2:
        return None
    base = statistics.median(resolved)
    while True:
        smaller = [g for g in resolved if g < 0.75 * base]
        if len(smaller) < max(2, len(resolved) // 4):
            break
        base = statistics.median(smaller)

    def multiple(a: Change, b: Change) -> int | None:
        m = round((b.at_s - a.at_s) / base)
        fits = abs(b.at_s - a.at_s - m * base) <= GAP_TOLERANCE * base + a.uncertainty_s + b.uncertainty_s
        return m if m >= 1 and fits else None

    period_s, err_s, count = _telescope(runs, multiple)
    return (period_s, err_s) if count >= 2 else None


@dataclass(frozen=True)
class PhaseFit:
    """The refresh grid: refresh ``n`` (0 = the latest seen) lies in ``window(n)``."""

    period_s: float
    period_err_s: float  # worst-case error of period_s
    lo_s: float  # refresh 0 lies in (lo_s, hi_s]
    hi_s: float
    jitter_s: float  # how far refreshes strayed from the grid beyond their brackets
    refreshes: int  # brackets in the fit
    span_s: float  # time between the first and the last of them

    def window(self, n: int) -> tuple[float, float]:
        """Where refresh ``n`` (relative to the latest seen) lies, widened by the period's error."""
        widen = abs(n) * self.period_err_s
        return self.lo_s + n * self.period_s - widen, self.hi_s + n * self.period_s + widen

    def last_before(self, t_s: float) -> int:
        """The number of the last refresh surely at or before ``t_s``."""
        # window(n)[1] = hi_s + n * period_s + |n| * period_err_s, increasing in n: solve it per sign of n.
        slope_s = self.period_s + (self.period_err_s if t_s >= self.hi_s else -self.period_err_s)
        return math.floor((t_s - self.hi_s) / max(slope_s, 1e-9))

    def width_at(self, t_s: float) -> float:
        """Width of the window of the refresh nearest ``t_s``."""
        lo, hi = self.window(round((t_s - (self.lo_s + self.hi_s) / 2.0) / self.period_s))
        return hi - lo


class Chain:
    """Brackets with their refresh numbers and a running least-squares line through them."""

    def __init__(self, first: Change) -> None:
        self.points: list[tuple[Change, int]] = [(first, 0)]
        self._t0 = first.at_s
        self._sums = [1.0, 0.0, 0.0, 0.0, 0.0]  # N, Σn, Σn², Σx, Σnx (x: at_s - t0)

    def add(self, change: Change, n: int) -> None:
        self.points.append((change, n))
        x = change.at_s - self._t0
        for i, v in enumerate((1.0, n, n * n, x, n * x)):
            self._sums[i] += v

    @property
    def last(self) -> tuple[Change, int]:
        return self.points[-1]

    def line(self) -> tuple[float, float] | None:
        """(period, error bound from the end brackets) of the line, or None for a single refresh."""
        (first, n0), (last, n1) = self.points[0], self.points[-1]
        if n1 == n0:
            return None
        n, sn, snn, sx, snx = self._sums
        period_s = (n * snx - sn * sx) / (n * snn - sn * sn)
        return period_s, (first.uncertainty_s + last.uncertainty_s) / (n1 - n0)

    def period_bounds(self, jitter_s: float) -> tuple[float, float] | None:
        """The periods that every pair of an early and a late bracket allows (widened by ``jitter_s``).

        A refresh in (lo_i, hi_i] and one ``dn`` refreshes later in (lo_j, hi_j] bound the period to
        [(lo_j - hi_i) / dn, (hi_j - lo_i) / dn]; over many pairs, whose brackets sit at different offsets
        around their refreshes (the polls are jittered), the bounds close in far tighter than those of
        the two end brackets alone. Only pairs among the first and last PAIR_EDGE brackets are used (the
        far ones bound it best; leaving pairs out only widens the bounds). None: empty or no span.
        """
        head, tail = self.points[:PAIR_EDGE], self.points[-PAIR_EDGE:]
        p_lo, p_hi = -math.inf, math.inf
        for ci, ni in head:
            for cj, nj in tail:
                if nj > ni:
                    p_lo = max(p_lo, (cj.lo_s - ci.hi_s - 2.0 * jitter_s) / (nj - ni))
                    p_hi = min(p_hi, (cj.hi_s - ci.lo_s + 2.0 * jitter_s) / (nj - ni))
        return (p_lo, p_hi) if p_lo < p_hi and math.isfinite(p_lo) and math.isfinite(p_hi) else None

    def fit(self, prior: tuple[float, float]) -> PhaseFit:
        """The grid through the chain. Its period is the middle of what every bound that holds at worst
        leaves: ``prior`` (period, error), the end brackets' around the least-squares slope, the pairs'
        (``period_bounds``); its error is half the width of that."""
        line = self.line()
        n, sn, snn, sx, snx = self._sums
        slope_s = (n * snx - sn * sx) / (n * snn - sn * sn) if line is not None else prior[0]
        last, n_last = self.last
        # Intercept of the line with this slope through the brackets' mean, then the excess residual.
        mean_t = statistics.fmean([c.at_s - (k - n_last) * slope_s for c, k in self.points])  # a list: no len() miss
        jitter_s = max(
            max(0.0, abs(c.at_s - (k - n_last) * slope_s - mean_t) - c.uncertainty_s) for c, k in self.points
        )
        bounds = [(prior[0] - prior[1], prior[0] + prior[1])]
        if line is not None:
            first, n_first = self.points[0]
            end_err_s = (first.uncertainty_s + last.uncertainty_s + 2.0 * jitter_s) / (n_last - n_first)
            bounds.append((slope_s - end_err_s, slope_s + end_err_s))
        pairs = self.period_bounds(jitter_s)
        if pairs is not None:
            bounds.append(pairs)
        p_lo, p_hi = max(b[0] for b in bounds), min(b[1] for b in bounds)
        if not p_lo <= p_hi:  # the bounds disagree (refreshes off their grid): keep to the prior
            p_lo, p_hi = bounds[0]
        # The middle of what every bound allows: the least worst-case error (a slope through bracket
        # middles is pulled by where in its bracket each refresh happened to fall).
        period_s, err_s = (p_lo + p_hi) / 2.0, (p_hi - p_lo) / 2.0
        lo_s, hi_s = -math.inf, math.inf
        for c, n in self.points:  # every bracket, carried to the latest refresh
            shift, widen = (n_last - n) * period_s, (n_last - n) * err_s + jitter_s
            lo_s, hi_s = max(lo_s, c.lo_s + shift - widen), min(hi_s, c.hi_s + shift + widen)
        if not lo_s < hi_s:
            spread = max(c.uncertainty_s for c, _ in self.points) + jitter_s
            lo_s, hi_s = mean_t - spread, mean_t + spread
        first, _ = self.points[0]
        return PhaseFit(period_s, err_s, lo_s, hi_s, jitter_s, len(self.points), last.at_s - first.at_s)
