"""Read-only commands end without the interpreter's teardown (``quick_exit``): their whole output still
arrives through a pipe, and their exit codes are what they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from procs import WATTWATCH
from wattwatch.cli import build_parser
from wattwatch.completion import script
from wattwatch.quick_exit import command_of


def test_the_command_word_is_found_past_global_options() -> None:
    assert command_of(["report", "--format", "json"]) == "report"
    assert command_of(["--home", "report", "top"]) == "top"  # --home's value is no command
    assert command_of(["-v", "--log-level", "debug", "completion", "bash"]) == "completion"
    assert command_of(["--version"]) is None


def test_a_quick_command_writes_all_its_output_through_a_pipe(tmp_path: Path) -> None:
    env = {**os.environ, "WATTWATCH_HOME": str(tmp_path)}
    out = subprocess.run([*WATTWATCH, "completion", "bash"], env=env, capture_output=True, timeout=60, check=False)
    assert out.returncode == 0
    assert out.stdout.decode() == script(build_parser(), "bash")  # every byte, though the process ended at once
    db = f"sqlite:///{tmp_path / 'w.db'}"
    subprocess.run([*WATTWATCH, "db", "upgrade", "--db", db], env=env, capture_output=True, timeout=60, check=True)
    report = subprocess.run(
        [*WATTWATCH, "report", "--db", db, "--format", "json"], env=env, capture_output=True, timeout=60, check=False
    )
    assert report.returncode == 0 and json.loads(report.stdout)["jobs"] == []


def test_a_quick_command_keeps_its_exit_code_and_its_one_line_error(tmp_path: Path) -> None:
    env = {**os.environ, "WATTWATCH_HOME": str(tmp_path)}
    out = subprocess.run(
        [*WATTWATCH, "report", "--since", "yesterday"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 2
    assert out.stderr.startswith("wattwatch report: error: --since") and len(out.stderr.splitlines()) == 1
    away = subprocess.run(
        [*WATTWATCH, "top", "--once", "--server", "http://127.0.0.1:9"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert away.returncode == 1 and len(away.stderr.splitlines()) == 1


def test_the_sdk_loads_on_first_use_and_stays_reachable() -> None:
    code = (
        "import sys, wattwatch, wattwatch.cli\n"
        "assert 'wattwatch.sdk' not in sys.modules, 'a command start imports no SDK'\n"
        "from wattwatch import job, step\n"
        "assert wattwatch.sdk.job is job and wattwatch.step is step and wattwatch.query and wattwatch.epoch\n"
        "try:\n    wattwatch.nope\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no error')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
