"""An NVML energy counter's timing, learned from its own readings: refresh period and phase.

Nothing about the hardware's timing is assumed. Polling the counter (the start-up calibration, short
polls when the phase has drifted, every boundary read) brackets its refreshes (``nvml_grid.Change``);
``CounterTiming`` keeps them and from them:

- the **period**, from the changes of uninterrupted polls (``nvml_grid.coarse_period``);
- the **phase** and a **precise period**: every bracket, old or new, is given its refresh number by
  unwrapping from the one before (only when the period is known well enough that the number cannot be
  off by one, or when both are consecutive changes of one poll); the grid through them bounds the
  period to microseconds after a few seconds and places the next refreshes within a fraction of a ms
  (``nvml_grid.Chain.fit``); tick reads use it to extrapolate from the last refresh.

The history is bounded and every new bracket updates the estimate, so the sensor keeps learning while it
runs and drops a model that stops fitting. Until it has learned, callers fall back to what needs no
timing (``CounterTiming.period_s`` is None and ``why_not`` says why).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from itertools import pairwise

from wattwatch.sensors.nvml_grid import (
    DENSE_SHARE,
    GAP_TOLERANCE,
    Chain,
    Change,
    CounterRead,
    PhaseFit,
    coarse_period,
    one_period,
)

# A change seen between reads further apart than this says too little about when the refresh was.
MAX_CHANGE_WIDTH_S = 0.01
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
LOOKAHEAD_S = 30.0
CALIBRATION_MAX_S = 1.0
HISTORY = 128  # refresh brackets kept (the oldest are dropped)
# A poll is aimed at the predicted window of the next refresh while that window is narrower than this
# share of a period (wider: the refresh could come at any time, so the poll starts at once).
AIM_MAX_WIDTH_SHARE = 0.5
READ_MARGIN_S = 1e-5  # how far past a predicted refresh window a tick read waits
# A tick read this close before a refresh waits for it (at most NEAR_REFRESH_S): extrapolating the
# instant power over a whole period is the tick's largest error, waiting a few ms the cheaper cure.
NEAR_REFRESH_S = 0.01
NEAR_REFRESH_SHARE = 0.1


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
        chain = Chain(changes[0][1])
        strikes = 0
        for (before_run, before), (run, change) in pairwise(changes):
            line = chain.line()
            period_s, err_s = line if line is not None and line[1] < prior[1] else prior
            last, n_last = chain.last
            if last is before and run == before_run and one_period(last, change, period_s, DENSE_SHARE * period_s):
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
                chain, strikes = Chain(change), 0
                continue
            if abs(gap_s - m * period_s) > slack_s + GAP_TOLERANCE * period_s:
                strikes += 1
                if strikes >= 2:  # two in a row: the grid moved (or was wrong); follow the new one
                    chain, strikes = Chain(change), 0
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

    def tick_plan(self, now_s: float) -> tuple[bool, float | None]:
        """What a tick read at ``now_s`` needs first, from one look at the grid: whether a calibration poll
        is due (``wants_calibration``), and when a short poll is worth it, the time by which the next
        refresh has surely happened (``refresh_due_s``; None otherwise)."""
        fit = self.fit
        if fit is None:
            return now_s - self.tried_s >= PHASE_MAX_AGE_S, None
        width_s = fit.width_at(now_s)
        trusted = now_s - self.last_seen_s < PHASE_MAX_AGE_S and width_s <= PHASE_MAX_WIDTH_SHARE * fit.period_s
        if trusted and width_s <= PHASE_POLL_WIDTH_SHARE * fit.period_s:
            wants = False
        else:
            wants = self.tried_ok or now_s - self.tried_s >= PHASE_MAX_AGE_S
        until_s = None
        if trusted and width_s > min(PHASE_REFRESH_WIDTH_S, PHASE_MAX_WIDTH_SHARE * fit.period_s):
            until_s = fit.window(fit.last_before(now_s) + 1)[1]
        return wants, until_s

    def wants_calibration(self, now_s: float) -> bool:
        """Whether a calibration poll is due: the phase is not trusted (nothing learned, stale, or its
        window grown wide). Once the period is known that poll is short (one refresh) and due at once;
        a first calibration (up to CALIBRATION_MAX_S), or any after one that saw no refresh, is tried
        once per PHASE_MAX_AGE_S."""
        return self.tick_plan(now_s)[0]

    def refresh_due_s(self, now_s: float) -> float | None:
        """When the phase is trusted but its window has grown past PHASE_REFRESH_WIDTH_S: how long until
        the next refresh has surely happened (a short poll then pins it down); None otherwise."""
        until_s = self.tick_plan(now_s)[1]
        return None if until_s is None else until_s - now_s

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

    def aim(self, now_s: float) -> tuple[float, float] | None:
        """The window ``(lo, hi)`` the learned grid predicts the next refresh after ``now_s`` in (it may
        hold ``now_s``), for a poll aimed at it: polling blindly reads the counter for up to a period
        before anything can change. None while no grid is learned or its window is too wide to aim at
        (over AIM_MAX_WIDTH_SHARE of a period)."""
        fit = self.fit
        if fit is None:
            return None
        lo, hi = fit.window(fit.last_before(now_s) + 1)
        return (lo, hi) if hi - lo < AIM_MAX_WIDTH_SHARE * fit.period_s else None

    def window_s(self, now_s: float) -> float | None:
        """Width of the predicted refresh window nearest ``now_s`` (None: no phase)."""
        fit = self.fit
        return None if fit is None else fit.width_at(now_s)

    # -- predictions (callers check ``trusted`` first) ------------------------------------------------

    def _grid(self) -> PhaseFit:
        fit = self.fit
        assert fit is not None, "check trusted() first"
        return fit

    def trusted_wait_s(self, at_s: float, start_s: float, end_s: float) -> float | None:
        """``wait_before_read_s(start_s, end_s)`` when the phase is ``trusted`` at ``at_s``, else None: a tick
        read's two questions in one look at the grid (asked for every GPU, every tick)."""
        fit = self.fit
        if fit is None or at_s - self.last_seen_s >= PHASE_MAX_AGE_S:
            return None
        period_s = fit.period_s
        if fit.width_at(at_s) > PHASE_MAX_WIDTH_SHARE * period_s:
            return None
        lo, hi = fit.window(fit.last_before(start_s) + 1)
        near_s = min(NEAR_REFRESH_S, NEAR_REFRESH_SHARE * period_s)
        return max(0.0, hi - end_s) + READ_MARGIN_S if lo < end_s + near_s else 0.0

    def wait_before_read_s(self, start_s: float, end_s: float, near: bool = True) -> float:
        """How long to wait before reading again, for a read that ran from ``start_s`` to ``end_s``: past
        the next refresh when it may fall within the read (the value could be from either side of it)
        or (``near``) is due within NEAR_REFRESH_SHARE of a period, at most NEAR_REFRESH_S (a read right
        after a refresh extrapolates least); 0: read as it is."""
        fit = self._grid()
        lo, hi = fit.window(fit.last_before(start_s) + 1)
        near_s = min(NEAR_REFRESH_S, NEAR_REFRESH_SHARE * fit.period_s) if near else 0.0
        # A margin past the window: Unix times near 1.7e9 s carry rounding of ~0.2 µs.
        return max(0.0, hi - end_s) + READ_MARGIN_S if lo < end_s + near_s else 0.0

    def last_refresh_s(self, start_s: float) -> float:
        """The predicted last refresh before a read that began at ``start_s`` (mid-window)."""
        fit = self._grid()
        lo, hi = fit.window(fit.last_before(start_s))
        return (lo + hi) / 2.0

    def tick_since_s(self, before: CounterRead | None, read: CounterRead) -> float | None:
        """For a tick read ``read`` (the one before it ``before``): the time from the predicted last refresh
        to the read's end, at most a period (``last_refresh_s``), or None when the counter changing (or
        not) since ``before`` contradicts the grid (``consistent``). One look at the grid, for every GPU
        every tick."""
        fit = self._grid()
        if before is not None and not _fits(fit, read.raw_mj != before.raw_mj, before, read):
            return None
        lo, hi = fit.window(fit.last_before(read.start_s))
        return min(max(0.0, read.end_s - (lo + hi) / 2.0), fit.period_s)

    def consistent(self, changed: bool, before: CounterRead, after: CounterRead) -> bool:
        """Whether the counter changing (or not) between two reads fits the predicted refreshes."""
        return _fits(self._grid(), changed, before, after)


def _fits(fit: PhaseFit, changed: bool, before: CounterRead, after: CounterRead) -> bool:
    """``CounterTiming.consistent`` on the grid ``fit``."""
    n_far = max(abs(fit.last_before(before.start_s)), abs(fit.last_before(after.end_s))) + 1
    widen = n_far * fit.period_err_s
    lo, hi, period_s = fit.lo_s - widen, fit.hi_s + widen, fit.period_s
    most = math.floor((after.end_s - lo) / period_s) - math.floor((before.start_s - hi) / period_s)
    least = math.floor((after.start_s - hi) / period_s) - math.floor((before.end_s - lo) / period_s)
    return most > 0 if changed else least <= 0
