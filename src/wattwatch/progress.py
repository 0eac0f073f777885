"""Progress for commands that take more than a second, on stderr so stdout stays the answer.

On a terminal one status line is redrawn in place (carriage return, clear to end of line) and wiped when
done; otherwise (a log file, CI) a plain line every few seconds. ``demo_driver`` wraps the demo's job
driver with such a line: elapsed and remaining time, power now, the jobs' energy so far and queries served,
read from the demo's own collector (``GET /api/v1/live``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from wattwatch.config import Settings
from wattwatch.table_render import terminal_columns

Driver = Callable[[Settings, threading.Event], None]


class StatusLine:
    """One line of progress on ``stream`` (default stderr): in place on a terminal, else every ``every_s``."""

    def __init__(self, stream: TextIO | None = None, *, every_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._last_s = float("-inf")
        self._drawn = False

    def update(self, text: str) -> None:
        """Show ``text`` now (on a terminal) or when ``every_s`` passed since the last plain line."""
        if self.tty:
            width = terminal_columns(80)
            self.stream.write("\r" + text[: max(width - 1, 10)] + "\x1b[K")
            self._drawn = True
        elif time.monotonic() - self._last_s >= self.every_s:
            self._last_s = time.monotonic()
            self.stream.write(text + "\n")
        else:
            return
        self.stream.flush()

    def clear(self) -> None:
        """Wipe the line on a terminal, so what is printed next starts on a clean line."""
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False


def demo_driver(drive: Driver, duration_s: float | None, *, stream: TextIO | None = None) -> Driver:
    """``drive`` with a status line beside it until the demo stops."""

    def driver(settings: Settings, stop: threading.Event) -> None:
        line = StatusLine(stream)
        watcher = threading.Thread(
            target=_watch, args=(settings, stop, duration_s, line), name="wattwatch-progress", daemon=True
        )
        watcher.start()
        try:
            drive(settings, stop)
        finally:
            stop.set()
            watcher.join(timeout=5)

    return driver


def _watch(settings: Settings, stop: threading.Event, duration_s: float | None, line: StatusLine) -> None:
    started = time.monotonic()
    period_s = 0.5 if line.tty else 1.0
    try:
        while not stop.wait(period_s):
            line.update(demo_status(time.monotonic() - started, duration_s, _live(settings)))
    finally:
        line.clear()


def demo_status(elapsed_s: float, duration_s: float | None, live: dict[str, Any] | None) -> str:
    """``demo: 12 s of 20 s (8 s left); power now 1510 W; jobs so far 25.1 kJ; 37 queries``."""
    from wattwatch.report import format_energy

    if duration_s:
        text = f"demo: {elapsed_s:.0f} s of {duration_s:g} s ({max(duration_s - elapsed_s, 0):.0f} s left)"
    else:
        text = f"demo: {elapsed_s:.0f} s (Ctrl-C stops it and prints the report)"
    if live is None:
        return text + "; waiting for the first measurements"
    power_w = sum(float(d["power_w"]) for h in live["hosts"] for d in h["devices"] if d.get("power_w") is not None)
    jobs = live.get("jobs") or []
    energy_j = sum(float(j["energy_j"]) for j in jobs)
    queries = sum(int(j.get("queries") or 0) for j in jobs)
    return f"{text}; power now {power_w:.0f} W; jobs so far {format_energy(energy_j)}; {queries} queries"


def _live(settings: Settings) -> dict[str, Any] | None:
    """The demo collector's live view; None while it has nothing (or does not answer)."""
    import httpx

    headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
    try:
        resp = httpx.get(settings.collector_url.rstrip("/") + "/api/v1/live", headers=headers, timeout=2.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    live: dict[str, Any] = resp.json()
    return live if live.get("hosts") else None
