"""Runs the silent-host pass (``storage.silent_hosts``) on a schedule inside the collector.

Every ``interval_s`` (a tenth of ``silent_after_s``, between 1 s and 60 s) an APScheduler job ends the
running jobs of hosts not heard from for ``silent_after_s`` (``Settings.host_silent_after_s``,
``WATTWATCH_HOST_SILENT_AFTER``). A collector that was itself down has not heard from anyone: it
gives every host ``silent_after_s`` from its own start before judging it. Tests call ``run_once``
with an injectable clock instead of waiting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from wattwatch.storage.silent_hosts import end_jobs_of_silent_hosts

log = logging.getLogger(__name__)


class SilentHostScheduler:
    """Ends the jobs of silent hosts every ``interval_s``; ``silent_after_s`` 0 turns it off."""

    def __init__(self, engine: Engine, *, clock: Callable[[], float], silent_after_s: float) -> None:
        if silent_after_s < 0:
            raise ValueError(f"host_silent_after_s must be 0 (off) or positive seconds, got {silent_after_s!r}")
        self.engine = engine
        self.clock = clock
        self.silent_after_s = silent_after_s
        self.interval_s = min(max(silent_after_s / 10.0, 1.0), 60.0)
        self.started_s = clock()
        self._scheduler: Any = None
        self._lock = threading.Lock()

    def run_once(self) -> list[str]:
        """One pass now; returns the ids of the jobs it ended."""
        if not self.silent_after_s:
            return []
        now_s = self.clock()
        if now_s - self.started_s < self.silent_after_s:
            return []  # agents have not had the time to reach this collector yet
        with self._lock:
            ended = end_jobs_of_silent_hosts(self.engine, now_s=now_s, silent_after_s=self.silent_after_s)
        for job_id in ended:
            log.warning(
                "job %s ended: no host running it has pushed for %.0f s (ended_by collector-silent-agent)",
                job_id,
                self.silent_after_s,
            )
        return ended

    def _timed_pass(self) -> None:
        try:
            self.run_once()
        except SQLAlchemyError as exc:
            log.warning("silent-host pass failed: %s", exc)

    def start(self) -> None:
        """Start the timer (no-op when off or already started)."""
        if not self.silent_after_s or self._scheduler is not None:
            return
        from apscheduler.schedulers.background import BackgroundScheduler

        scheduler = BackgroundScheduler(timezone="UTC")
        scheduler.add_job(
            self._timed_pass, "interval", seconds=self.interval_s, id="silent-hosts", max_instances=1, coalesce=True
        )
        scheduler.start()
        self._scheduler = scheduler

    def stop(self) -> None:
        """Stop the timer, waiting for a pass in progress."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.shutdown(wait=True)
