"""The fine tick: while jobs send query spans, intervals close every ``fine_interval_s`` (on a fixed grid)
until ``hold_s`` after the last one, so per-query energy sees the power's shape within the normal tick.

A fine tick only reads the sensors and closes intervals (no process tracking). Its thread sleeps until
spans arrive; the worker takes the ticks it enqueues.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class FineTicker:
    """Enqueues a fine tick (``enqueue``) every ``period_s`` from when ``hold`` is called until ``hold_s``
    after the last call."""

    def __init__(self, period_s: float, hold_s: float, enqueue: Callable[[], None]) -> None:
        self.period_s = period_s
        self.hold_s = hold_s
        self._enqueue = enqueue
        self._until = 0.0  # time.monotonic() until which intervals close every period_s
        self._wake = threading.Event()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wattwatch-fine-tick", daemon=True)

    @property
    def ticking(self) -> bool:
        """Whether fine ticks are being enqueued now (query spans arrived lately)."""
        return time.monotonic() < self._until

    def hold(self) -> None:
        """Query spans arrived: tick finely (again) until ``hold_s`` from now."""
        self._until = time.monotonic() + self.hold_s
        self._wake.set()

    def start(self) -> None:
        """Start the ticker's thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (waits up to 2 s for it)."""
        self._halt.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        # Sleeps until spans arrive; then enqueues a fine tick every period_s (on a fixed grid, so a late
        # wake-up does not stretch the next interval) until the hold runs out.
        period_s = self.period_s
        while not self._halt.is_set():
            self._wake.wait()
            self._wake.clear()
            next_s = time.monotonic()
            while time.monotonic() < self._until:
                next_s = max(next_s + period_s, time.monotonic() - period_s)
                if self._halt.wait(max(0.0, next_s - time.monotonic())):
                    return
                self._enqueue()
