"""What real boards and drivers do that an ideal simulator does not: each a knob of ``Flaws``.

- ``refresh_period_s``: the energy counter and power readings refresh every 10-200 ms depending on
  the board; each board draws its own period (whole milliseconds) from this range, or the board
  generation's period applies when unset;
- ``power_noise_w``: instant power readings are the true power plus seeded Gaussian noise of this
  standard deviation (``nvmlDeviceGetPowerUsage``, a mean of one reading per refresh over its window,
  carries it divided by the square root of those readings); the energy counter stays exact, it is the
  truth the hardware accumulates;
- ``call_latency_s`` / ``call_jitter_s``: every NVML call takes this long plus an exponential tail of
  this mean; the value is read at a random point inside the call (on a ``FakeClock`` the call
  advances it, in real time it sleeps);
- ``process_delay_s``: a new process shows up in the compute-process list and in the per-process
  utilisation samples only this long after it starts on the board (drawn per board and process);
- ``start_lag_s`` / ``end_lag_s``: a job's load begins this long after its job opens and ends this long
  after it closes (negative: before), drawn per job; ``SimulatedFleet.load_lag_s`` gives them to
  whatever turns job boundaries into load;
- ``process_sample_period_s``: how often NVML samples per-process utilisation (the generation's when
  unset).

Every draw is a pure function of ``seed`` and what it is for (board, process, job, time slot), so a
replay or a second reader sees the same flaws. ``PRESETS`` names ready-made sets (``none``,
``realistic``); ``parse_flaws`` reads a command-line spec such as ``realistic,refresh_ms=20``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import zlib
from dataclasses import dataclass

from wattwatch.sim.profiles import hash_key, mix64

Range = tuple[float, float]

_TWO_53 = float(1 << 53)
# Tags that keep the draws for different purposes independent of each other.
_REFRESH, _NOISE, _NOISE_2, _DELAY, _LAG, _CALLS = 0x2EF2, 0x0153, 0x0154, 0xDE1A, 0x1A65, 0xCA11


def unit(h: int) -> float:
    """A float in [0, 1) from a 64-bit hash."""
    return (mix64(h) >> 11) / _TWO_53


def _in(r: Range, u: float) -> float:
    return r[0] + (r[1] - r[0]) * u


@dataclass(frozen=True)
class Flaws:
    """The flaws a simulated fleet shows (see the module docstring); the default is an ideal board."""

    refresh_period_s: Range | None = None
    power_noise_w: float = 0.0
    call_latency_s: float = 0.0
    call_jitter_s: float = 0.0
    process_delay_s: Range = (0.0, 0.0)
    start_lag_s: Range = (0.0, 0.0)
    end_lag_s: Range = (0.0, 0.0)
    process_sample_period_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        def check_range(name: str, r: Range, lo: float, hi: float) -> None:
            if len(r) != 2 or not (lo <= r[0] <= r[1] <= hi):
                raise ValueError(f"{name} must be a range within {lo:g}..{hi:g} with low <= high, got {r}")

        if self.refresh_period_s is not None:
            check_range("refresh_period_s", self.refresh_period_s, 0.001, 10.0)
        check_range("process_delay_s", self.process_delay_s, 0.0, 3600.0)
        check_range("start_lag_s", self.start_lag_s, 0.0, 3600.0)
        check_range("end_lag_s", self.end_lag_s, -3600.0, 3600.0)
        for name in ("power_noise_w", "call_latency_s", "call_jitter_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.call_latency_s + 10 * self.call_jitter_s > 1.0:
            raise ValueError("an NVML call of a second or more is not a flaw but a hang; use call_latency_s < 1")
        period = self.process_sample_period_s
        if period is not None and not 0.001 <= period <= 10.0:
            raise ValueError(f"process_sample_period_s must be within 0.001..10 s, got {period}")

    @property
    def ideal(self) -> bool:
        """Whether no flaw is switched on."""
        return dataclasses.replace(self, seed=0) == Flaws()

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (ranges as lists); ``from_dict`` reads it back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Flaws:
        """The inverse of ``as_dict``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields}
        return cls(**kwargs)  # type: ignore[arg-type]

    # -- draws --------------------------------------------------------------------------------------

    def refresh_period_for(self, board_key: int, default_s: float) -> float:
        """Board ``board_key``'s refresh period: drawn from the range in whole ms, or ``default_s``."""
        r = self.refresh_period_s
        if r is None:
            return default_s
        if r[0] == r[1]:
            return r[0]
        lo_ms, hi_ms = math.ceil(r[0] * 1000 - 1e-9), math.floor(r[1] * 1000 + 1e-9)
        if hi_ms < lo_ms:  # a range narrower than a millisecond
            return _in(r, unit(hash_key(self.seed, _REFRESH, board_key)))
        return (lo_ms + math.floor(unit(hash_key(self.seed, _REFRESH, board_key)) * (hi_ms - lo_ms + 1))) / 1000

    def noise_w(self, board_key: int, slot: int) -> float:
        """The instant-power noise (W) of the reading in ``slot`` (Gaussian, standard deviation
        ``power_noise_w``); the same slot always gets the same noise."""
        if self.power_noise_w == 0:
            return 0.0
        u1 = unit(hash_key(self.seed, _NOISE, board_key, slot))
        u2 = unit(hash_key(self.seed, _NOISE_2, board_key, slot))
        return self.power_noise_w * math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)

    def process_delay_for(self, board_key: int, pid: int) -> float:
        """How long after it starts on the board process ``pid`` shows up in NVML's lists."""
        return _in(self.process_delay_s, unit(hash_key(self.seed, _DELAY, board_key, pid)))

    def lag_s(self, job: str, edge: str) -> float:
        """How late job ``job``'s load follows its ``edge`` (``start`` or ``end``) boundary."""
        if edge not in ("start", "end"):
            raise ValueError(f"edge must be 'start' or 'end', got {edge!r}")
        r = self.start_lag_s if edge == "start" else self.end_lag_s
        key = zlib.crc32(f"{edge}:{job}".encode())
        return _in(r, unit(hash_key(self.seed, _LAG, key)))

    def call_rng(self, salt: int = 0) -> CallCost:
        """A seeded source of NVML call durations."""
        return CallCost(self, hash_key(self.seed, _CALLS, salt))

    def describe(self) -> str:
        """One line saying which flaws are on, for start-up messages."""
        if self.ideal:
            return "ideal (no flaws)"
        parts = []
        if self.refresh_period_s is not None:
            lo, hi = (v * 1000 for v in self.refresh_period_s)
            parts.append(f"refresh {lo:g} ms" if lo == hi else f"refresh {lo:g}-{hi:g} ms per board")
        if self.power_noise_w:
            parts.append(f"instant power noise {self.power_noise_w:g} W")
        if self.call_latency_s or self.call_jitter_s:
            parts.append(f"NVML calls {self.call_latency_s * 1e3:g} ms + {self.call_jitter_s * 1e3:g} ms jitter")
        if self.process_delay_s != (0.0, 0.0):
            parts.append(f"process list {_span(self.process_delay_s)} s late")
        if self.start_lag_s != (0.0, 0.0) or self.end_lag_s != (0.0, 0.0):
            parts.append(f"load {_span(self.start_lag_s)} s after job start, {_span(self.end_lag_s)} s after end")
        if self.process_sample_period_s is not None:
            parts.append(f"process samples every {self.process_sample_period_s * 1e3:g} ms")
        return ", ".join(parts)


