"""Weights for a GPU several jobs share, settled a moment after the interval closes.

NVML samples per-process SM utilisation about six times a second, and each sample describes the period
before its timestamp: the samples covering the end of an interval arrive up to a sampling period after
it closes, so a job whose load just rose would be weighed with its old load if asked at the tick. The
settler holds such intervals for ``lag_s`` (one sampling period) and then asks for the utilisation over
exactly ``(t_start, t_end]`` (``NvmlSensor.process_utilization`` weighs each sample by its overlap with
the window and counts a process missing from a sample as idle in it). Intervals with one holder, or
without utilisation, never wait.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from wattwatch.protocol import wire

log = logging.getLogger(__name__)

NVML_SAMPLE_PERIOD_S = 1.0 / 6.0
DEFAULT_LAG_S = NVML_SAMPLE_PERIOD_S

# (device key, since_s, holders, pid -> job as of the interval, until_s) -> weights
WeighFn = Callable[[str, float, Sequence[str], Mapping[int, str], float], dict[str, float]]


@dataclass(order=True)
class _Held:
    due_s: float
    order: int
    interval: wire.Interval = field(compare=False)
    holders: tuple[str, ...] = field(compare=False)
    owners: Mapping[int, str] = field(compare=False)


class ShareSettler:
    """Holds shared GPU intervals until ``lag_s`` after they close, weighs them, then ``release``s them."""

    def __init__(
        self,
        weigh: WeighFn,
        release: Callable[[list[wire.Interval]], None],
        *,
        lag_s: float = DEFAULT_LAG_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lag_s = lag_s
        self._weigh = weigh
        self._release = release
        self._monotonic = monotonic
        self._heap: list[_Held] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def hold(self, interval: wire.Interval, holders: Sequence[str], owners: Mapping[int, str]) -> None:
        """Weigh ``interval`` (its equal-split shares are a placeholder) once its samples are in."""
        held = _Held(self._monotonic() + self.lag_s, next(self._order), interval, tuple(holders), owners)
        with self._cond:
            if self._closed:
                self._settle([held])
                return
            heapq.heappush(self._heap, held)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wattwatch-shares", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        """Intervals still waiting for their weights."""
        with self._cond:
            return len(self._heap)

    def close(self) -> None:
        """Weigh and release everything still held, now (the agent is stopping)."""
        with self._cond:
            self._closed = True
            rest, self._heap = sorted(self._heap), []
            self._cond.notify()
        self._settle(rest)
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0].due_s > self._monotonic()):
                    wait_s = self._heap[0].due_s - self._monotonic() if self._heap else None
                    self._cond.wait(wait_s)
                if self._closed:
                    return
                due: list[_Held] = []
                while self._heap and self._heap[0].due_s <= self._monotonic():
                    due.append(heapq.heappop(self._heap))
            self._settle(due)

    def _settle(self, held: list[_Held]) -> None:
        if not held:
            return
        for h in held:
            iv = h.interval
            try:
                iv.shares = self._weigh(iv.device, iv.t_start_s, h.holders, h.owners, iv.t_end_s)
            except Exception:  # keep the equal split rather than lose the interval
                log.exception("weighing %s's interval failed; it is split equally", iv.device)
        self._release([h.interval for h in held])
