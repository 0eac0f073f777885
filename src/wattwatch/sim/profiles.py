"""Activity power profiles of the simulated GPUs: exact, reproducible power as a function of time.

Power is piecewise constant on 10 ms slots, each slot's value an integer number of milliwatts drawn
from a splitmix64 hash (never Python's salted ``hash()``), so the exact integral is a sum of integers
plus two partial slots and any process that replays the same timeline gets the same joules. Profiles
are written for a 700 W H100 and scaled to other boards' power limits. ``Square`` is the exception:
an exact square wave (not slot based) for aliasing tests.
"""

from __future__ import annotations

import math
from bisect import bisect_right

ACTIVITY_KINDS = ("idle", "training", "inference", "square")

SLOT_S = 0.01  # power is constant over each 10 ms slot
BLOCK_SLOTS = 100  # slot sums are cached per 1 s block
REFERENCE_LIMIT_MW = 700_000  # the profiles' levels are an H100's
POWER_LIMIT_MW = REFERENCE_LIMIT_MW

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
KIND_CODE = {"idle": 0x1D1E, "training": 0x7A41, "inference": 0x1F3E, "square": 0x5C1A}


def mix64(x: int) -> int:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash that is the same in every process."""
    z = (x + _GAMMA) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def hash_key(*parts: int) -> int:
    """A 64-bit key from integers, the same in every process."""
    h = 0x5EED
    for part in parts:
        h = mix64(h ^ (part & _MASK))
    return h


def pick(h: int, shift: int, lo: int, hi: int) -> int:
    """An integer in [lo, hi] from 16 bits of ``h`` (several independent picks per hash)."""
    return lo + ((h >> shift) & 0xFFFF) * (hi - lo + 1) // 0x10000


class Profile:
    """Slot powers (integer mW) of one activity, with slot 0 starting at ``anchor_s``.

    Caches the values of recently used 1 s blocks and a running sum of block totals, so an integral
    costs at most one block of hashing once the blocks before it have been summed.
    """

    kind = "idle"

    def __init__(self, key: int, anchor_s: float, limit_mw: int = REFERENCE_LIMIT_MW) -> None:
        self.key = key
        self.anchor_s = anchor_s
        self.limit_mw = limit_mw
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
            if self.limit_mw != REFERENCE_LIMIT_MW:
                # Integer scaling keeps the exact integral a sum of integers on smaller boards too.
                vals = [v * self.limit_mw // REFERENCE_LIMIT_MW for v in vals]
            self._blocks[b] = vals
        return vals

    def slot_mw(self, k: int) -> int:
        """Power of slot ``k`` in mW."""
        return self._block(k // BLOCK_SLOTS)[k % BLOCK_SLOTS]

    def power_mw_at(self, t_s: float) -> int:
        """Power at ``t_s`` in mW (the value of the slot holding it)."""
        return self.slot_mw(self.locate(t_s)[0])

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


class Idle(Profile):
    """Idle board: a per-board level of 62-70 W with +-1.5 W of slot noise."""

    kind = "idle"

    def __init__(self, key: int, anchor_s: float, board_key: int, limit_mw: int = REFERENCE_LIMIT_MW) -> None:
        super().__init__(key, anchor_s, limit_mw)
        self._base_mw = pick(mix64(board_key), 0, 62_000, 70_000)

    def values_mw(self, k0: int, k1: int) -> list[int]:
        """Power of slots ``k0 .. k1-1`` in mW."""
        key, base = self.key, self._base_mw
        return [base - 1500 + mix64((key + k * _GAMMA) & _MASK) % 3001 for k in range(k0, k1)]


class Training(Profile):
    """Training: 0.5-1.0 s steps at 560-670 W, each opening with a 10-20 % data-loading dip at 200-300 W."""

    kind = "training"

    def __init__(self, key: int, anchor_s: float, limit_mw: int = REFERENCE_LIMIT_MW) -> None:
        super().__init__(key, anchor_s, limit_mw)
        self.step_slots = pick(mix64(key ^ 0x57E9), 0, 50, 100)
        self._steps: dict[int, tuple[int, int, int]] = {}

    def _step(self, j: int) -> tuple[int, int, int]:
        got = self._steps.get(j)
        if got is None:
            if len(self._steps) > 4096:
                self._steps.clear()
            h = mix64((self.key ^ 0x5AE9 ^ (j * _GAMMA)) & _MASK)
            dip_slots = self.step_slots * pick(h, 0, 10, 20) // 100
            got = (dip_slots, pick(h, 16, 200_000, 300_000), pick(h, 32, 560_000, 670_000))
            self._steps[j] = got
        return got

    def values_mw(self, k0: int, k1: int) -> list[int]:
        """Power of slots ``k0 .. k1-1`` in mW."""
        out: list[int] = []
        key, n = self.key, self.step_slots
        for k in range(k0, k1):
            j, pos = divmod(k, n)
            dip_slots, dip_mw, compute_mw = self._step(j)
            noise = mix64((key + k * _GAMMA) & _MASK)
            if pos < dip_slots:
                out.append(dip_mw - 8000 + noise % 16001)
            else:
                out.append(min(POWER_LIMIT_MW, compute_mw - 12_000 + noise % 24001))
        return out


class Inference(Profile):
    """Inference: bursty requests, each a gap (90-120 W), a prefill spike (650-700 W, 30-80 ms) and a
    decode plateau (350-500 W, 0.2-1.5 s). Request r's gap starts at slot ``_starts[r]``."""

    kind = "inference"

    def __init__(self, key: int, anchor_s: float, limit_mw: int = REFERENCE_LIMIT_MW) -> None:
        super().__init__(key, anchor_s, limit_mw)
        # (gap_slots, prefill_slots, decode_slots, gap_mw, prefill_mw, decode_mw) per request
        self._requests: list[tuple[int, int, int, int, int, int]] = []
        self._starts: list[int] = []
        self._end = 0

    def _extend_to(self, k: int) -> None:
        while self._end <= k:
            r = len(self._requests)
            h = mix64((self.key ^ 0x1CF ^ (r * _GAMMA)) & _MASK)
            g = mix64(h)
            # Bursty arrivals: mostly short gaps (10-200 ms), sometimes a lull (0.3-3 s).
            gap = pick(g, 0, 1, 20) if pick(g, 16, 0, 99) < 70 else pick(g, 32, 30, 300)
            req = (gap, pick(h, 0, 3, 8), pick(h, 16, 20, 150))
            levels = (pick(g, 48, 90_000, 120_000), pick(h, 32, 650_000, 695_000), pick(h, 48, 350_000, 500_000))
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
            noise = mix64((key + k * _GAMMA) & _MASK) % 10001 - 5000
            level = gap_mw if pos < gap else prefill_mw if pos < gap + prefill else decode_mw
            out.append(min(POWER_LIMIT_MW, level + noise))
        return out


