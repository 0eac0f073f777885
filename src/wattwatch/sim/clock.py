"""Simulated time for tests and benchmarks: one clock that code under test reads and sleeps on.

A ``FakeClock`` is a callable returning the current time (so it fits every ``clock=`` parameter) and
has ``sleep`` (for every ``sleep=`` parameter): sleeping advances the clock instead of waiting, so a
sensor that polls a counter for 100 ms costs no real time and always sees the same instants.
"""

from __future__ import annotations

T0_S = 1_700_000_000.0  # a plausible Unix time (November 2023), so timestamps look like real ones


class FakeClock:
    """Settable simulated time: ``clock()`` / ``now()`` read it, ``sleep`` and ``advance`` move it on.

    ``t_s`` is public: a test may also set it directly (``clock.t_s = T0 + 5``).
    """

    def __init__(self, t_s: float = T0_S) -> None:
        self.t_s = float(t_s)

    def __call__(self) -> float:
        return self.t_s

    def now(self) -> float:
        """The current simulated time (Unix seconds)."""
        return self.t_s

    def sleep(self, dt_s: float) -> None:
        """What ``time.sleep`` would do: the clock moves on by ``dt_s`` (never back, as real time)."""
        self.t_s += max(0.0, dt_s)

    def advance(self, dt_s: float) -> float:
        """Move the clock on by ``dt_s`` (>= 0) and return the new time."""
        if dt_s < 0:
            raise ValueError(f"a clock does not go back (advance by {dt_s} s)")
        self.t_s += dt_s
        return self.t_s

    def __repr__(self) -> str:
        return f"FakeClock({self.t_s!r})"
