"""Helpers for tests that run real processes: the wattwatch command, free loopback ports, waiting on
conditions, and promtool's verdict on a /metrics text."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import unavailable

WATTWATCH = [sys.executable, "-m", "wattwatch.cli.main"]


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


# promtool's lint of a label name that is not snake_case; the message does not name the label.
_CAMEL_CASE_LINT = re.compile(r"^\S+ label names should be written in 'snake_case' not 'camelCase'$")


def promtool_check(text: str, camel_case_labels: Iterable[str] = ()) -> None:
    """``promtool check metrics`` finds nothing wrong with ``text``.

    ``camel_case_labels`` are label names kept camelCase on purpose (dcgm-exporter's ``UUID`` and
    ``modelName``, for joins with its series): promtool's lint of those is allowed, and only when the
    text's camelCase label names are exactly those. Without promtool the test skips (fails in CI).
    """
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool not found (Debian: apt-get install prometheus)")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    allowed = set(camel_case_labels)
    if allowed:
        names = {name for f in text_string_to_metric_families(text) for s in f.samples for name in s.labels}
        assert {n for n in names if n != n.lower()} <= allowed, names
        problems = [line for line in problems if not _CAMEL_CASE_LINT.match(line)]
    # Exit status 3 is lint only; with the allowed lint filtered out nothing may be left.
    assert result.returncode in ((0, 3) if allowed else (0,)) and not problems, result.stdout + result.stderr


def cli_outcome(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``wattwatch`` in-process as a user would type it: (exit code, stdout, stderr); never a traceback."""
    from wattwatch.cli.main import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


@contextmanager
def collector_process(db_url: str, tmp_path: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``wattwatch collector`` on ``db_url`` (open to loopback), logging to ``tmp_path``; yields its
    URL once it is ready, and its process; stopped with SIGTERM (killed if that takes over 30 s)."""
    port = free_port()
    log = tmp_path / "collector.log"
    env = {**os.environ, "WATTWATCH_HOME": str(tmp_path / "chome")}
    proc = subprocess.Popen(
        [*WATTWATCH, "collector", "--db", db_url, "--listen", f"127.0.0.1:{port}", "--open", *extra],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"collector exited early:\n{log.read_text()}")
        try:
            return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 60, "the collector to be ready")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
