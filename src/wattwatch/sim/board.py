"""One simulated board: its activity timeline (the truth), per-process utilisation and fault state.

Power over time is the concatenation of activity profiles (``profiles``), each starting where the
last one ends, so the exact energy over any window is a sum over segments; the fleet (``fleet``) turns
it into what NVML reports.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from wattwatch.sim.flaws import Flaws
from wattwatch.sim.profiles import KIND_CODE, Idle, Profile, hash_key, make_profile, mix64, pick


@dataclass
class _Segment:
    start_s: float
    kind: str
    pids: frozenset[int]
    profile: Profile


class Board:
    """One board's activity timeline, per-process utilisation and fault state."""

    def __init__(self, seed: int, index: int, limit_mw: int, period_s: float, flaws: Flaws | None = None) -> None:
        self.index = index
        self.board_key = hash_key(seed, index)
        # The counter and power readings refresh every period_s (the generation's), unless the flaws draw
        # this board a period of its own.
        self.refresh_period_s = period_s if flaws is None else flaws.refresh_period_for(self.board_key, period_s)
        self.limit_mw = limit_mw
        # The first segment is open-ended to the past, on the absolute slot grid, so that the truth does
        # not depend on when the fleet object was created (a replay in another process gets the same joules).
        first_profile = Idle(hash_key(self.board_key, 0), 0.0, self.board_key, limit_mw)
        self.segments: list[_Segment] = [_Segment(-math.inf, "idle", frozenset(), first_profile)]
        self.starts: list[float] = [-math.inf]
        # closed_j[s]: energy from the first change (start of segment 1) to the start of segment s >= 1,
        # so a counter read costs O(log segments) however long the fleet has run.
        self.closed_j: list[float] = [0.0]
        self.profiles_made = 1
        self.observed_s = -math.inf  # latest instant NVML reported on; history before it is fixed
        self.phase_fraction = pick(mix64(self.board_key ^ 0xFA5E), 0, 0, 999) / 1000
        h1, h2 = mix64(self.board_key ^ 0x0D1D), mix64(self.board_key ^ 0x0D1E)
        hex32 = f"{h1:016x}{h2:016x}"
        self.uuid = f"GPU-{hex32[:8]}-{hex32[8:12]}-{hex32[12:16]}-{hex32[16:20]}-{hex32[20:]}"
        self.lost = False
        self.counter_supported = True
        self.resets_s: list[float] = []
        # Per-process SM utilisation (percent), piecewise constant: pid -> (change times, values).
        self.proc_util: dict[int, tuple[list[float], list[float]]] = {}
        # When each process first ran here (NVML lists it a process-delay later).
        self.first_active_s: dict[int, float] = {}

    def note_active(self, pid: int, t_s: float) -> None:
        """Process ``pid`` runs on this board from ``t_s`` (it may have run earlier: the earliest counts)."""
        self.first_active_s[pid] = min(t_s, self.first_active_s.get(pid, math.inf))

    def segment_at(self, t_s: float) -> int:
        """Index of the activity segment holding ``t_s``."""
        return bisect_right(self.starts, t_s) - 1

    def energy_j(self, t0_s: float, t1_s: float) -> float:
        """Exact integral over ``[t0_s, t1_s]``, summed segment by segment (bit-identical in a replay)."""
        total = 0.0
        s = self.segment_at(t0_s)
        while s < len(self.segments) and self.starts[s] < t1_s:
            seg = self.segments[s]
            end = self.starts[s + 1] if s + 1 < len(self.segments) else math.inf
            lo, hi = max(t0_s, seg.start_s), min(t1_s, end)
            if hi > lo:
                total += seg.profile.energy_j(lo, hi)
            s += 1
        return total

    def _since_first_change_j(self, s: int, t_s: float) -> float:
        seg = self.segments[s]
        if s == 0:
            return -seg.profile.energy_j(t_s, self.starts[1])
        return self.closed_j[s] + seg.profile.energy_j(seg.start_s, t_s)

    def fast_energy_j(self, t0_s: float, t1_s: float) -> float:
        """Energy over ``[t0_s, t1_s]`` in O(log segments); equal to ``energy_j`` up to float rounding."""
        s0, s1 = self.segment_at(t0_s), self.segment_at(t1_s)
        if s0 == s1:
            return self.segments[s0].profile.energy_j(t0_s, t1_s)
        return self._since_first_change_j(s1, t1_s) - self._since_first_change_j(s0, t0_s)

    def power_mw(self, t_s: float) -> int:
        """True power at ``t_s`` in mW."""
        return self.segments[self.segment_at(t_s)].profile.power_mw_at(t_s)

    def change(self, kind: str, t_s: float, pid: int | None, square: tuple[float, int, int] | None = None) -> None:
        """Start activity ``kind`` at ``t_s`` (the caller has checked ``t_s`` is not in reported history)."""
        last = self.segments[-1]
        pids = set(last.pids)
        if kind == "idle":
            if pid is None:
                pids.clear()
            else:
                pids.discard(pid)
        elif pid is not None:
            pids.add(pid)
            self.note_active(pid, t_s)
        if kind == last.kind and kind != "square":
            # Same activity (another process joined): the profile keeps its phase, only pids change.
            profile = last.profile
        else:
            key = hash_key(self.board_key, self.profiles_made, KIND_CODE[kind])
            profile = make_profile(kind, key, t_s, self.board_key, self.limit_mw, square)
            self.profiles_made += 1
        if len(self.segments) > 1:  # the last segment closes at t_s
            self.closed_j.append(self.closed_j[-1] + last.profile.energy_j(last.start_s, t_s))
        else:
            self.closed_j.append(0.0)
        self.segments.append(_Segment(t_s, kind, frozenset(pids), profile))
        self.starts.append(t_s)

    def process_util(self, pid: int, t_s: float) -> float:
        """SM utilisation (percent) of ``pid`` at ``t_s``; 0 when it has none."""
        times, values = self.proc_util.get(pid, ([], []))
        i = bisect_right(times, t_s) - 1
        return values[i] if i >= 0 else 0.0

    def mean_process_util(self, pid: int, t0_s: float, t1_s: float) -> float:
        """Time-weighted mean SM utilisation of ``pid`` over ``(t0_s, t1_s]``."""
        times, values = self.proc_util.get(pid, ([], []))
        if t1_s <= t0_s:
            return self.process_util(pid, t1_s)
        total = 0.0
        i = bisect_right(times, t0_s) - 1
        level = values[i] if i >= 0 else 0.0
        cursor = t0_s
        for t, v in zip(times[i + 1 :], values[i + 1 :], strict=True):
            if t >= t1_s:
                break
            total += level * (t - cursor)
            cursor, level = t, v
        total += level * (t1_s - cursor)
        return total / (t1_s - t0_s)

    def active_pids(self, t_s: float) -> set[int]:
        """Pids running at ``t_s``: those of the activity segment and those with utilisation above 0."""
        pids = set(self.segments[self.segment_at(t_s)].pids)
        pids.update(pid for pid in self.proc_util if self.process_util(pid, t_s) > 0)
        return pids
