"""NVML boundary reads: E(t_s) from the energy counter's next update and the power sampled while polling
for it, and the polls themselves (``CounterPoller``: boundary reads and the timing calibration).

The counter refreshes every ``update_period_s``, learned per GPU (``nvml_timing``); at a boundary
``t_s`` the reader polls until the counter moves (at ``t_u``) and records the power at each poll. Its
first poll saw the update before, ``t_p = t_u - update_period_s``, so the counter knows the energy of
[t_p, t_u] exactly; what is estimated is only how that period's energy splits around ``t_s``. The
arithmetic (``pin_boundary``) is pure, so every case is testable without a board. Until a GPU's period
is learned, only what needs no period is used, and the reading is flagged ``period_unlearned``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

from wattwatch.errors import SensorError
from wattwatch.sensors.nvml_device import GpuDevice, NvmlReads
from wattwatch.sensors.nvml_grid import DENSE_SHARE, Change, CounterRead
from wattwatch.sensors.nvml_timing import CALIBRATION_MAX_S

log = logging.getLogger(__name__)

# How long a boundary read polls for the counter to move: this many learned periods, or, while the
# period is not learned, UNLEARNED_WAIT_S (long enough for any refresh period up to half a second).
WAIT_PERIODS = 2.5
UNLEARNED_WAIT_S = 0.6
# Calibration polls this many times as often as boundary reads (it runs rarely and briefly).
CALIBRATION_PACE = 4
# An aimed calibration poll begins this many of its polls before the predicted refresh window.
AIM_MARGIN_POLLS = 2
# ... and polls a predicted window this many times across (never faster than CALIBRATION_PACE's pace).
AIM_POLLS = 8


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
    update_period_s: float | None,
    poll_interval_s: float,
) -> tuple[float, tuple[str, ...]]:
    """E(t_s), given the cumulative ``u_j`` at the counter update ``t_u``; flags ``boundary_unrefined``
    when more than half an update period had to be extrapolated.

    ``held``: the power readings only change with the counter (part-time samples or averages), so
    they lag a load step; then the period is split as a step (``split_period``) instead of integrated.
    ``update_period_s`` None (not learned): the power sampled from ``t_s`` on is integrated back from
    ``t_u``, the one estimate that needs no period, flagged ``period_unlearned``.
    """
    first_t_s, first_p_w = probe.samples[0]
    if update_period_s is None:
        return u_j - integrate_w(probe.samples, t_s, t_u), ("period_unlearned",)
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


@dataclass
class PowerWatch:
    """Tells a live power reading from one held between counter refreshes, from consecutive polls.

    Each poll reads the counter, then the power. A power change between polls k-1 and k happened
    after counter read k-1 and before counter read k+1: if those two read the same value, no refresh
    came in between, so the reading changed on its own (live). A change at a poll whose counter moved
    is what a held reading does (a live one may too, by chance: live wins). With NVML calls that take
    time, a refresh can fall between a poll's counter read and its power read, so comparing a
    poll's counter with the previous one only would call a held reading live.
    """

    polls: list[tuple[int, float]] = field(default_factory=list)  # (raw_mj, power_w), the last three

    def poll(self, raw_mj: int, power_w: float) -> str | None:
        """Take one poll; "live", "held" or None (nothing learned yet)."""
        self.polls = [*self.polls[-2:], (raw_mj, power_w)]
        verdict = None
        if len(self.polls) >= 2:
            (c1, p1), (c2, p2) = self.polls[-2:]
            if p2 != p1 and c2 != c1:
                verdict = "held"
        if len(self.polls) == 3:
            (c0, p0), (c1, p1), (c2, _) = self.polls
            if p1 != p0:
                verdict = "live" if c2 == c0 else verdict or "held"
        return verdict


def learn_power(dev: GpuDevice, verdict: str | None) -> None:
    """Record a PowerWatch verdict on ``dev``: one live sighting settles it; held holds until then."""
    if verdict == "live":
        dev.instant_live = True
    elif verdict == "held" and not dev.instant_live:
        dev.instant_held = True


@dataclass
class _Probe:
    """One device's state while a boundary read polls it."""

    dev: GpuDevice
    run: int
    last: CounterRead | None = None
    boundary: BoundaryProbe = field(default_factory=BoundaryProbe)
    power: PowerWatch = field(default_factory=PowerWatch)
    deadline_s: float = 0.0  # give up after a round that began past this


