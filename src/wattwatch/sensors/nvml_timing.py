"""An NVML energy counter's timing, learned from its own readings: refresh period, phase, call latency.

Nothing about the hardware's timing is assumed. ``nvmlDeviceGetTotalEnergyConsumption`` only changes
when the board refreshes it, so two reads a few ms apart that return different values bracket one
refresh: it lies after the first call began and before the second one ended (``Change``). Polling
(the start-up calibration, every boundary read) collects such brackets; from them:

- the **period**: the gaps between consecutive changes seen in one uninterrupted poll are whole
  multiples of it (one, unless a refresh left the value unchanged), so the smallest cluster of gaps
  gives a first estimate and the span of each run over its number of refreshes a better one
  (``coarse_period``);
- the **phase** and a **precise period**: every bracket, old or new, is given its refresh number by
  unwrapping from the one before (only when the period is known well enough that the number cannot be
  off by one); a straight-line fit through them gives the period to microseconds after a few seconds,
  and the brackets, carried to the latest refresh, intersect in a window of a fraction of a ms: where
  the next refreshes fall (``CounterTiming``).

The history is bounded and every new bracket updates the estimate, so the sensor keeps learning while it
runs and drops a model that stops fitting. Until it has learned, callers fall back to what needs no
timing (``CounterTiming.period_s`` is None and ``why_not`` says why).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

# A change seen between reads further apart than this says too little about when the refresh was.
MAX_CHANGE_WIDTH_S = 0.01
# Gaps within this fraction of a period of a whole number of periods count as that number (refresh
# jitter on real boards, call latency); anything further off is an outlier.
GAP_TOLERANCE = 0.2
# A bracket narrower than this share of the period holds one refresh, no more.
DENSE_SHARE = 0.9
# A refresh number is assigned only when the worst-case error of the prediction stays below this
# fraction of a period (so it cannot be off by one).
UNWRAP_MARGIN = 0.4
# The phase is trusted for extrapolating tick reads this long after it was last seen, and when the
# predicted refresh window is narrower than this share of a period.
PHASE_MAX_AGE_S = 60.0
PHASE_MAX_WIDTH_SHARE = 0.25
PHASE_POLL_WIDTH_SHARE = 0.125  # a poll for a fresh refresh is due from this wide on (before trust lapses)
# A short poll for one fresh refresh is worth it once the predicted window has widened past this (the
# period's error grows it with every refresh predicted): each such poll lengthens the span the period
# is fitted over, so they are needed less and less often. A tick read makes one only when the next
# refresh is due within SHORT_POLL_MAX_S, so it never delays a tick by more than that.
PHASE_REFRESH_WIDTH_S = 0.004
SHORT_POLL_MAX_S = 0.012
# The first calibration polls until the phase can be placed this far ahead to within a quarter period
# (so the phase stays trusted for seconds before a refresh poll is needed), or for at most
# CALIBRATION_MAX_S; once the period is known, a poll only needs one fresh refresh.
LOOKAHEAD_S = 10.0
CALIBRATION_MAX_S = 1.0
HISTORY = 128  # refresh brackets kept (the oldest are dropped)
READ_MARGIN_S = 1e-5  # how far past a predicted refresh window a tick read waits
PAIR_EDGE = 16  # brackets at each end of the history whose pairs bound the period


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

    @property
    def uncertainty_s(self) -> float:
        """How far ``at_s`` can be from the refresh, at worst."""
        return max(self.at_s - self.lo_s, self.hi_s - self.at_s)

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


def _one_period(a: Change, b: Change, period_s: float, limit_s: float) -> bool:
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
            return 1 if _one_period(a, b, period_s, limit_s) else None

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


class _Chain:
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
        mean_t = statistics.fmean(c.at_s - (k - n_last) * slope_s for c, k in self.points)
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


class CounterTiming:
    """What one GPU's energy counter does, learned from the brackets that polling sees (module docstring)."""

    def __init__(self) -> None:
        self._changes: deque[tuple[int, Change]] = deque(maxlen=HISTORY)  # (run id, bracket)
        self._run = 0
        self._prior: tuple[float, float] | None = None  # best (period, error) so far: survives history
        self._fit: PhaseFit | None = None
        self._dirty = False
        self.why_not = "the counter has not been polled yet"
        self.last_seen_s = -math.inf  # when a refresh was last bracketed
        self.tried_s = -math.inf  # when calibration was last tried
        self.tried_ok = False  # whether that calibration saw the counter refresh
        self.refreshes_seen = 0
        self.dropped = 0  # models dropped because the reads contradicted them

    # -- learning -----------------------------------------------------------------------------------

    def new_run(self) -> int:
        """Start a run: changes added under the same id were seen by one uninterrupted poll."""
        self._run += 1
        return self._run

    def add(self, change: Change, run: int) -> bool:
        """Learn from one bracketed refresh; False when it is too wide to teach anything."""
        if change.hi_s - change.lo_s > MAX_CHANGE_WIDTH_S:
            return False
        self._changes.append((run, change))
        self.refreshes_seen += 1
        self.last_seen_s = max(self.last_seen_s, change.hi_s)
        self._dirty = True
        return True

    def drop_phase(self, why: str) -> None:
        """The reads contradict the model: forget it all (the period too: it may be what was wrong) and
        relearn from the next calibration."""
        self._changes.clear()
        self._fit = None
        self._prior = None
        self._dirty = False
        self.dropped += 1
        self.tried_s = -math.inf
        self.why_not = why

    def note_no_change(self, seconds: float) -> None:
        """A poll of ``seconds`` saw the counter never change: say so while nothing is learned."""
        if self.period_s is None and not self._changes:
            self.why_not = f"the counter did not change in {seconds:.2f} s of polling"

    def _runs(self) -> list[list[Change]]:
        runs: dict[int, list[Change]] = {}
        for run, change in self._changes:
            runs.setdefault(run, []).append(change)
        return list(runs.values())

    def _rebuild(self) -> None:
        self._dirty = False
        coarse = coarse_period(self._runs())
        if (
            coarse is not None
            and self._prior is not None
            and abs(coarse[0] - self._prior[0]) > 2.0 * (coarse[1] + self._prior[1]) + 0.01 * coarse[0]
        ):
            self._prior = None  # a fresh uninterrupted poll disagrees: the old period is not to be kept
        candidates = [p for p in (coarse, self._prior) if p is not None]
        if not candidates:
            self._fit = None
            self.why_not = (
                "the counter never changed while polled"
                if not self._changes
                else f"saw {len(self._changes)} refresh(es), too few in one poll to tell a period"
            )
            return
        prior = min(candidates, key=lambda p: p[1])
        changes = sorted(self._changes, key=lambda rc: rc[1].at_s)
        chain = _Chain(changes[0][1])
        strikes = 0
        for (before_run, before), (run, change) in pairwise(changes):
            line = chain.line()
            period_s, err_s = line if line is not None and line[1] < prior[1] else prior
            last, n_last = chain.last
            if last is before and run == before_run and _one_period(last, change, period_s, DENSE_SHARE * period_s):
                chain.add(change, n_last + 1)  # the next change of one poll, both brackets narrow: one period
                strikes = 0
                continue
            gap_s = change.at_s - last.at_s
            m = round(gap_s / period_s)
            slack_s = change.uncertainty_s + last.uncertainty_s
            if m < 1:
                continue  # the same refresh seen twice (or a stray): nothing new
            if m * err_s + slack_s >= UNWRAP_MARGIN * period_s:
                # Too long a gap to count its refreshes: start again from here, keeping what was learned.
                prior = (period_s, err_s)
                chain, strikes = _Chain(change), 0
                continue
            if abs(gap_s - m * period_s) > slack_s + GAP_TOLERANCE * period_s:
                strikes += 1
                if strikes >= 2:  # two in a row: the grid moved (or was wrong); follow the new one
                    chain, strikes = _Chain(change), 0
                continue
            strikes = 0
            chain.add(change, n_last + m)
        self._fit = chain.fit(prior)
        if self._prior is None or self._fit.period_err_s <= self._prior[1]:
            self._prior = (self._fit.period_s, self._fit.period_err_s)
        self.why_not = ""

    # -- what it knows ------------------------------------------------------------------------------

    @property
    def fit(self) -> PhaseFit | None:
        """The refresh grid learned so far; None until a period is known."""
        if self._dirty:
            self._rebuild()
        return self._fit

    @property
    def period_s(self) -> float | None:
        """The learned refresh period; None when not learned (``why_not`` says why)."""
        fit = self.fit
        if fit is not None:
            return fit.period_s
        return self._prior[0] if self._prior is not None else None

    def trusted(self, now_s: float) -> bool:
        """Whether the phase places the refreshes around ``now_s`` well enough to extrapolate from."""
        fit = self.fit
        return (
            fit is not None
            and now_s - self.last_seen_s < PHASE_MAX_AGE_S
            and fit.width_at(now_s) <= PHASE_MAX_WIDTH_SHARE * fit.period_s
        )

    def wants_calibration(self, now_s: float) -> bool:
        """Whether a calibration poll is due: the phase is not trusted (nothing learned, stale, or its
        window grown wide). Once the period is known that poll is short (one refresh) and due at once;
        a first calibration (up to CALIBRATION_MAX_S), or any after one that saw no refresh, is tried
        once per PHASE_MAX_AGE_S."""
        fit = self.fit
        if fit is not None and self.trusted(now_s) and fit.width_at(now_s) <= PHASE_POLL_WIDTH_SHARE * fit.period_s:
            return False
        if fit is not None and self.tried_ok:
            return True
        return now_s - self.tried_s >= PHASE_MAX_AGE_S

    def refresh_due_s(self, now_s: float) -> float | None:
        """When the phase is trusted but its window has grown past PHASE_REFRESH_WIDTH_S: how long until
        the next refresh has surely happened (a short poll then pins it down); None otherwise."""
        fit = self.fit
        if fit is None or not self.trusted(now_s):
            return None
        if fit.width_at(now_s) <= min(PHASE_REFRESH_WIDTH_S, PHASE_MAX_WIDTH_SHARE * fit.period_s):
            return None
        return fit.window(fit.last_before(now_s) + 1)[1] - now_s

    def poll_limit_s(self) -> float:
        """How long a calibration poll may run: a few periods once the period is known."""
        known = self.period_s
        return CALIBRATION_MAX_S if known is None else min(CALIBRATION_MAX_S, 2.5 * known)

    def calibrated(self, run: Sequence[Change]) -> bool:
        """Whether a calibration poll that saw ``run`` may stop: with the period known, one fresh bracket
        (the phase, and a longer span for the period); otherwise the run must place a refresh
        LOOKAHEAD_S ahead to within a quarter period."""
        if not run:
            return False
        if self._prior is not None:
            return True
        estimate = coarse_period([run])
        if estimate is None or len(run) < 4:
            return False
        period_s, err_s = estimate
        return LOOKAHEAD_S / period_s * err_s < 0.25 * period_s

    def window_s(self, now_s: float) -> float | None:
        """Width of the predicted refresh window nearest ``now_s`` (None: no phase)."""
        fit = self.fit
        return None if fit is None else fit.width_at(now_s)

    # -- predictions (callers check ``trusted`` first) ------------------------------------------------

    def _grid(self) -> PhaseFit:
        fit = self.fit
        assert fit is not None, "check trusted() first"
        return fit

    def wait_before_read_s(self, start_s: float, end_s: float) -> float:
        """How long to wait before reading again when a refresh may fall within a read that ran from
        ``start_s`` to ``end_s`` (then the value could be from before or after it); 0: it cannot."""
        fit = self._grid()
        lo, hi = fit.window(fit.last_before(start_s) + 1)
        # A margin past the window: Unix times near 1.7e9 s carry rounding of ~0.2 µs.
        return max(0.0, hi - end_s) + READ_MARGIN_S if lo < end_s else 0.0

    def last_refresh_s(self, start_s: float) -> float:
        """The predicted last refresh before a read that began at ``start_s`` (mid-window)."""
        fit = self._grid()
        lo, hi = fit.window(fit.last_before(start_s))
        return (lo + hi) / 2.0

    def consistent(self, changed: bool, before: CounterRead, after: CounterRead) -> bool:
        """Whether the counter changing (or not) between two reads fits the predicted refreshes."""
        fit = self._grid()
        n_far = max(abs(fit.last_before(before.start_s)), abs(fit.last_before(after.end_s))) + 1
        widen = n_far * fit.period_err_s
        lo, hi, period_s = fit.lo_s - widen, fit.hi_s + widen, fit.period_s
        most = math.floor((after.end_s - lo) / period_s) - math.floor((before.start_s - hi) / period_s)
        least = math.floor((after.start_s - hi) / period_s) - math.floor((before.end_s - lo) / period_s)
        return most > 0 if changed else least <= 0
