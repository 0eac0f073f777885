"""Runs the span-energy pass (``storage.span_energy``) on a schedule inside the collector.

APScheduler's ``BackgroundScheduler`` calls ``run_once`` every ``interval_s`` on its own thread, at
most one run at a time (a pass that overruns its interval delays the next; it never overlaps it).
``create_app``'s lifespan starts it and stops it, then runs one last pass with no settle delay so
that a collector shutting down (``wattwatch up`` stopping) leaves every finished job computed. Tests
call ``run_once`` directly instead of waiting for the timer.

Every collector replica runs its own scheduler; the pass itself is safe to run concurrently
(per-job advisory locks, idempotent recomputation), so replicas share the work.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from wattwatch.storage.span_energy import DEFAULT_SETTLE_S, PassResult, compute_span_energy

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
# The pass at shutdown stops after this long: `wattwatch up` waits 10 s for its collector thread, and
# whatever is left over is computed by the next collector to start.
FINAL_PASS_BUDGET_S = 5.0


class SpanEnergyScheduler:
    """Computes per-span energies every ``interval_s`` for data older than ``settle_s``."""

    def __init__(
        self,
        engine: Engine,
        *,
        clock: Callable[[], float],
        interval_s: float | None = DEFAULT_INTERVAL_S,
        settle_s: float = DEFAULT_SETTLE_S,
    ) -> None:
        if interval_s is not None and not interval_s > 0:
            raise ValueError(f"span-energy interval must be positive seconds (or None to disable), got {interval_s!r}")
        self.engine = engine
        self.clock = clock
        self.interval_s = interval_s
        self.settle_s = settle_s
        self._scheduler: Any = None
        # run_once may be called from a route or a test while the timer thread runs one too.
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        """Whether the timer is started."""
        return self._scheduler is not None

    def run_once(self, *, settle_s: float | None = None, budget_s: float | None = None) -> PassResult:
        """One pass now, to completion unless ``budget_s`` says otherwise.

        ``settle_s`` overrides the configured delay (0 computes everything received so far).
        """
        with self._lock:
            return compute_span_energy(
                self.engine,
                now_s=self.clock(),
                settle_s=self.settle_s if settle_s is None else settle_s,
                budget_s=budget_s,
            )

    def _timed_pass(self) -> None:
        try:
            # A pass that runs longer than its interval hands the rest to the next one.
            result = self.run_once(budget_s=self.interval_s)
        except SQLAlchemyError as exc:
            # The database is down or unmigrated; /readyz says so. Try again at the next tick.
            log.warning("span-energy pass failed: %s", exc)
            return
        if result.windows:
            log.debug("span-energy pass: %s", result)

    def start(self) -> None:
        """Start the timer (no-op when disabled or already started)."""
        if self.interval_s is None or self._scheduler is not None:
            return
        from apscheduler.schedulers.background import BackgroundScheduler

        scheduler = BackgroundScheduler(timezone="UTC")
        scheduler.add_job(
            self._timed_pass,
            "interval",
            seconds=self.interval_s,
            id="span-energy",
            max_instances=1,
            coalesce=True,
        )
        scheduler.start()
        self._scheduler = scheduler
        # Start with a pass rather than an interval later: what the last collector left is due now.
        scheduler.add_job(self._timed_pass, id="span-energy-first")

    def stop(self, *, final_pass: bool = True) -> None:
        """Stop the timer (waiting for a pass in progress), then compute what is left unless told not to."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.shutdown(wait=True)
        if final_pass and self.interval_s is not None:
            try:
                self.run_once(settle_s=0.0, budget_s=FINAL_PASS_BUDGET_S)
            except SQLAlchemyError as exc:
                log.warning("final span-energy pass failed: %s", exc)