@dataclass(frozen=True)
class _Pinned:
    """A boundary read's polls, kept for the next one: a boundary at ``t_s`` pinned to the refresh at
    ``t_u`` (bracketed from ``lo_s`` on), the cumulative ``u_j`` there, and the power it sampled."""

    t_s: float
    lo_s: float
    t_u: float
    u_j: float
    boundary: BoundaryProbe
    held: bool
    period_s: float | None

    def covers(self, t_s: float) -> bool:
        """Whether a boundary at ``t_s`` lies where these polls saw it: after this one's boundary, before
        the refresh they pinned it to (so polling again would start past that refresh, too late)."""
        return self.t_s <= t_s <= self.lo_s


class CounterPoller:
    """Polls GPUs' energy counters: boundary reads (``read_at``) and timing calibrations.

    Each counter value goes into the GPU's bookkeeping (``NvmlReads.observe``: resets); ``fail`` drops
    a GPU from this poll when a read raises (the sensor marks it lost or warns once);
    ``between_polls`` runs after each round of polls (the sensor keeps integrating GPUs without a
    counter, whose own thread waits for the poll to end).
    """

    def __init__(
        self,
        reads: NvmlReads,
        sleep: Callable[[float], None],
        poll_interval_s: float,
        fail: Callable[[GpuDevice, SensorError], None],
        between_polls: Callable[[], None] = lambda: None,
    ) -> None:
        self.reads = reads
        self.sleep = sleep
        self.poll_interval_s = poll_interval_s
        self.fail = fail
        self.between_polls = between_polls
        # Polls are jittered so their brackets fall at varied offsets around the refreshes (a fixed pace
        # that divides the period would bracket every refresh the same way, and teach no more than one).
        self._rng = random.Random(0x7131)
        # Per GPU, the last boundary read's polls: a boundary right behind it (two jobs ending together)
        # is pinned from them, as that read would have pinned it.
        self._pinned: dict[str, _Pinned] = {}

    def _pause(self, round_start_s: float, interval_s: float) -> None:
        """Wait until the next round of polls: ``interval_s`` on average after this one began, or at
        once when the calls themselves took that long (slow calls already widen the brackets)."""
        spent_s = self.reads.clock() - round_start_s
        self.sleep(max(0.0, interval_s * (0.5 + self._rng.random()) - spent_s))

    def calibrate(
        self,
        devs: list[GpuDevice],
        done: Callable[[GpuDevice], None] = lambda dev: None,
        limit_s: float | None = None,
    ) -> None:
        """Poll the counters of ``devs`` (all in one loop, CALIBRATION_PACE times as often as a boundary
        read polls: the brackets' width is what the period's precision comes down to; for at most
        ``limit_s`` or else ``CounterTiming.poll_limit_s``) until each has shown enough refreshes to
        place its phase (see ``CounterTiming.calibrated``); the instant power is read too, to learn
        whether it is live. ``done(dev)`` runs as soon as a device is calibrated (a tick read then needs
        the least extrapolation: the counter has just refreshed). Only a full calibration (no
        ``limit_s``) counts as tried (``CounterTiming.tried_s``). A GPU whose grid is learned is polled
        only from just before the window it predicts the next refresh in (``CounterTiming.aim_s``): the
        wait until then is a sleep, not reads."""
        if not devs:
            return
        clock = self.reads.clock
        start_s = clock()
        pending = {d.key: d for d in devs}
        interval_s = self.poll_interval_s / CALIBRATION_PACE
        # Each GPU's polls begin just before the window its learned grid predicts the next refresh in
        # (at once without one): polling blindly until then reads the counter dozens of times for nothing.
        # Within a wide predicted window, fewer polls: AIM_POLLS across it bracket the refresh to a fraction
        # of the window (which is all the phase is then known to), at most CALIBRATION_PACE's pace.
        windows = {d.key: d.timing.aim(start_s) for d in devs}
        paces = {k: interval_s if w is None else max(interval_s, (w[1] - w[0]) / AIM_POLLS) for k, w in windows.items()}
        aims = {
            k: start_s if w is None else max(start_s, w[0] - AIM_MARGIN_POLLS * paces[k]) for k, w in windows.items()
        }
        limits = {d.key: d.timing.poll_limit_s() + aims[d.key] - start_s if limit_s is None else limit_s for d in devs}
        for key in [k for k in pending if aims[k] - start_s >= limits[k]]:
            del pending[key]  # a short poll whose refresh is not due within its limit
        runs = {d.key: d.timing.new_run() for d in devs}
        seen: dict[str, list[Change]] = {d.key: [] for d in devs}
        last: dict[str, CounterRead] = {}
        watches = {d.key: PowerWatch() for d in devs}
        if limit_s is None:
            for dev in devs:
                dev.timing.tried_s = start_s
        polls_left = int(CALIBRATION_MAX_S / interval_s) + 2  # a stuck clock cannot hang us
        while pending and polls_left > 0:
            round_start_s = clock()
            jitter = 0.5 + self._rng.random()  # see _pause
            for key, dev in list(pending.items()):
                if aims[key] > round_start_s:
                    continue
                aims[key] = round_start_s + paces[key] * jitter  # its next poll
                # The power only until it is known to be live: each read of it lengthens the poll, and
                # so the counter's brackets (a held reading never proves itself, so it is read on).
                watch_power = dev.has_instant and not dev.instant_live
                try:
                    read = self.reads.counter(dev)
                    self.reads.observe(dev, read.raw_mj, read.end_s)
                    power_w = self.reads.instant_power_w(dev) if watch_power else None
                except SensorError as exc:
                    self.fail(dev, exc)
                    del pending[key]
                    continue
                if power_w is not None:
                    learn_power(dev, watches[key].poll(read.raw_mj, power_w))
                before = last.get(key)
                last[key] = read
                window = windows[key]
                if window is not None and read.start_s > window[1] and (before is None or read.raw_mj == before.raw_mj):
                    # Past the predicted window with no refresh seen: it came just before the first poll
                    # (which began inside the window). Sleep until the next window instead of polling a
                    # period through; a poll that may not run that long ends here.
                    windows[key] = window = dev.timing.aim(read.end_s)
                    if window is not None:
                        if window[0] - start_s >= limits[key]:
                            del pending[key]
                            continue
                        aims[key] = max(aims[key], window[0] - AIM_MARGIN_POLLS * paces[key])
                if before is None:
                    continue
                # Only a rise is a refresh: a counter that went down was reset, at no refresh instant.
                if read.raw_mj > before.raw_mj:
                    change = Change.between(before, read)
                    if dev.timing.add(change, runs[key]):
                        seen[key].append(change)
                    if dev.timing.calibrated(seen[key]):
                        del pending[key]
                        done(dev)
            polls_left -= 1
            self.between_polls()
            now_s = clock()
            for key in [k for k in pending if now_s - start_s >= limits[k]]:
                del pending[key]
            if not pending:
                break
            # Until the next GPU's poll is due (at once when the calls took that long already).
            self.sleep(max(0.0, min(aims[k] for k in pending) - now_s))
        elapsed_s = clock() - start_s
        for dev in devs:
            if limit_s is None:
                dev.timing.tried_ok = bool(seen[dev.key])
            if not seen[dev.key]:
                dev.timing.note_no_change(elapsed_s)
                log.debug("%s: the counter did not refresh in %.2f s of calibration", dev.key, elapsed_s)

    def boundary(self, devs: list[GpuDevice], t_s: float) -> dict[str, tuple[float, tuple[str, ...]]]:
        """E(t_s) and flags per device in ``devs`` (counter devices): see ``NvmlSensor.read_at``.

        A device is pinned at the first refresh after ``t_s`` whose bracket is narrower than its period
        (a wider one, after a poll held up on a loaded host, may hold several refreshes, and the value is
        as of the last: its time is not known); it is given up on after a round that began a wait past
        ``t_s`` or past such a wide bracket, so a thread held up longer than the wait still polls again.
        """
        clock = self.reads.clock
        done: dict[str, tuple[float, tuple[str, ...]]] = {}
        for dev in devs:
            last = self._pinned.get(dev.key)
            if last is not None and last.covers(t_s):
                # The refresh after t_s passed while the last read polled: polling now would start too late
                # and extrapolate back over it, across whatever load changed meanwhile.
                done[dev.key] = pin_boundary(
                    last.boundary, last.u_j, t_s, last.t_u, last.held, last.period_s, self.poll_interval_s
                )
        devs = [d for d in devs if d.key not in done]
        probes = {d.key: _Probe(d, d.timing.new_run()) for d in devs}
        start_s = clock()
        waits: dict[str, float] = {}
        for dev in devs:
            period_s = dev.timing.period_s
            waits[dev.key] = UNLEARNED_WAIT_S if period_s is None else WAIT_PERIODS * period_s
            probes[dev.key].deadline_s = max(start_s, t_s) + waits[dev.key]
        # Also bound the number of polls, so a clock that does not move cannot hang the agent.
        polls_left = 4 * int(max(waits.values(), default=0.0) / self.poll_interval_s) + 20
        while probes:
            round_start_s = clock()
            for key, probe in list(probes.items()):
                try:
                    change = self._poll(probe)
                except SensorError as exc:
                    self.fail(probe.dev, exc)
                    del probes[key]
                    continue
                if change is None or change.lo_s < t_s:
                    continue
                period_s = probe.dev.timing.period_s
                if period_s is None or change.hi_s - change.lo_s < DENSE_SHARE * period_s:
                    done[key] = self._pin(probe, t_s, change)
                    del probes[key]
                else:
                    probe.deadline_s = change.hi_s + waits[key]  # wait for the next, narrow one
            if not probes:
                break
            polls_left -= 1
            self.between_polls()
            for key, probe in list(probes.items()):
                if polls_left <= 0 or round_start_s >= probe.deadline_s:
                    log.debug("%s: counter did not move within %.2f s of a boundary", key, waits[key])
                    flags: tuple[str, ...] = ("boundary_unrefined",)
                    if probe.dev.timing.period_s is None:
                        probe.dev.timing.note_no_change(clock() - start_s)
                        flags += ("period_unlearned",)
                    done[key] = (probe.dev.cumulative_j, flags)
                    del probes[key]
            if not probes:
                break
            self._pause(round_start_s, self.poll_interval_s)
        return done

    def _poll(self, probe: _Probe) -> Change | None:
        """One poll of one device: counter, then power; the refresh bracketed since the last poll, if any."""
        dev = probe.dev
        read = self.reads.counter(dev)
        self.reads.observe(dev, read.raw_mj, read.start_s)
        power_w, power_t_s = self.reads.timed_power_w(dev)
        last, probe.last = probe.last, read
        moved = last is not None and read.raw_mj > last.raw_mj  # a drop is a reset, not a refresh
        verdict = probe.power.poll(read.raw_mj, power_w)
        if verdict == "held":
            probe.boundary.changed_with_counter = True
        learn_power(dev, verdict)
        probe.boundary.samples.append((power_t_s, power_w))
        if probe.boundary.first_j is None:
            probe.boundary.first_j, probe.boundary.first_t_s = dev.cumulative_j, read.start_s
        if not moved:
            return None
        assert last is not None
        change = Change.between(last, read)
        dev.timing.add(change, probe.run)
        return change

    def _pin(self, probe: _Probe, t_s: float, change: Change) -> tuple[float, tuple[str, ...]]:
        """E(t_s) from the counter update ``change`` and the power sampled while polling; the polls are
        kept for a boundary that follows before that update (``_Pinned``).

        When the polls were held up for over a period (a loaded host), the power between them is not
        known: E(t_s) is then taken from the first poll instead, whose value is as of the refresh the
        learned phase places before it, plus its power for the time from there to ``t_s`` (under a
        period); without a trusted phase the estimate is flagged ``boundary_unrefined``.
        """
        dev = probe.dev
        pinned = _Pinned(
            t_s=t_s,
            lo_s=change.lo_s,
            t_u=change.at_s,
            u_j=dev.cumulative_j,
            boundary=probe.boundary,
            held=not dev.instant_live and dev.instant_held,
            period_s=dev.timing.period_s,
        )
        estimate = pin_boundary(
            pinned.boundary, pinned.u_j, t_s, pinned.t_u, pinned.held, pinned.period_s, self.poll_interval_s
        )
        samples, first_j, period_s = probe.boundary.samples, probe.boundary.first_j, pinned.period_s
        held_up = period_s is not None and any(b[0] - a[0] > period_s for a, b in pairwise(samples))
        if held_up:
            # Polls held up past a refresh (a loaded host) did not see the power between them: a boundary
            # right behind this one is better pinned by polls of its own than from these.
            self._pinned.pop(dev.key, None)
        else:
            self._pinned[dev.key] = pinned
        if not held_up or first_j is None:
            return estimate
        first_t_s, first_w = probe.boundary.first_t_s, samples[0][1]
        timing = dev.timing
        # (Not when the first poll may straddle a refresh: its value could be as of either.)
        if timing.trusted(first_t_s) and timing.wait_before_read_s(first_t_s, first_t_s, near=False) == 0.0:
            return first_j + first_w * (t_s - timing.last_refresh_s(first_t_s)), ()
        return estimate[0], ("boundary_unrefined",)