def _span(r: Range) -> str:
    return f"{r[0]:g}" if r[0] == r[1] else f"{r[0]:g} to {r[1]:g}"


class CallCost:
    """Durations of NVML calls: ``call_latency_s`` plus an exponential tail of mean ``call_jitter_s``,
    and where inside the call the value is read. Thread-safe; seeded."""

    def __init__(self, flaws: Flaws, seed: int) -> None:
        self.flaws = flaws
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def draw(self) -> tuple[float, float]:
        """(time before the value is read, time after it) of one call, in seconds."""
        f = self.flaws
        if f.call_latency_s == 0 and f.call_jitter_s == 0:
            return 0.0, 0.0
        with self._lock:
            tail = self._rng.expovariate(1.0 / f.call_jitter_s) if f.call_jitter_s > 0 else 0.0
            split = self._rng.random()
        # A tail draw is capped so that one unlucky call never looks like a hung driver.
        total = f.call_latency_s + min(tail, 10 * f.call_jitter_s)
        return total * split, total * (1.0 - split)


PRESETS: dict[str, Flaws] = {
    "none": Flaws(),
    # What a busy real host shows: boards that refresh anywhere from 10 to 200 ms, a few watts of noise
    # on instant power, sub-millisecond NVML calls with a tail, processes listed 0.5-2 s after they
    # start, and workloads that start up to half a second after their job opens and stop within
    # 0.1 s either side of its end.
    "realistic": Flaws(
        refresh_period_s=(0.010, 0.200),
        power_noise_w=5.0,
        call_latency_s=0.0003,
        call_jitter_s=0.0002,
        process_delay_s=(0.5, 2.0),
        start_lag_s=(0.002, 0.5),
        end_lag_s=(-0.1, 0.1),
    ),
}

# Command-line keys: (Flaws field, scale to SI units, whether it is a range).
_KEYS: dict[str, tuple[str, float, bool]] = {
    "refresh_ms": ("refresh_period_s", 1e-3, True),
    "noise_w": ("power_noise_w", 1.0, False),
    "latency_ms": ("call_latency_s", 1e-3, False),
    "jitter_ms": ("call_jitter_s", 1e-3, False),
    "process_delay_s": ("process_delay_s", 1.0, True),
    "start_lag_s": ("start_lag_s", 1.0, True),
    "end_lag_s": ("end_lag_s", 1.0, True),
    "process_sample_ms": ("process_sample_period_s", 1e-3, False),
    "seed": ("seed", 1.0, False),
}


def parse_flaws(spec: str) -> Flaws:
    """Read ``PRESET`` and/or ``KEY=VALUE`` items, comma separated, e.g. ``realistic,refresh_ms=20`` or
    ``noise_w=3,process_delay_s=0.5:2``; a range is ``LOW:HIGH``. Raises ValueError naming what to fix."""
    flaws = Flaws()
    changes: dict[str, object] = {}
    for item in (p.strip() for p in spec.split(",")):
        if not item:
            continue
        if "=" not in item:
            if item.lower() not in PRESETS:
                raise ValueError(f"unknown simulator flaws preset {item!r}; use one of {', '.join(PRESETS)}")
            flaws = PRESETS[item.lower()]
            continue
        key, _, text = (s.strip() for s in item.partition("="))
        if key not in _KEYS:
            raise ValueError(f"unknown simulator flaw {key!r}; use {', '.join(_KEYS)}")
        name, scale, is_range = _KEYS[key]
        try:
            if key == "seed":
                changes[name] = int(text)
            elif is_range:
                lo, sep, hi = text.partition(":")
                changes[name] = (float(lo) * scale, float(hi if sep else lo) * scale)
            else:
                changes[name] = float(text) * scale
        except ValueError:
            want = "LOW:HIGH or a number" if is_range else "a number"
            raise ValueError(f"simulator flaw {key}={text!r}: want {want}") from None
    try:
        return dataclasses.replace(flaws, **changes)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"simulator flaws {spec!r}: {exc}") from None
