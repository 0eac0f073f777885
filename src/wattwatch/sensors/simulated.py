"""Simulated H100-class GPU boards behind a fake ``pynvml`` module, so ``--simulate N`` runs the real NVML path.

Board power is a pure function of (seed, board index, the board's activity timeline, t): piecewise
constant on 10 ms slots, each slot's value an integer number of milliwatts drawn from a splitmix64
hash (never Python's salted ``hash()``). The exact integral is then a sum of integers plus two partial
slots, so any process that replays the same activity timeline computes the same joules.

What the fake NVML reports is derived from that truth the way an H100 reports it:

- ``nvmlDeviceGetTotalEnergyConsumption``: integer mJ since "driver load" (fleet creation), updated
  only every 100 ms on a per-board phase-offset grid (floor of the exact integral at the update);
- ``nvmlDeviceGetPowerUsage``: the trailing 1 s average as of the last 100 ms update;
- ``NVML_FI_DEV_POWER_INSTANT``: the current 10 ms slot's power.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

ACTIVITY_KINDS = ("idle", "training", "inference")

SLOT_S = 0.01  # power is constant over each 10 ms slot
BLOCK_SLOTS = 100  # slot sums are cached per 1 s block
COUNTER_PERIOD_S = 0.1  # H100-class energy counter / power average refresh period
PROCESS_SAMPLE_PERIOD_S = 1.0 / 6.0  # NVML samples per-process utilisation about six times a second
PROCESS_BUFFER_S = 10.0  # how far back the fake's per-process sample buffer reaches
AVERAGE_WINDOW_S = 1.0  # nvmlDeviceGetPowerUsage is a 1 s trailing average on H100-class parts
POWER_LIMIT_MW = 700_000
MEMORY_TOTAL_B = 81_559 * 1024 * 1024  # "80 GB" H100 as nvidia-smi shows it
DRIVER_VERSION = "550.54.15"

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_KIND_CODE = {"idle": 0x1D1E, "training": 0x7A41, "inference": 0x1F3E}


def _mix(x: int) -> int:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash that is the same in every process."""
    z = (x + _GAMMA) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _key(*parts: int) -> int:
    h = 0x5EED
    for part in parts:
        h = _mix(h ^ (part & _MASK))
    return h


def _pick(h: int, shift: int, lo: int, hi: int) -> int:
    """An integer in [lo, hi] from 16 bits of ``h`` (several independent picks per hash)."""
    return lo + ((h >> shift) & 0xFFFF) * (hi - lo + 1) // 0x10000


# -- activity profiles ------------------------------------------------------------------------------


