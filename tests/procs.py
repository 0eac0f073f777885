"""Helpers for tests that run real wattwatch processes: free loopback ports, waiting on conditions."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable

WATTWATCH = [sys.executable, "-m", "wattwatch.cli"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
