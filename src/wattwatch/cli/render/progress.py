"""Progress for commands that take more than a second, on stderr so stdout stays the answer.

On a terminal one status line is redrawn in place (``rich.live.Live``, cut to the terminal's width) and
wiped when done; otherwise (a log file, CI) a plain line every few seconds, with no control codes.
``demo_driver`` wraps the demo's job driver with such a line: elapsed and remaining time, power now, the
jobs' energy so far and queries served, read from the demo's own collector (``GET /api/v1/live``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from wattwatch.config import Settings

if TYPE_CHECKING:
    from rich.live import Live

Driver = Callable[[Settings, threading.Event], None]


class StatusLine:
    """One line of progress on ``stream`` (default stderr): in place on a terminal, else every ``every_s``."""

    def __init__(self, stream: TextIO | None = None, *, every_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._last_s = float("-inf")
        self._live: Live | None = None

    def update(self, text: str) -> None:
        """Show ``text`` now (on a terminal) or when ``every_s`` passed since the last plain line."""
        if self.tty:
            self._draw(text)
        elif time.monotonic() - self._last_s >= self.every_s:
            self._last_s = time.monotonic()
            self.stream.write(text + "\n")
            self.stream.flush()

    def _draw(self, text: str) -> None:
        from rich.text import Text

        line = Text(text, no_wrap=True, overflow="ellipsis")
        if self._live is not None:
            self._live.update(line, refresh=True)
            return
        from rich.console import Console
        from rich.live import Live

        console = Console(file=self.stream, highlight=False, markup=False, emoji=False)
        # Not redirecting stdout and stderr: the command's own output is written by other threads too.
        self._live = Live(
            line, console=console, auto_refresh=False, transient=True, redirect_stdout=False, redirect_stderr=False
        )
        self._live.start(refresh=True)

    def clear(self) -> None:
        """Wipe the line on a terminal, so what is printed next starts on a clean line."""
        if self._live is not None:
            self._live.stop()
            self._live = None


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
    from wattwatch.reporting.render import format_energy

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
    from wattwatch import client

    try:
        resp = client.get(settings.collector_url.rstrip("/") + "/api/v1/live", token=settings.token, timeout_s=2.0)
    except client.ClientError:
        return None
    if resp.status != 200:
        return None
    try:
        live: dict[str, Any] = json.loads(resp.body)
    except ValueError:
        return None
    return live if live.get("hosts") else None
