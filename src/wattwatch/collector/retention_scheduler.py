"""Runs the prune pass (``storage.retention``) on a schedule inside the collector.

Every ``interval_s`` (default 10 minutes) an APScheduler job deletes what is past retention
(``Settings.retention_days``, ``--retention-days``, ``WATTWATCH_RETENTION_DAYS``; 0 keeps everything),
in bounded chunks and within a budget of the interval, so a first pass over a large backlog spreads
over several ticks. On PostgreSQL only the replica holding the metrics-leader lock (``collector.leader``)
prunes: the deletes are safe to run twice, but N replicas scanning for the same rows is N times the work.
Tests call ``run_once`` (with an injectable clock) instead of waiting for the timer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from wattwatch.collector.leader import MetricsLeader
from wattwatch.config import Settings
from wattwatch.storage.retention import DAY_S, DEFAULT_INTERVAL_S, PruneResult, prune

log = logging.getLogger(__name__)


class RetentionScheduler:
    """Prunes past-retention rows every ``interval_s`` on the leading replica; retention 0 turns it off."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        *,
        clock: Callable[[], float],
        leader: MetricsLeader,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        if not settings.retention_days >= 0:
            raise ValueError(f"retention_days must be 0 (keep) or positive, got {settings.retention_days!r}")
        if not interval_s > 0:
            raise ValueError(f"prune interval must be positive seconds, got {interval_s!r}")
        self.engine = engine
        self.retention_s = settings.retention_days * DAY_S
        self.past_s = settings.time_window_past_s
        self.future_s = settings.time_window_future_s
        self.clock = clock
        self.leader = leader
        self.interval_s = interval_s
        self._scheduler: Any = None
        self._lock = threading.Lock()
        # Set after every pass the timer runs (tests wait on it rather than sleeping).
        self.passed = threading.Event()
        self.last: PruneResult | None = None

    def run_once(self, *, budget_s: float | None = None) -> PruneResult | None:
        """One pass now; None when this replica does not lead (another one prunes) or retention is 0."""
        if not self.retention_s:
            return None
        if not self.leader.is_leader():
            return None
        with self._lock:
            result = prune(
                self.engine,
                now_s=self.clock(),
                retention_s=self.retention_s,
                past_s=self.past_s,
                future_s=self.future_s,
                budget_s=budget_s,
            )
        if result.total:
            log.info("pruned %d rows past retention: %s", result.total, result.deleted)
        self.last = result
        return result

    def _timed_pass(self) -> None:
        try:
            self.run_once(budget_s=self.interval_s / 2)
        except SQLAlchemyError as exc:
            log.warning("prune pass failed: %s", exc)
        finally:
            self.passed.set()

    @property
    def running(self) -> bool:
        """Whether the timer is started."""
        return self._scheduler is not None

    def start(self) -> None:
        """Start the timer, with a first pass at once (no-op when retention is 0 or already started)."""
        if not self.retention_s or self._scheduler is not None:
            return
        from apscheduler.schedulers.background import BackgroundScheduler

        scheduler = BackgroundScheduler(timezone="UTC")
        scheduler.add_job(
            self._timed_pass, "interval", seconds=self.interval_s, id="retention", max_instances=1, coalesce=True
        )
        scheduler.start()
        self._scheduler = scheduler
        # A collector that was down for a while has a backlog due now, not an interval later.
        scheduler.add_job(self._timed_pass, id="retention-first")

    def stop(self) -> None:
        """Stop the timer, waiting for a pass in progress."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.shutdown(wait=True)
