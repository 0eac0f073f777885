"""A worker thread that dies takes its process down with one clear line, and /healthz says so meanwhile
(``wattwatch.vital``); a real ``wattwatch collector`` process exits 1 when one of its threads dies."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from procs import free_port
from test_auth_e2e import env_for
from wattwatch import vital
from wattwatch.cli.errors import RuntimeFailure
from wattwatch.collector import create_app
from wattwatch.config import Settings


def _die(message: str) -> None:
    raise RuntimeError(message)


def test_a_dead_thread_stops_the_service_and_healthz_says_so(
    tmp_path: Path, db_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    hook_before = threading.excepthook
    stop = threading.Event()
    app = create_app(Settings(home=tmp_path), db_engine, span_energy_interval_s=None, anonymous="anyone")
    with TestClient(app) as client:
        assert client.get("/healthz").json() == {"ok": True}
        vital.DEATHS.install(stop)
        with caplog.at_level(logging.ERROR, logger="wattwatch.vital"):
            t = threading.Thread(target=_die, args=("planted failure",), name="wattwatch-probe")
            t.start()
            t.join()
        assert stop.is_set()
        (line,) = [r.getMessage() for r in caplog.records if r.name == "wattwatch.vital"]
        assert "thread wattwatch-probe died (RuntimeError: planted failure)" in line and "\n" not in line
        r = client.get("/healthz")
        assert r.status_code == 503 and r.json() == {"ok": False, "dead_threads": ["wattwatch-probe"]}
        with pytest.raises(RuntimeFailure, match="thread wattwatch-probe died"):
            vital.DEATHS.finish()
    assert threading.excepthook is hook_before


@pytest.mark.e2e
def test_a_collector_whose_thread_dies_exits_1_with_one_line(sqlite_url: str, tmp_path: Path) -> None:
    port = free_port()
    # A thread of the real collector process dies once the collector answers.
    script = textwrap.dedent(
        f"""
        import sys, threading, httpx
        from wattwatch.cli import main

        def die():
            while True:
                try:
                    if httpx.get("http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            raise RuntimeError("planted failure")

        threading.Thread(target=die, name="wattwatch-probe", daemon=True).start()
        sys.exit(main.main(["collector", "--db", {sqlite_url!r}, "--listen", "127.0.0.1:{port}", "--open"]))
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], env=env_for(tmp_path / "home"), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert errors == [
        "wattwatch collector: error: thread wattwatch-probe died (RuntimeError: planted failure); the process "
        "stopped rather than run without it. Rerun with --log-level debug for its traceback and report it"
    ], r.stderr
    assert "Traceback" not in r.stderr
