"""Runs the span-energy pass (``storage.span_energy``) on a schedule inside the collector.

APScheduler's ``BackgroundScheduler`` calls ``run_once`` every ``interval_s`` on its own thread, at
most one run at a time (a pass that overruns its interval delays the next; it never overlaps it).
``create_app``'s lifespan starts it and stops it, then runs one last pass with no settle delay so
that a collector shutting down (``wattwatch up`` stopping) leaves every finished job computed. Tests
call ``run_once`` directly instead of waiting for the timer.

Every collector replica runs its own scheduler; the pass itself is safe to run concurrently
(per-job advisory locks, idempotent recomputation), so replicas share the work.

Each timed pass runs at most ``PASS_BUDGET_S`` (checked before every window, and a window holds at most
``chunk_s`` of one job's data), so a backlog never holds a core for long: a pass that leaves work
behind is followed by another after a pause as long as itself, until the backlog is gone. ``stop``
sets a flag the pass checks with its budget, so shutdown waits for one window at most, then gives the
final pass ``FINAL_PASS_BUDGET_S``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.schedulers import SchedulerNotRunningError
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from wattwatch.storage.span_energy import DEFAULT_SETTLE_S, PassResult, compute_span_energy

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
# One timed pass works this long at most: the pass shares a core (and SQLite's write lock) with ingest.
PASS_BUDGET_S = 1.0
# The pass at shutdown stops after this long: a collector told to stop (SIGTERM, `wattwatch up` ending)
# should be gone within a few seconds, and whatever is left over the next collector to start computes.
FINAL_PASS_BUDGET_S = 1.0


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
        # Set by stop: a timed pass in progress ends at its next window.
        self._stopping = threading.Event()

    @property
    def running(self) -> bool:
        """Whether the timer is started."""
        return self._scheduler is not None

    def run_once(
        self, *, settle_s: float | None = None, budget_s: float | None = None, stoppable: bool = False
    ) -> PassResult:
        """One pass now, to completion unless ``budget_s`` says otherwise (or, if ``stoppable``, ``stop``).

        ``settle_s`` overrides the configured delay (0 computes everything received so far).
        """
        with self._lock:
            return compute_span_energy(
                self.engine,
                now_s=self.clock(),
                settle_s=self.settle_s if settle_s is None else settle_s,
                budget_s=budget_s,
                stop=self._stopping.is_set if stoppable else None,
            )

    def _timed_pass(self) -> None:
        started = time.monotonic()
        try:
            # A pass that runs past its budget hands the rest to the next one.
            result = self.run_once(budget_s=PASS_BUDGET_S, stoppable=True)
        except SQLAlchemyError as exc:
            # The database is down or unmigrated; /readyz says so. Try again at the next tick.
            log.warning("span-energy pass failed: %s", exc)
            return
        if result.windows:
            log.debug("span-energy pass: %s", result)
        scheduler = self._scheduler
        if not result.complete and scheduler is not None and not self._stopping.is_set():
            # A backlog: go on after a pause as long as the pass (half a core at most), not an interval later.
            pause_s = max(time.monotonic() - started, 0.05)
            with contextlib.suppress(SchedulerNotRunningError):  # stopping meanwhile
                scheduler.add_job(
                    self._timed_pass,
                    "date",
                    run_date=datetime.now(UTC) + timedelta(seconds=pause_s),
                    id="span-energy-more",
                    replace_existing=True,
                )

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
        """Stop the timer (a pass in progress ends at its next window), then compute for at most
        ``FINAL_PASS_BUDGET_S`` what is left, unless told not to."""
        self._stopping.set()
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.shutdown(wait=True)
        if final_pass and self.interval_s is not None:
            try:
                self.run_once(settle_s=0.0, budget_s=FINAL_PASS_BUDGET_S)
            except SQLAlchemyError as exc:
                log.warning("final span-energy pass failed: %s", exc)
        self._stopping.clear()  # a later start runs passes again
