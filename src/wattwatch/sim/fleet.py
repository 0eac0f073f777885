"""Simulated GPU boards behind a fake ``pynvml`` module, so ``--simulate N`` runs the real NVML path.

Board power is a pure function of (seed, board index, the board's activity timeline, t)
(``profiles``), so the exact integral is known and any process that replays the same timeline
computes the same joules. What the fake NVML (``fake_nvml``) reports is derived from that truth the
way the board's generation (``generations``; default ``h100``) reports it:

- ``nvmlDeviceGetTotalEnergyConsumption``: mJ since "driver load" (fleet creation) or the last reset,
  refreshed every update period on a per-board phase-offset grid (floor of the exact integral at the
  refresh, in steps of the counter quantum);
- ``nvmlDeviceGetPowerUsage``: the mean over the averaging window ending at the last refresh (only
  over the sampled part of each period on part-time boards);
- ``NVML_FI_DEV_POWER_INSTANT``: the live 10 ms slot, or on part-time boards the last sampled window.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wattwatch.sim.generations import BoardGeneration
from wattwatch.sim.generations import generation as resolve_generation
from wattwatch.sim.profiles import (
    ACTIVITY_KINDS,
    KIND_CODE,
    Idle,
    Profile,
    hash_key,
    make_profile,
    mix64,
    pick,
)

__all__ = ["ACTIVITY_KINDS", "COUNTER_PERIOD_S", "BoardGeneration", "SimulatedFleet"]

log = logging.getLogger(__name__)

COUNTER_PERIOD_S = 0.1  # the default (H100) energy counter / power refresh period
PROCESS_SAMPLE_PERIOD_S = 1.0 / 6.0  # NVML samples per-process utilisation about six times a second


def _fleet_file(truth_path: Path) -> Path:
    """Where a fleet writing ``truth_path`` keeps its identity (``resume`` reads it)."""
    return truth_path.with_suffix(".fleet.json")


@dataclass
class _Segment:
    start_s: float
    kind: str
    pids: frozenset[int]
    profile: Profile


class Board:
    """One board's activity timeline, per-process utilisation and fault state."""

    def __init__(self, seed: int, index: int, limit_mw: int) -> None:
        self.index = index
        self.board_key = hash_key(seed, index)
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


