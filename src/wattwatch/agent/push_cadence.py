"""When the agent's batches are sealed and pushed: a push thread pushes every ``push_interval_s`` and at
once when the worker seals a batch (a job's start or end), and at shutdown the spool is drained while
the collector takes batches.

The worker seals at the first scheduled tick a push interval after the last seal and wakes the push
thread, so a fleet sends one batch per push interval instead of one per tick, while a job's start and
end reach the collector without waiting.

A seal, a stage or an acknowledgement that cannot write to the spool because its disk is full
(``spool.disk_full``) is caught here and told to the outbox (``Outbox.spool_unwritable``: one WARNING
for the outage, not a traceback per tick); the records wait in memory for the next write.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from wattwatch import redact
from wattwatch.agent.outbox import Outbox
from wattwatch.agent.push import Pusher
from wattwatch.agent.spool import Spool, disk_full

log = logging.getLogger(__name__)

T = TypeVar("T")


class PushCadence:
    """Seals the outbox into batches and pushes the spool on the agent's push schedule."""

    def __init__(
        self,
        outbox: Outbox,
        pusher: Pusher,
        spool: Spool,
        collector_url: str,
        push_interval_s: float,
        interval_s: float,
    ) -> None:
        self.outbox = outbox
        self.pusher = pusher
        self.spool = spool
        self.collector_url = collector_url
        self.push_interval_s = push_interval_s
        self.interval_s = interval_s
        self._wake = threading.Event()  # set: push now (the worker sealed a batch)
        self._sealed_at_s = time.monotonic()  # when a batch was last sealed (the push is due a push interval on)
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wattwatch-push", daemon=True)

    def seal(self) -> int | None:
        """Move everything measured so far into one durable batch; returns its seq (None if empty)."""
        self._sealed_at_s = time.monotonic()
        return self._writing(self.outbox.seal)

    def stage(self) -> int | None:
        """Make what was measured since the last stage durable as a part of the next batch; returns that
        batch's seq (None when nothing was measured, or the spool's disk is full: it waits in memory)."""
        return self._writing(self.outbox.stage)

    def _writing(self, write: Callable[[], T]) -> T | None:
        """``write()``, a write to the spool; None when its disk is full, told to the outbox (what the write
        took waits in memory for the next one). Any other error is raised."""
        try:
            return write()
        except (sqlite3.OperationalError, OSError) as exc:
            if not disk_full(exc):
                raise
            self.outbox.spool_unwritable(exc)
            return None

    def flush(self) -> None:
        """Seal pending measurements and push the spool (what the push thread does every push interval)."""
        self.seal()
        self.pusher.push_pending()

    def push_soon(self) -> None:
        """Wake the push thread: a batch was sealed."""
        self._wake.set()

    def due(self) -> bool:
        """Whether a scheduled tick now should seal (the push is due).

        Half a tick early at most: the last seal came a few ms into its tick, and a push interval of whole
        ticks must not wait a tick more."""
        return time.monotonic() - self._sealed_at_s >= self.push_interval_s - self.interval_s / 2

    def start(self) -> None:
        """Start the push thread."""
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop the push thread, waiting at most ``timeout_s`` for a push in flight."""
        self._halt.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def drain(self, timeout_s: float, say: Callable[[str], None] | None, give_up: threading.Event | None) -> None:
        """Push the spool at shutdown while the collector takes batches (see ``Agent.stop``); say what is left."""
        tell = say or (lambda line: log.warning("%s", line))
        left = self.spool.pending()
        started = time.monotonic()
        told = started
        if left > 1:
            tell(f"pushing the {left} batches left in the spool to {redact.url(self.collector_url)}")
        while left and time.monotonic() - started < timeout_s and not (give_up and give_up.is_set()):
            took = self._writing(lambda: self.pusher.push_pending(force=True))
            if took is None:
                break  # an acknowledgement cannot be written (a full disk): the next start pushes it again
            if took:
                break  # what is left waits for its own retry (agent.poison): the next start tries it again
            now_left = self.spool.pending()
            if now_left >= left:
                break  # nothing landed: the collector is away or refusing; waiting would only delay the stop
            left = now_left
            if time.monotonic() - told >= 1.0:
                told = time.monotonic()
                tell(f"{left} batches left to push")
        left = self.spool.pending()
        if left:
            why = f" ({self.pusher.stats.last_error})" if self.pusher.stats.last_error else ""
            tell(
                f"{left} batches not yet accepted by the collector{why} stay in {self.spool.path} for the next "
                "start; nothing is lost"
            )
        elif time.monotonic() - started >= 1.0:
            tell("spool drained: the collector has every batch")

    def _run(self) -> None:
        # Woken by the worker when it has sealed a batch: every push_interval_s (at the first scheduled tick
        # after it) and at once when a job starts or ends. Seals itself only when the worker has not for a
        # push interval and a tick more (it is not ticking, or stuck in a read).
        patience_s = self.push_interval_s + self.interval_s + 1.0
        while not self._halt.is_set():
            woken = self._wake.wait(patience_s)
            if self._halt.is_set():
                return
            self._wake.clear()
            try:
                # An acknowledgement that cannot be written (a full disk) leaves its batch queued: it is pushed
                # again, a duplicate the collector acknowledges, once the spool can be written.
                if woken or time.monotonic() - self._sealed_at_s < self.push_interval_s:
                    self._writing(self.pusher.push_pending)
                else:
                    self._writing(self.flush)
            except Exception:
                log.exception("agent push failed; what it measured stays spooled for the next push")