class Square(Profile):
    """An exact square wave: ``high_mw`` for the first half of each ``period_s`` from ``anchor_s``, then
    ``low_mw``. Not slot based, so it can be faster than a slot or out of step with the 10 ms grid:
    the benchmark's probe for aliasing against the counter's refresh period."""

    kind = "square"

    def __init__(self, key: int, anchor_s: float, period_s: float, low_mw: int, high_mw: int) -> None:
        super().__init__(key, anchor_s)
        if period_s <= 0:
            raise ValueError(f"a square wave needs a positive period, got {period_s}")
        self.period_s, self.low_mw, self.high_mw = period_s, low_mw, high_mw

    def values_mw(self, k0: int, k1: int) -> list[int]:
        """Slot values are not used by a square wave (its power is exact at every instant)."""
        return [self.power_mw_at(self.anchor_s + (k + 0.5) * SLOT_S) for k in range(k0, k1)]

    def power_mw_at(self, t_s: float) -> int:
        """``high_mw`` in the first half of each period, ``low_mw`` in the second."""
        x = (t_s - self.anchor_s) / self.period_s
        return self.high_mw if x - math.floor(x) < 0.5 else self.low_mw

    def _mwh_from_anchor(self, t_s: float) -> float:
        """Integral of power (mW x s) from the anchor to ``t_s``."""
        x = t_s - self.anchor_s
        n = math.floor(x / self.period_s)
        r = x - n * self.period_s
        half = self.period_s / 2
        return n * (self.high_mw + self.low_mw) * half + self.high_mw * min(r, half) + self.low_mw * max(0.0, r - half)

    def energy_j(self, t0_s: float, t1_s: float) -> float:
        """Exact integral over ``[t0_s, t1_s]`` in joules."""
        return (self._mwh_from_anchor(t1_s) - self._mwh_from_anchor(t0_s)) / 1000.0


def make_profile(
    kind: str,
    key: int,
    anchor_s: float,
    board_key: int,
    limit_mw: int = REFERENCE_LIMIT_MW,
    square: tuple[float, int, int] | None = None,
) -> Profile:
    """The profile of activity ``kind`` starting at ``anchor_s``; ``square`` is (period_s, low_mw, high_mw)."""
    if kind == "square":
        if square is None:
            raise ValueError("a square activity needs (period_s, low_mw, high_mw)")
        return Square(key, anchor_s, *square)
    if kind == "training":
        return Training(key, anchor_s, limit_mw)
    if kind == "inference":
        return Inference(key, anchor_s, limit_mw)
    return Idle(key, anchor_s, board_key, limit_mw)