class _Profile:
    """Slot powers (integer mW) of one activity, with slot 0 starting at ``anchor_s``.

    Caches the values of recently used 1 s blocks and a running sum of block totals, so an integral
    costs at most one block of hashing once the blocks before it have been summed.
    """

    kind = "idle"

    def __init__(self, key: int, anchor_s: float) -> None:
        self.key = key
        self.anchor_s = anchor_s
        self._blocks: dict[int, list[int]] = {}
        self._first_block: int | None = None
        self._prefix: list[int] = [0]  # _prefix[i] = sum of blocks [_first_block, _first_block + i)
        self._shift = 0  # keeps prefix values fixed when the cache grows backwards

    def values_mw(self, k0: int, k1: int) -> list[int]:
        """Power of slots ``k0 .. k1-1`` in mW."""
        raise NotImplementedError

    def _block(self, b: int) -> list[int]:
        vals = self._blocks.get(b)
        if vals is None:
            if len(self._blocks) > 512:
                self._blocks.clear()
            vals = self.values_mw(b * BLOCK_SLOTS, (b + 1) * BLOCK_SLOTS)
            self._blocks[b] = vals
        return vals

    def slot_mw(self, k: int) -> int:
        """Power of slot ``k`` in mW."""
        return self._block(k // BLOCK_SLOTS)[k % BLOCK_SLOTS]

    def _block_prefix(self, b: int) -> int:
        if self._first_block is None:
            self._first_block = b
        first = self._first_block
        if b < first:
            # Rare (only the open-ended first idle segment is queried backwards): rebuild in front.
            sums = [sum(self._block(x)) for x in range(b, first)]
            front = [0]
            for s in sums:
                front.append(front[-1] + s)
            self._prefix = front + [p + front[-1] for p in self._prefix[1:]]
            self._shift += front[-1]
            self._first_block = first = b
        i = b - first
        while len(self._prefix) <= i:
            self._prefix.append(self._prefix[-1] + sum(self._block(first + len(self._prefix) - 1)))
        return self._prefix[i] - self._shift

    def locate(self, t_s: float) -> tuple[int, float]:
        """Slot index holding ``t_s`` and the seconds from that slot's start to ``t_s``."""
        x = (t_s - self.anchor_s) / SLOT_S
        k = math.floor(x)
        return k, (x - k) * SLOT_S

    def prefix_mw_slots(self, k: int) -> int:
        """Sum of slot powers (mW) from a fixed origin up to slot ``k`` (exclusive); exact integer."""
        b, r = divmod(k, BLOCK_SLOTS)
        return self._block_prefix(b) + sum(self._block(b)[:r])

    def energy_j(self, t0_s: float, t1_s: float) -> float:
        """Exact integral of this profile's power over ``[t0_s, t1_s]`` in joules."""
        k0, f0 = self.locate(t0_s)
        k1, f1 = self.locate(t1_s)
        slots_mw = self.prefix_mw_slots(k1) - self.prefix_mw_slots(k0)  # integer: no rounding
        return (slots_mw * SLOT_S + self.slot_mw(k1) * f1 - self.slot_mw(k0) * f0) / 1000.0


class _Idle(_Profile):
    """Idle board: a per-board level of 62-70 W with +-1.5 W of slot noise."""

    kind = "idle"

    def __init__(self, key: int, anchor_s: float, board_key: int) -> None:
        super().__init__(key, anchor_s)
        self._base_mw = _pick(_mix(board_key), 0, 62_000, 70_000)

    def values_mw(self, k0: int, k1: int) -> list[int]:
        """Power of slots ``k0 .. k1-1`` in mW."""
        key, base = self.key, self._base_mw
        return [base - 1500 + _mix((key + k * _GAMMA) & _MASK) % 3001 for k in range(k0, k1)]


class _Training(_Profile):
    """Training: 0.5-1.0 s steps at 560-670 W, each opening with a 10-20 % data-loading dip at 200-300 W."""

    kind = "training"

    def __init__(self, key: int, anchor_s: float) -> None:
        super().__init__(key, anchor_s)
        self.step_slots = _pick(_mix(key ^ 0x57E9), 0, 50, 100)
        self._steps: dict[int, tuple[int, int, int]] = {}

    def _step(self, j: int) -> tuple[int, int, int]:
        got = self._steps.get(j)
        if got is None:
            if len(self._steps) > 4096:
                self._steps.clear()
            h = _mix((self.key ^ 0x5AE9 ^ (j * _GAMMA)) & _MASK)
            dip_slots = self.step_slots * _pick(h, 0, 10, 20) // 100
            got = (dip_slots, _pick(h, 16, 200_000, 300_000), _pick(h, 32, 560_000, 670_000))
            self._steps[j] = got
        return got

    def values_mw(self, k0: int, k1: int) -> list[int]:
        """Power of slots ``k0 .. k1-1`` in mW."""
        out: list[int] = []
        key, n = self.key, self.step_slots
        for k in range(k0, k1):
            j, pos = divmod(k, n)
            dip_slots, dip_mw, compute_mw = self._step(j)
            noise = _mix((key + k * _GAMMA) & _MASK)
            if pos < dip_slots:
                out.append(dip_mw - 8000 + noise % 16001)
            else:
                out.append(min(POWER_LIMIT_MW, compute_mw - 12_000 + noise % 24001))
        return out


class _Inference(_Profile):
    """Inference: bursty requests, each a gap (90-120 W), a prefill spike (650-700 W, 30-80 ms) and a
    decode plateau (350-500 W, 0.2-1.5 s). Request r's gap starts at slot ``_starts[r]``."""

    kind = "inference"

    def __init__(self, key: int, anchor_s: float) -> None:
        super().__init__(key, anchor_s)
        # (gap_slots, prefill_slots, decode_slots, gap_mw, prefill_mw, decode_mw) per request
        self._requests: list[tuple[int, int, int, int, int, int]] = []
        self._starts: list[int] = []
        self._end = 0

    def _extend_to(self, k: int) -> None:
        while self._end <= k:
            r = len(self._requests)
            h = _mix((self.key ^ 0x1CF ^ (r * _GAMMA)) & _MASK)
            g = _mix(h)
            # Bursty arrivals: mostly short gaps (10-200 ms), sometimes a lull (0.3-3 s).
            gap = _pick(g, 0, 1, 20) if _pick(g, 16, 0, 99) < 70 else _pick(g, 32, 30, 300)
            req = (gap, _pick(h, 0, 3, 8), _pick(h, 16, 20, 150))
            levels = (_pick(g, 48, 90_000, 120_000), _pick(h, 32, 650_000, 695_000), _pick(h, 48, 350_000, 500_000))
            self._requests.append(req + levels)
            self._starts.append(self._end)
            self._end += sum(req)

    def values_mw(self, k0: int, k1: int) -> list[int]:
        """Power of slots ``k0 .. k1-1`` in mW."""
        self._extend_to(k1)
        out: list[int] = []
        key = self.key
        r = bisect_right(self._starts, k0) - 1
        for k in range(k0, k1):
            while r + 1 < len(self._starts) and self._starts[r + 1] <= k:
                r += 1
            gap, prefill, _, gap_mw, prefill_mw, decode_mw = self._requests[r]
            pos = k - self._starts[r]
            noise = _mix((key + k * _GAMMA) & _MASK) % 10001 - 5000
            level = gap_mw if pos < gap else prefill_mw if pos < gap + prefill else decode_mw
            out.append(min(POWER_LIMIT_MW, level + noise))
        return out


def _profile(kind: str, key: int, anchor_s: float, board_key: int) -> _Profile:
    if kind == "training":
        return _Training(key, anchor_s)
    if kind == "inference":
        return _Inference(key, anchor_s)
    return _Idle(key, anchor_s, board_key)


# -- boards and fleet -------------------------------------------------------------------------------


@dataclass
class _Segment:
    start_s: float
    kind: str
    pids: frozenset[int]
    profile: _Profile


class _Board:
    """One board's activity timeline and fault state."""

    def __init__(self, seed: int, index: int) -> None:
        self.index = index
        self.board_key = _key(seed, index)
        # The first segment is open-ended to the past, on the absolute slot grid, so that the truth does
        # not depend on when the fleet object was created (a replay in another process gets the same joules).
        first = _Segment(-math.inf, "idle", frozenset(), _Idle(_key(self.board_key, 0), 0.0, self.board_key))
        self.segments: list[_Segment] = [first]
        self.starts: list[float] = [-math.inf]
        # closed_j[s]: energy from the first change (start of segment 1) to the start of segment s >= 1,
        # so a counter read costs O(log segments) however long the fleet has run.
        self.closed_j: list[float] = [0.0]
        self.profiles_made = 1
        self.observed_s = -math.inf  # latest instant NVML reported on; history before it is fixed
        self.phase_s = COUNTER_PERIOD_S * _pick(_mix(self.board_key ^ 0xFA5E), 0, 0, 999) / 1000
        h1, h2 = _mix(self.board_key ^ 0x0D1D), _mix(self.board_key ^ 0x0D1E)
        hex32 = f"{h1:016x}{h2:016x}"
        self.uuid = f"GPU-{hex32[:8]}-{hex32[8:12]}-{hex32[12:16]}-{hex32[16:20]}-{hex32[20:]}"
        self.lost = False
        self.counter_supported = True
        self.resets_s: list[float] = []
        # Per-process SM utilisation (percent), piecewise constant: pid -> (change times, values).
        self.proc_util: dict[int, tuple[list[float], list[float]]] = {}

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

    def segment_at(self, t_s: float) -> int:
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
        profile = self.segments[self.segment_at(t_s)].profile
        return profile.slot_mw(profile.locate(t_s)[0])

    def change(self, kind: str, t_s: float, pid: int | None) -> None:
        last = self.segments[-1]
        pids = set(last.pids)
        if kind == "idle":
            if pid is None:
                pids.clear()
            else:
                pids.discard(pid)
        elif pid is not None:
            pids.add(pid)
        if kind == last.kind:
            # Same activity (another process joined): the profile keeps its phase, only pids change.
            profile = last.profile
        else:
            profile = _profile(kind, _key(self.board_key, self.profiles_made, _KIND_CODE[kind]), t_s, self.board_key)
            self.profiles_made += 1
        if len(self.segments) > 1:  # the last segment closes at t_s
            self.closed_j.append(self.closed_j[-1] + last.profile.energy_j(last.start_s, t_s))
        else:
            self.closed_j.append(0.0)
        self.segments.append(_Segment(t_s, kind, frozenset(pids), profile))
        self.starts.append(t_s)


class SimulatedFleet:
    """``n_gpus`` simulated H100-class boards whose power follows the activities you set on them.

    Thread-safe: the agent's threads read through ``module()`` while a driver sets activities.
    """

    def __init__(
        self,
        n_gpus: int,
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        model: str = "NVIDIA H100 80GB HBM3",
        truth_path: Path | None = None,
    ) -> None:
        if n_gpus < 1:
            raise ValueError(f"a simulated fleet needs at least one GPU, got {n_gpus}")
        self.n_gpus = n_gpus
        self.seed = seed
        self.clock = clock
        self.model = model
        self.created_s = clock()
        self._lock = threading.RLock()
        self._boards = [_Board(seed, i) for i in range(n_gpus)]
        self.truth_path = truth_path
        self._truth: Any = None
        if truth_path is not None:
            # One fleet per file: a stale log from an earlier run would make a replay wrong.
            self._truth = truth_path.open("w", encoding="utf-8")

    @classmethod
    def replay(
        cls,
        truth_path: Path,
        n_gpus: int,
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        model: str = "NVIDIA H100 80GB HBM3",
    ) -> SimulatedFleet:
        """Rebuild a fleet from another process's truth log; its ``exact_energy_j`` gives the same joules."""
        fleet = cls(n_gpus, seed=seed, clock=clock, model=model)
        text = truth_path.read_text(encoding="utf-8")
        lines = text.split("\n")
        for number, line in enumerate(lines[:-1], start=1):  # the last piece may be a line being written
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if "sm_util_percent" in rec:
                    fleet._apply_util(
                        int(rec["index"]), int(rec["pid"]), float(rec["sm_util_percent"]), float(rec["t_s"])
                    )
                    continue
                fleet._apply(int(rec["index"]), str(rec["kind"]), float(rec["t_s"]), rec.get("pid"))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{truth_path}:{number}: not a simulated-GPU truth record ({exc})") from None
        return fleet

    def set_activity(self, index: int, kind: str, t_s: float, pid: int | None = None) -> None:
        """Make board ``index`` run ``kind`` (idle | training | inference) from ``t_s``.

        ``pid`` joins the board's running processes (``idle`` removes it; ``idle`` without a pid clears
        them all). A ``t_s`` earlier than what NVML already reported for the board is moved forward to
        it: the simulator never rewrites history a reader has seen (counters would run backwards).
        """
        with self._lock:
            t_used = self._apply(index, kind, t_s, pid)
            if self._truth is not None:
                rec = {"index": index, "kind": kind, "t_s": t_used, "pid": pid}
                self._truth.write(json.dumps(rec) + "\n")
                self._truth.flush()

    def _apply(self, index: int, kind: str, t_s: float, pid: int | None) -> float:
        if kind not in ACTIVITY_KINDS:
            raise ValueError(f"activity {kind!r} is not one of {', '.join(ACTIVITY_KINDS)}")
        board = self._board(index)
        t_used = max(t_s, board.starts[-1], board.observed_s)
        if t_used != t_s:
            log.debug("gpu%d: activity at %.6f moved to %.6f (already reported)", index, t_s, t_used)
        board.change(kind, t_used, None if pid is None else int(pid))
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
            if self._truth is not None:
                rec = {"index": index, "pid": int(pid), "sm_util_percent": sm_util_percent, "t_s": t_used}
                self._truth.write(json.dumps(rec) + "\n")
                self._truth.flush()

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

    def _board(self, index: int) -> _Board:
        if not 0 <= index < self.n_gpus:
            raise ValueError(f"GPU index {index} out of range; this fleet has {self.n_gpus} GPUs")
        return self._boards[index]

    def activity(self, index: int, t_s: float) -> str:
        """The activity of board ``index`` at ``t_s``."""
        with self._lock:
            board = self._board(index)
            return board.segments[board.segment_at(t_s)].kind

    def pids(self, index: int, t_s: float) -> frozenset[int]:
        """Processes running on board ``index`` at ``t_s``."""
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
        """The board's last counter/average refresh at or before ``t_s`` (100 ms grid, per-board phase)."""
        board = self._board(index)
        n = math.floor((t_s - self.created_s - board.phase_s) / COUNTER_PERIOD_S)
        return self.created_s + board.phase_s + n * COUNTER_PERIOD_S

    def counter_mj(self, index: int, t_s: float) -> int:
        """``nvmlDeviceGetTotalEnergyConsumption`` as read at ``t_s``: integer mJ since load or last reset."""
        with self._lock:
            board = self._board(index)
            u = self.last_update_s(index, t_s)
            resets = [r for r in board.resets_s if r <= t_s]
            origin_s = resets[-1] if resets else self.created_s
            if u < origin_s:
                return 0
            return max(0, math.floor(1000.0 * board.fast_energy_j(origin_s, u)))

    def average_power_mw(self, index: int, t_s: float) -> int:
        """``nvmlDeviceGetPowerUsage`` as read at ``t_s``: mean power over the 1 s before the last refresh."""
        with self._lock:
            board = self._board(index)
            u = self.last_update_s(index, t_s)
            energy_j = board.fast_energy_j(u - AVERAGE_WINDOW_S, u)
            return round(1000.0 * energy_j / AVERAGE_WINDOW_S)

    def _observe(self, index: int) -> tuple[_Board, float]:
        """The board and the time of an NVML call on it; raises GPUIsLost for a lost board."""
        board = self._board(index)
        now = self.clock()
        if board.lost:
            raise _pynvml().NVMLError(_pynvml().NVML_ERROR_GPU_IS_LOST)
        board.observed_s = max(board.observed_s, now)
        return board, now

    def module(self) -> Any:
        """A fake ``pynvml`` module over this fleet (``WATTWATCH_SIMULATED = True``); each call is a new
        "process" view with its own ``nvmlInit`` count."""
        return FakeNvml(self)


def _pynvml() -> Any:
    # The real module only loads libnvidia-ml at nvmlInit, so importing it works without a GPU.
    import pynvml

    return pynvml


class _Handle:
    """What ``nvmlDeviceGetHandleBy*`` returns: opaque to callers."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<simulated nvmlDevice {self.index}>"


class FakeNvml:
    """Duck-typed ``pynvml`` over a SimulatedFleet: same function names and signatures as nvidia-ml-py,
    and the real module's ``NVMLError`` classes, ``NVML_*`` constants and ctypes structures, so code
    written against pynvml catches the fake's errors and reads its results unchanged."""

    WATTWATCH_SIMULATED = True

    def __init__(self, fleet: SimulatedFleet) -> None:
        real = _pynvml()
        for name in dir(real):
            if name.startswith(("NVML_", "NVMLError", "c_nvml", "nvmlFriendlyObject")):
                setattr(self, name, getattr(real, name))
        self._real = real
        self._fleet = fleet
        self._inits = 0
        self._init_lock = threading.Lock()

    # -- library ------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        """Initialise (reference counted, like the real library)."""
        with self._init_lock:
            self._inits += 1

    def nvmlShutdown(self) -> None:
        """Undo one ``nvmlInit``."""
        with self._init_lock:
            self._check()
            self._inits -= 1

    def _check(self) -> None:
        if self._inits <= 0:
            raise self._real.NVMLError(self._real.NVML_ERROR_UNINITIALIZED)

    def _board(self, handle: Any) -> tuple[_Board, float]:
        self._check()
        if not isinstance(handle, _Handle):
            raise self._real.NVMLError(self._real.NVML_ERROR_INVALID_ARGUMENT)
        return self._fleet._observe(handle.index)

    def nvmlSystemGetDriverVersion(self) -> str:
        """The (simulated) driver version string."""
        self._check()
        return DRIVER_VERSION

    # -- enumeration --------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        """Number of boards."""
        self._check()
        return self._fleet.n_gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        """Handle of board ``index``; InvalidArgument when out of range."""
        self._check()
        if not isinstance(index, int) or not 0 <= index < self._fleet.n_gpus:
            raise self._real.NVMLError(self._real.NVML_ERROR_INVALID_ARGUMENT)
        with self._fleet._lock:
            self._fleet._observe(index)
        return _Handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        """Handle of the board with ``uuid``; NotFound otherwise."""
        self._check()
        text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        for i in range(self._fleet.n_gpus):
            if self._fleet.uuid(i) == text:
                return self.nvmlDeviceGetHandleByIndex(i)
        raise self._real.NVMLError(self._real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        """Marketing name of the board."""
        with self._fleet._lock:
            self._board(handle)
        return self._fleet.model

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        """``GPU-...`` UUID of the board."""
        with self._fleet._lock:
            board, _ = self._board(handle)
        return board.uuid

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        """NVML index of the board."""
        with self._fleet._lock:
            board, _ = self._board(handle)
        return board.index

    # -- power and energy ---------------------------------------------------------------------------

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        """mJ since driver load (or the last reset), refreshed every 100 ms."""
        with self._fleet._lock:
            board, now = self._board(handle)
            if not board.counter_supported:
                raise self._real.NVMLError(self._real.NVML_ERROR_NOT_SUPPORTED)
            return self._fleet.counter_mj(board.index, now)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        """mW, the 1 s trailing average as of the last 100 ms refresh (H100-class behaviour)."""
        with self._fleet._lock:
            board, now = self._board(handle)
            return self._fleet.average_power_mw(board.index, now)

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        """Array of ``c_nvmlFieldValue_t``; POWER_INSTANT and POWER_AVERAGE (mW) are supported."""
        real = self._real
        values = (real.c_nvmlFieldValue_t * len(fieldIds))()
        with self._fleet._lock:
            board, now = self._board(handle)
            for i, field_id in enumerate(fieldIds):
                fid, scope = field_id if isinstance(field_id, tuple) else (field_id, 0)
                v = values[i]
                v.fieldId, v.scopeId = fid, scope
                v.timestamp = int(now * 1e6)
                v.latencyUsec = 0
                v.valueType = real.NVML_VALUE_TYPE_UNSIGNED_INT
                if fid == real.NVML_FI_DEV_POWER_INSTANT:
                    v.value.uiVal = board.power_mw(now)
                    v.nvmlReturn = real.NVML_SUCCESS
                elif fid == real.NVML_FI_DEV_POWER_AVERAGE:
                    v.value.uiVal = self._fleet.average_power_mw(board.index, now)
                    v.nvmlReturn = real.NVML_SUCCESS
                else:
                    v.nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        """mW."""
        with self._fleet._lock:
            self._board(handle)
        return POWER_LIMIT_MW

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        """mW."""
        with self._fleet._lock:
            self._board(handle)
        return POWER_LIMIT_MW

    # -- load ---------------------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        """``c_nvmlUtilization_t`` in percent, derived from the 1 s average power (busy boards draw more)."""
        with self._fleet._lock:
            board, now = self._board(handle)
            avg_mw = self._fleet.average_power_mw(board.index, now)
        busy = min(1.0, max(0.0, (avg_mw - 70_000) / (600_000 - 70_000)))
        return self._real.c_nvmlUtilization_t(gpu=round(100 * busy), memory=round(60 * busy))

    def _memory_used_b(self, board: _Board, now: float) -> int:
        kind = board.segments[board.segment_at(now)].kind
        fraction = {"idle": 0.006, "training": 0.88, "inference": 0.75}[kind]
        return int(MEMORY_TOTAL_B * fraction)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        """``c_nvmlMemory_t`` (or ``_v2_t`` when ``version`` is given) in bytes."""
        with self._fleet._lock:
            board, now = self._board(handle)
            used = self._memory_used_b(board, now)
        if version:
            mem = self._real.c_nvmlMemory_v2_t()
            mem.version, mem.reserved = version, 0
        else:
            mem = self._real.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = MEMORY_TOTAL_B, used, MEMORY_TOTAL_B - used
        return mem

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        """Objects with ``pid``, ``usedGpuMemory`` (bytes), ``gpuInstanceId``, ``computeInstanceId``."""
        with self._fleet._lock:
            board, now = self._board(handle)
            used = self._memory_used_b(board, now)
            pids = sorted(board.active_pids(now))
        share = used // len(pids) if pids else 0
        fields = {"usedGpuMemory": share, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF}
        return [self._real.nvmlFriendlyObject({"pid": pid, **fields}) for pid in pids]

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        """``c_nvmlProcessUtilizationSample_t`` per process and sample since ``timeStamp`` (CPU time, µs).

        Like NVML: samples on a ~1/6 s grid (per-board phase), each the process's mean utilisation over
        the sample period, only for processes with some utilisation in it; ``NVMLError_NotFound`` when
        there is no sample since ``timeStamp``. The buffer reaches back ``PROCESS_BUFFER_S``.
        """
        real = self._real
        samples: list[Any] = []
        with self._fleet._lock:
            board, now = self._board(handle)
            origin_s = self._fleet.created_s + board.phase_s
            since_s = max(int(timeStamp) / 1e6, now - PROCESS_BUFFER_S)
            k = math.floor((since_s - origin_s) / PROCESS_SAMPLE_PERIOD_S) + 1
            while (grid_s := origin_s + k * PROCESS_SAMPLE_PERIOD_S) <= now:
                stamp_us = int(grid_s * 1e6)
                if stamp_us > int(timeStamp):
                    for pid in sorted(board.proc_util):
                        sm = board.mean_process_util(pid, grid_s - PROCESS_SAMPLE_PERIOD_S, grid_s)
                        if sm > 0:
                            samples.append(
                                real.c_nvmlProcessUtilizationSample_t(
                                    pid=pid,
                                    timeStamp=stamp_us,
                                    smUtil=round(sm),
                                    memUtil=round(0.6 * sm),
                                    encUtil=0,
                                    decUtil=0,
                                )
                            )
                k += 1
        if not samples:
            raise real.NVMLError(real.NVML_ERROR_NOT_FOUND)
        return samples
