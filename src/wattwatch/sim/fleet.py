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

``flaws`` (``flaws.Flaws``, or a spec such as ``"realistic"``) adds what real hardware does besides:
per-board refresh periods, noisy instant power, slow NVML calls, processes listed late, workloads that
lag their job boundaries. The truth (``exact_energy_j``) is the activity timeline's integral, whatever
the flaws.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wattwatch.sim.board import Board
from wattwatch.sim.flaws import Flaws, parse_flaws
from wattwatch.sim.generations import BoardGeneration
from wattwatch.sim.generations import generation as resolve_generation
from wattwatch.sim.profiles import ACTIVITY_KINDS, SLOT_S

__all__ = ["ACTIVITY_KINDS", "COUNTER_PERIOD_S", "BoardGeneration", "Flaws", "SimulatedFleet"]

log = logging.getLogger(__name__)

COUNTER_PERIOD_S = 0.1  # the default (H100) energy counter / power refresh period

Sleep = Callable[[float], None]


def _fleet_file(truth_path: Path) -> Path:
    """Where a fleet writing ``truth_path`` keeps its identity (``resume`` reads it)."""
    return truth_path.with_suffix(".fleet.json")


def resolve_flaws(spec: Flaws | str | None) -> Flaws:
    """``spec`` as Flaws: None is an ideal board, a string is read by ``flaws.parse_flaws``."""
    if spec is None:
        return Flaws()
    return parse_flaws(spec) if isinstance(spec, str) else spec


def _default_sleep(clock: Callable[[], float]) -> Sleep | None:
    """How time passes on ``clock``: its own ``sleep`` (a FakeClock), or real sleep for real time."""
    own = getattr(clock, "sleep", None)
    if callable(own):
        return own  # type: ignore[no-any-return]
    return time.sleep if clock is time.time else None


