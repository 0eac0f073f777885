"""``schemathesis run`` with an admin token against a real ``wattwatch collector`` process, on SQLite and
PostgreSQL: every phase (examples, coverage, fuzzing, stateful), every check, 0 failures. Slow: CI's slow
suite runs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from procs import WATTWATCH
from test_auth_e2e import env_for, run, stop
from test_front_door_e2e import start_collector

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TESTS = Path(__file__).parent
SCHEMATHESIS = Path(WATTWATCH[0]).with_name("schemathesis")


def test_schemathesis_run_finds_nothing(db_url: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    admin = run(["token", "create", "--db", db_url, "--role", "admin"], env_for(home)).stdout.strip()
    # The time window is a setting, not part of the document: opened so schema-valid times are stored.
    proc, url = start_collector(db_url, home, "--time-window-past", "100000d", "--time-window-future", "100000d")
    try:
        env = env_for(
            home,
            SCHEMATHESIS_HOOKS="schemathesis_hooks",
            PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        )
        r = subprocess.run(
            [
                str(SCHEMATHESIS),
                "--config-file",
                str(TESTS / "schemathesis.toml"),
                "run",
                f"{url}/openapi.json",
                "-H",
                f"Authorization: Bearer {admin}",
            ],
            env=env,
            cwd=tmp_path,  # its example database lands there, not in the checkout
            capture_output=True,
            text=True,
            timeout=280,
        )
    finally:
        stop(proc)
    summary = r.stdout[-4000:]
    assert r.returncode == 0, summary
    assert "No issues found" in r.stdout, summary
