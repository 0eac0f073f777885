"""Errors as a user meets them: one line that says what to do, exit 2 for usage, never a traceback; global
options after the command; `db upgrade` and `demo` saying what they did and where the data is."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from procs import WATTWATCH, cli_outcome, free_port
from wattwatch.storage import migrate


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WATTWATCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["report", "--db", "mysql://u@db/w"], "scheme 'mysql' is not supported"),
        (["db", "upgrade", "--db", "mysql+pymysql://u@db/w"], "scheme 'mysql' is not supported"),
        (["report", "--since", "-5d"], "negative durations are invalid"),
        (["report", "--since=-5d"], "negative"),
        (["report", "--format", "json", "--since", "-0.5h"], "negative durations are invalid"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli_outcome(argv, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err


def test_global_options_work_after_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other"
    code, out, _ = cli_outcome(["db", "upgrade", "--home", str(other)], capsys)
    assert code == 0 and str(other) in out
    # Before and after the command alike; after wins.
    assert cli_outcome(["report", "--home", str(other)], capsys)[:2] == (
        0,
        cli_outcome(["--home", str(other), "report"], capsys)[1],
    )
    code, _, err = cli_outcome(["--home", str(other), "report", "--home", str(tmp_path / "none")], capsys)
    assert code == 2 and "none" in err
    code, _, _ = cli_outcome(["report", "--home", str(other), "--log-level", "warning", "-v"], capsys)
    assert code == 0


def test_db_upgrade_says_what_it_did(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    head = migrate.head_revision()
    code, out, _ = cli_outcome(["db", "upgrade", "--db", url], capsys)
    assert code == 0 and f"created the schema (revision {head})" in out
    code, out, _ = cli_outcome(["db", "upgrade", "--db", url], capsys)
    assert code == 0 and "already at the current schema" in out and "nothing to do" in out
    older = sorted(migrate.known_revisions())[-2]
    old_url = f"sqlite:///{tmp_path / 'old.db'}"
    migrate.upgrade(old_url, older)
    code, out, _ = cli_outcome(["db", "upgrade", "--db", old_url], capsys)
    assert code == 0 and f"upgraded {old_url} from revision {older} to {head}" in out


@pytest.mark.slow
def test_demo_suggests_a_report_that_reads_its_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    env = {**os.environ, "WATTWATCH_HOME": str(tmp_path / "home")}
    demo = subprocess.run(
        [*WATTWATCH, "demo", "--duration", "3", "--db", url, "--listen", f"127.0.0.1:{free_port()}"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    # The demo prints its story; the collector's and agent's INFO lines stay out unless asked for.
    assert " INFO " not in demo.stdout + demo.stderr
    match = re.search(r"see it again with `([^`]+)`", demo.stdout)
    assert match, demo.stdout
    suggested = shlex.split(match.group(1))
    assert suggested[:2] == ["wattwatch", "report"] and url in suggested
    # The suggestion, run as given (from another home), reads the demo's jobs.
    env["WATTWATCH_HOME"] = str(tmp_path / "elsewhere")
    report = subprocess.run(
        [*WATTWATCH, *suggested[1:]], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert report.returncode == 0, report.stderr
    assert "demo-" in report.stdout or "train" in report.stdout, report.stdout


def test_logs_go_to_stderr_and_answers_to_stdout(tmp_path: Path) -> None:
    import json

    url = f"sqlite:///{tmp_path / 'w.db'}"
    env = {**os.environ, "WATTWATCH_HOME": str(tmp_path / "home")}
    for argv in (["db", "upgrade", "--db", url], ["report", "--db", url, "--format", "json", "--log-level", "debug"]):
        out = subprocess.run([*WATTWATCH, *argv], env=env, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["jobs"] == []
    assert re.search(r" (DEBUG|INFO) ", out.stderr)  # asked for, and on stderr only
