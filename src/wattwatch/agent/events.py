"""What the agent's worker thread is handed: events (ticks, job boundaries, stop), in arrival order.

The local API, the schedule and the fine ticker put events from their own threads; only the worker takes
them, so every reading is taken, and every interval closed, in event order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from wattwatch.agent.jobs import ActiveJob


class WorkloadHook(Protocol):
    """Told when a job starts or ends on devices; simulated GPUs use it to change their load."""

    def job_started(self, job_id: str, kind: str, devices: Sequence[str], pid: int | None, t_s: float) -> None:
        """A job began using ``devices`` at ``t_s``."""
        ...

    def job_ended(self, job_id: str, t_s: float) -> None:
        """A job stopped at ``t_s``."""
        ...


@dataclass
class Event:
    """One thing for the worker to do at ``t_s``: read the sensors and apply what the event changes."""

    kind: str  # tick | fine | start | end | stop | sync
    t_s: float
    job: ActiveJob | None = None
    job_id: str = ""
    done: threading.Event | None = None
    listed: dict[str, set[int]] | None = None  # an end's: NVML's processes on the job's GPUs when it came
    scheduled: bool = False  # a tick of the schedule (stages what it measured), not one asked for


class Inbox:
    """The worker's events in arrival order: ``put`` from any thread; ``get`` (the worker's) waits at most
    ``timeout_s`` (None: for ever) and returns None when nothing came. A ``queue.Queue`` raises ``Empty``
    instead, which the worker would raise and catch every tick."""

    def __init__(self) -> None:
        self._items: deque[Event] = deque()
        self._ready = threading.Condition(threading.Lock())

    def put(self, event: Event) -> None:
        """Queue ``event`` and wake the worker."""
        with self._ready:
            self._items.append(event)
            self._ready.notify()

    def get(self, timeout_s: float | None) -> Event | None:
        """The oldest event, waiting at most ``timeout_s`` for one; None when none came."""
        with self._ready:
            if not self._items:
                self._ready.wait(timeout_s)
            return self._items.popleft() if self._items else None

    def empty(self) -> bool:
        """Whether no event is queued."""
        return not self._items