class SimulatedFleet:
    """``n_gpus`` simulated boards of one ``generation`` whose power follows the activities you set.

    ``generation`` is a preset name (``h100`` by default; see ``generations.GENERATIONS``) or a
    BoardGeneration; ``flaws`` a ``Flaws`` or a spec for ``flaws.parse_flaws``. ``sleep`` is how an
    NVML call spends its latency: by default the clock's own ``sleep`` (a ``FakeClock``), or real
    sleep on the real clock. Thread-safe: the agent's threads read through ``module()`` while a driver
    sets activities.
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
        flaws: Flaws | str | None = None,
        sleep: Sleep | None = None,
    ) -> None:
        if n_gpus < 1:
            raise ValueError(f"a simulated fleet needs at least one GPU, got {n_gpus}")
        self.generation = resolve_generation(generation)
        self.flaws = resolve_flaws(flaws)
        resolved_sleep = sleep if sleep is not None else _default_sleep(clock)
        if resolved_sleep is None and (self.flaws.call_latency_s or self.flaws.call_jitter_s):
            raise ValueError("NVML call latency on a custom clock needs sleep= (how that clock's time passes)")
        self.sleep: Sleep = resolved_sleep or time.sleep
        self.n_gpus = n_gpus
        self.seed = seed
        self.clock = clock
        self.model = model or self.generation.model
        self.created_s = clock()
        self._lock = threading.RLock()
        self._views = itertools.count()  # modules made so far (each draws NVML call times of its own)
        limit_mw = round(self.generation.power_limit_w * 1000)
        period_s = self.generation.update_period_s
        self._boards = [Board(seed, i, limit_mw, period_s, self.flaws) for i in range(n_gpus)]
        for board in self._boards:
            board.counter_supported = self.generation.energy_counter
        self.truth_path = truth_path
        self._truth: Any = None
        if truth_path is not None:
            # One fleet per file: a stale log from another run would make a replay wrong.
            self._truth = truth_path.open("w", encoding="utf-8")
            _fleet_file(truth_path).write_text(json.dumps(self._identity()), encoding="utf-8")

    def _identity(self) -> dict[str, Any]:
        """What makes two fleets the same boards: size, seed, generation, flaws and "driver load" time."""
        return {
            "n_gpus": self.n_gpus,
            "seed": self.seed,
            "generation": dataclasses.asdict(self.generation),
            "flaws": self.flaws.as_dict(),
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
        flaws: Flaws | str | None = None,
        sleep: Sleep | None = None,
    ) -> SimulatedFleet:
        """The same boards again in a new process (the agent restarted, or was killed): the fleet that
        wrote ``truth_path`` continues, with its "driver load" time (energy counters keep counting, their
        update phase is kept) and its activity timeline; the truth log is appended to. A fleet of another
        size, seed, generation or flaws, or none at all, starts afresh as the constructor does.
        """
        same_boards: dict[str, Any] = {"model": model, "generation": generation, "flaws": flaws, "sleep": sleep}
        fresh = cls(n_gpus, seed=seed, clock=clock, **same_boards)
        try:
            saved = json.loads(_fleet_file(truth_path).read_text(encoding="utf-8"))
            text = truth_path.read_text(encoding="utf-8")
        except (OSError, ValueError):
            saved, text = None, ""
        same = isinstance(saved, dict) and {k: v for k, v in saved.items() if k != "created_s"} == {
            k: v for k, v in fresh._identity().items() if k != "created_s"
        }
        if not same:
            return cls(n_gpus, seed=seed, clock=clock, truth_path=truth_path, **same_boards)
        assert isinstance(saved, dict)
        # A line the killed process was writing is dropped, so appending starts on a line of its own.
        truth_path.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")
        fleet = cls.replay(truth_path, n_gpus, seed=seed, clock=clock, **same_boards)
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
        flaws: Flaws | str | None = None,
        sleep: Sleep | None = None,
    ) -> SimulatedFleet:
        """Rebuild a fleet from another process's truth log; its ``exact_energy_j`` gives the same joules."""
        fleet = cls(n_gpus, seed=seed, clock=clock, model=model, generation=generation, flaws=flaws, sleep=sleep)
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
        if sm_util_percent > 0:
            board.note_active(pid, t_used)
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

    def refresh_period_s(self, index: int) -> float:
        """How often board ``index``'s counter and power readings refresh (the generation's period, or
        the one the flaws drew for this board)."""
        return self._board(index).refresh_period_s

    @property
    def process_sample_period_s(self) -> float:
        """How often NVML samples per-process utilisation on these boards."""
        return self.flaws.process_sample_period_s or self.generation.process_sample_period_s

    def load_lag_s(self, job: str, edge: str) -> float:
        """How late job ``job``'s load follows its ``edge`` (``start`` | ``end``) boundary (0 without the
        workload-lag flaw; negative: the load ends before the job closes). The same for the same job."""
        return self.flaws.lag_s(job, edge)

    def last_update_s(self, index: int, t_s: float) -> float:
        """The board's last counter/power refresh at or before ``t_s`` (update-period grid, per-board phase)."""
        board = self._board(index)
        period_s = board.refresh_period_s
        origin_s = self.created_s + board.phase_fraction * period_s
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

    def _sampled_mean_mw(self, board: Board, u: float, window_s: float) -> float:
        """Mean power over the sampled parts of the refresh periods in ``[u - window_s, u]``."""
        gen, period_s = self.generation, board.refresh_period_s
        if gen.sampled_fraction >= 1.0:
            return 1000.0 * board.fast_energy_j(u - window_s, u) / window_s
        periods = max(1, round(window_s / period_s))
        seen_s = gen.sampled_fraction * period_s
        energy_j = sum(board.fast_energy_j(u - k * period_s - seen_s, u - k * period_s) for k in range(periods))
        return 1000.0 * energy_j / (periods * seen_s)

    def _reading_mw(self, board: Board, true_mw: float, slot: int, readings: int = 1) -> int:
        """A power reading: the true value plus the noise of ``slot`` (a mean of ``readings`` noisy
        readings carries 1/sqrt(readings) of it), never below zero."""
        noise_mw = 1000.0 * self.flaws.noise_w(board.board_key, slot) / math.sqrt(readings)
        return max(0, round(true_mw + noise_mw))

    def average_power_mw(self, index: int, t_s: float) -> int:
        """``nvmlDeviceGetPowerUsage`` as read at ``t_s``: mean power over the averaging window before the
        last refresh (the sampled part of it, on part-time boards), with the noise flaw's share."""
        with self._lock:
            board = self._board(index)
            u = self.last_update_s(index, t_s)
            window_s = self.generation.average_window_s
            readings = max(1, round(window_s / board.refresh_period_s))
            return self._reading_mw(board, self._sampled_mean_mw(board, u, window_s), round(u * 1e6), readings)

    def instant_power_mw(self, index: int, t_s: float) -> int:
        """``NVML_FI_DEV_POWER_INSTANT`` as read at ``t_s``: the live power (of the current 10 ms slot), or
        on part-time boards the mean over the sampled part of the last refresh period, held until the
        next refresh; plus the noise flaw."""
        with self._lock:
            board = self._board(index)
            if self.generation.instant_live:
                return self._reading_mw(board, board.power_mw(t_s), math.floor(t_s / SLOT_S))
            u = self.last_update_s(index, t_s)
            return self._reading_mw(board, self._sampled_mean_mw(board, u, board.refresh_period_s), round(u * 1e6))

    def visible_from_s(self, index: int, pid: int) -> float:
        """When NVML first lists process ``pid`` on board ``index``: the process-delay flaw after it
        first ran there (``inf`` when it never did)."""
        with self._lock:
            board = self._board(index)
            first_s = board.first_active_s.get(pid)
            if first_s is None:
                return math.inf
            return first_s + self.flaws.process_delay_for(board.board_key, pid)

    def listed_pids(self, index: int, t_s: float) -> list[int]:
        """The processes NVML lists on board ``index`` at ``t_s``: those running that it already knows."""
        with self._lock:
            board = self._board(index)
            return sorted(pid for pid in board.active_pids(t_s) if self.visible_from_s(index, pid) <= t_s)

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

        return FakeNvml(self, next(self._views))