class SimulatedFleet:
    """``n_gpus`` simulated boards of one ``generation`` whose power follows the activities you set.

    ``generation`` is a preset name (``h100`` by default; see ``generations.GENERATIONS``) or a
    BoardGeneration. Thread-safe: the agent's threads read through ``module()`` while a driver sets
    activities.
    """

    def __init__(
        self,
        n_gpus: int,
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        model: str | None = None,
        truth_path: Path | None = None,
        generation: str | BoardGeneration = "h100",
    ) -> None:
        if n_gpus < 1:
            raise ValueError(f"a simulated fleet needs at least one GPU, got {n_gpus}")
        self.generation = resolve_generation(generation)
        self.n_gpus = n_gpus
        self.seed = seed
        self.clock = clock
        self.model = model or self.generation.model
        self.created_s = clock()
        self._lock = threading.RLock()
        limit_mw = round(self.generation.power_limit_w * 1000)
        self._boards = [Board(seed, i, limit_mw) for i in range(n_gpus)]
        for board in self._boards:
            board.counter_supported = self.generation.energy_counter
        self.truth_path = truth_path
        self._truth: Any = None
        if truth_path is not None:
            # One fleet per file: a stale log from an earlier run would make a replay wrong.
            self._truth = truth_path.open("w", encoding="utf-8")
            _fleet_file(truth_path).write_text(json.dumps(self._identity()), encoding="utf-8")

    def _identity(self) -> dict[str, Any]:
        """What makes two fleets the same boards: size, seed, generation and "driver load" time."""
        return {
            "n_gpus": self.n_gpus,
            "seed": self.seed,
            "generation": dataclasses.asdict(self.generation),
            "created_s": self.created_s,
        }

    @classmethod
    def resume(
        cls,
        truth_path: Path,
        n_gpus: int,
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        model: str | None = None,
        generation: str | BoardGeneration = "h100",
    ) -> SimulatedFleet:
        """The same boards again in a new process (the agent restarted, or was killed): the fleet that
        wrote ``truth_path`` continues, with its "driver load" time (energy counters keep counting, their
        update phase is kept) and its activity timeline; the truth log is appended to. A fleet of another
        size, seed or generation, or none at all, starts afresh as the constructor does.
        """
        fresh = cls(n_gpus, seed=seed, clock=clock, model=model, generation=generation)
        try:
            saved = json.loads(_fleet_file(truth_path).read_text(encoding="utf-8"))
            text = truth_path.read_text(encoding="utf-8")
        except (OSError, ValueError):
            saved, text = None, ""
        same = isinstance(saved, dict) and {k: v for k, v in saved.items() if k != "created_s"} == {
            k: v for k, v in fresh._identity().items() if k != "created_s"
        }
        if not same:
            return cls(n_gpus, seed=seed, clock=clock, model=model, truth_path=truth_path, generation=generation)
        assert isinstance(saved, dict)
        # A line the killed process was writing is dropped, so appending starts on a line of its own.
        truth_path.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")
        fleet = cls.replay(truth_path, n_gpus, seed=seed, clock=clock, model=model, generation=generation)
        fleet.created_s = float(saved["created_s"])
        fleet.truth_path = truth_path
        fleet._truth = truth_path.open("a", encoding="utf-8")
        return fleet

    @classmethod
    def replay(
        cls,
        truth_path: Path,
        n_gpus: int,
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        model: str | None = None,
        generation: str | BoardGeneration = "h100",
    ) -> SimulatedFleet:
        """Rebuild a fleet from another process's truth log; its ``exact_energy_j`` gives the same joules."""
        fleet = cls(n_gpus, seed=seed, clock=clock, model=model, generation=generation)
        text = truth_path.read_text(encoding="utf-8")
        lines = text.split("\n")
        for number, line in enumerate(lines[:-1], start=1):  # the last piece may be a line being written
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                index, t_s = int(rec["index"]), float(rec["t_s"])
                if "sm_util_percent" in rec:
                    fleet._apply_util(index, int(rec["pid"]), float(rec["sm_util_percent"]), t_s)
                    continue
                square = rec.get("square")
                wave = None if square is None else (float(square[0]), int(square[1]), int(square[2]))
                fleet._apply(index, str(rec["kind"]), t_s, rec.get("pid"), wave)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise ValueError(f"{truth_path}:{number}: not a simulated-GPU truth record ({exc})") from None
        return fleet

    def _log(self, rec: dict[str, Any]) -> None:
        if self._truth is not None:
            self._truth.write(json.dumps(rec) + "\n")
            self._truth.flush()

    def set_activity(self, index: int, kind: str, t_s: float, pid: int | None = None) -> None:
        """Make board ``index`` run ``kind`` (idle | training | inference) from ``t_s``.

        ``pid`` joins the board's running processes (``idle`` removes it; ``idle`` without a pid clears
        them all). A ``t_s`` earlier than what NVML already reported for the board is moved forward to
        it: the simulator never rewrites history a reader has seen (counters would run backwards).
        """
        if kind == "square":
            raise ValueError("use set_square_wave for a square wave (it needs a period and levels)")
        with self._lock:
            t_used = self._apply(index, kind, t_s, pid)
            self._log({"index": index, "kind": kind, "t_s": t_used, "pid": pid})

    def set_square_wave(
        self, index: int, t_s: float, period_s: float, low_w: float, high_w: float, pid: int | None = None
    ) -> None:
        """Make board ``index`` draw an exact square wave from ``t_s``: ``high_w`` for the first half of
        each ``period_s``, then ``low_w`` (the benchmark's aliasing probe). History rules as ``set_activity``."""
        wave = (float(period_s), round(low_w * 1000), round(high_w * 1000))
        with self._lock:
            t_used = self._apply(index, "square", t_s, pid, wave)
            self._log({"index": index, "kind": "square", "t_s": t_used, "pid": pid, "square": list(wave)})

    def _apply(
        self, index: int, kind: str, t_s: float, pid: int | None, square: tuple[float, int, int] | None = None
    ) -> float:
        if kind not in ACTIVITY_KINDS:
            raise ValueError(f"activity {kind!r} is not one of {', '.join(ACTIVITY_KINDS)}")
        board = self._board(index)
        t_used = max(t_s, board.starts[-1], board.observed_s)
        if t_used != t_s:
            log.debug("gpu%d: activity at %.6f moved to %.6f (already reported)", index, t_s, t_used)
        board.change(kind, t_used, None if pid is None else int(pid), square)
        return t_used

    def set_process_utilization(self, index: int, pid: int, sm_util_percent: float, t_s: float) -> None:
        """Process ``pid`` uses ``sm_util_percent`` (0-100) of board ``index``'s SMs from ``t_s`` on.

        Piecewise constant per pid; 0 removes the pid. While above 0 the pid is listed by
        ``nvmlDeviceGetComputeRunningProcesses`` and sampled by ``nvmlDeviceGetProcessUtilization``.
        Board power still follows ``set_activity``. As there, a ``t_s`` earlier than what NVML already
        reported is moved forward to it.
        """
        with self._lock:
            t_used = self._apply_util(index, int(pid), sm_util_percent, t_s)
            self._log({"index": index, "pid": int(pid), "sm_util_percent": sm_util_percent, "t_s": t_used})

    def _apply_util(self, index: int, pid: int, sm_util_percent: float, t_s: float) -> float:
        if not 0.0 <= sm_util_percent <= 100.0:
            raise ValueError(f"SM utilisation must be within 0-100 percent, got {sm_util_percent}")
        board = self._board(index)
        times, values = board.proc_util.setdefault(pid, ([], []))
        t_used = max(t_s, board.observed_s, times[-1] if times else -math.inf)
        if times and times[-1] == t_used:
            values[-1] = float(sm_util_percent)
        else:
            times.append(t_used)
            values.append(float(sm_util_percent))
        return t_used

    def process_utilization(self, index: int, pid: int, t_s: float) -> float:
        """True SM utilisation (percent) of ``pid`` on board ``index`` at ``t_s``."""
        with self._lock:
            return self._board(index).process_util(pid, t_s)

    def _board(self, index: int) -> Board:
        if not 0 <= index < self.n_gpus:
            raise ValueError(f"GPU index {index} out of range; this fleet has {self.n_gpus} GPUs")
        return self._boards[index]

    def activity(self, index: int, t_s: float) -> str:
        """The activity of board ``index`` at ``t_s``."""
        with self._lock:
            board = self._board(index)
            return board.segments[board.segment_at(t_s)].kind

    def pids(self, index: int, t_s: float) -> frozenset[int]:
        """Processes running on board ``index`` at ``t_s`` (from ``set_activity``)."""
        with self._lock:
            board = self._board(index)
            return board.segments[board.segment_at(t_s)].pids

    def power_w(self, index: int, t_s: float) -> float:
        """True power of board ``index`` at ``t_s`` in watts."""
        with self._lock:
            return self._board(index).power_mw(t_s) / 1000.0

    def exact_energy_j(self, index: int, t0_s: float, t1_s: float) -> float:
        """Exact energy of board ``index`` over ``[t0_s, t1_s]`` in joules."""
        if t1_s < t0_s:
            raise ValueError(f"t1_s ({t1_s}) is earlier than t0_s ({t0_s})")
        with self._lock:
            return self._board(index).energy_j(t0_s, t1_s)

    def uuid(self, index: int) -> str:
        """The board's stable UUID (``GPU-xxxxxxxx-...``)."""
        return self._board(index).uuid

    # -- fault injection ----------------------------------------------------------------------------

    def lose(self, index: int) -> None:
        """Board ``index`` falls off the bus: every NVML call on it raises ``NVMLError_GpuIsLost`` (pynvml's name)."""
        with self._lock:
            self._board(index).lost = True

    def reset_counter(self, index: int, t_s: float) -> None:
        """Board ``index``'s energy counter restarts from 0 at ``t_s`` (as after a driver reload)."""
        with self._lock:
            self._board(index).resets_s.append(t_s)
            self._board(index).resets_s.sort()

    def set_energy_counter_supported(self, index: int, supported: bool) -> None:
        """Make ``nvmlDeviceGetTotalEnergyConsumption`` raise ``NotSupported`` (pre-Volta) or work again."""
        with self._lock:
            self._board(index).counter_supported = supported

    # -- what NVML would report ---------------------------------------------------------------------

    def last_update_s(self, index: int, t_s: float) -> float:
        """The board's last counter/power refresh at or before ``t_s`` (update-period grid, per-board phase)."""
        period_s = self.generation.update_period_s
        origin_s = self.created_s + self._board(index).phase_fraction * period_s
        return origin_s + math.floor((t_s - origin_s) / period_s) * period_s

    def counter_mj(self, index: int, t_s: float) -> int:
        """``nvmlDeviceGetTotalEnergyConsumption`` as read at ``t_s``: mJ since load or the last reset,
        as of the last refresh, in steps of the generation's counter quantum."""
        with self._lock:
            board = self._board(index)
            u = self.last_update_s(index, t_s)
            resets = [r for r in board.resets_s if r <= t_s]
            origin_s = resets[-1] if resets else self.created_s
            if u < origin_s:
                return 0
            quantum = self.generation.counter_quantum_mj
            return max(0, math.floor(1000.0 * board.fast_energy_j(origin_s, u) / quantum) * quantum)

    def _sampled_mean_mw(self, board: Board, u: float, window_s: float) -> int:
        """Mean power over the sampled parts of the refresh periods in ``[u - window_s, u]``."""
        gen = self.generation
        if gen.sampled_fraction >= 1.0:
            return round(1000.0 * board.fast_energy_j(u - window_s, u) / window_s)
        periods = max(1, round(window_s / gen.update_period_s))
        seen_s = gen.sampled_fraction * gen.update_period_s
        energy_j = sum(
            board.fast_energy_j(u - k * gen.update_period_s - seen_s, u - k * gen.update_period_s)
            for k in range(periods)
        )
        return round(1000.0 * energy_j / (periods * seen_s))

    def average_power_mw(self, index: int, t_s: float) -> int:
        """``nvmlDeviceGetPowerUsage`` as read at ``t_s``: mean power over the averaging window before the
        last refresh (the sampled part of it, on part-time boards)."""
        with self._lock:
            board = self._board(index)
            return self._sampled_mean_mw(board, self.last_update_s(index, t_s), self.generation.average_window_s)

    def instant_power_mw(self, index: int, t_s: float) -> int:
        """``NVML_FI_DEV_POWER_INSTANT`` as read at ``t_s``: the live power, or on part-time boards the mean
        over the sampled part of the last refresh period, held until the next refresh."""
        with self._lock:
            board = self._board(index)
            if self.generation.instant_live:
                return board.power_mw(t_s)
            period_s = self.generation.update_period_s
            return self._sampled_mean_mw(board, self.last_update_s(index, t_s), period_s)

    def observe(self, index: int) -> tuple[Board, float]:
        """The board and the time of an NVML call on it (history before that time becomes fixed).

        Raises NVMLError_GpuIsLost for a lost board. Call with the fleet's lock held.
        """
        board = self._board(index)
        now = self.clock()
        if board.lost:
            from wattwatch.sim.fake_nvml import real_pynvml

            nvml = real_pynvml()
            raise nvml.NVMLError(nvml.NVML_ERROR_GPU_IS_LOST)
        board.observed_s = max(board.observed_s, now)
        return board, now

    @property
    def lock(self) -> threading.RLock:
        """The lock every reader and writer of the fleet holds (the fake module takes it too)."""
        return self._lock

    def board(self, index: int) -> Board:
        """Board ``index`` (for the fake module; callers hold ``lock``)."""
        return self._board(index)

    def module(self) -> Any:
        """A fake ``pynvml`` module over this fleet (a ``FakeNvml``, ``WATTWATCH_SIMULATED = True``); each
        call is a new "process" view with its own ``nvmlInit`` count. Typed ``Any``, like the real module:
        its NVML constants and error classes are copied in at run time."""
        from wattwatch.sim.fake_nvml import FakeNvml

        return FakeNvml(self)
