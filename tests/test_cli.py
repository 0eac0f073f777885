"""The command line: one-line errors with exit 2, --help with examples, report on real databases."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wattwatch.cli.main import main
from wattwatch.protocol import wire
from wattwatch.storage import repository
from wattwatch.storage.engine import make_engine

COMMANDS = [["up"], ["demo"], ["collector"], ["agent"], ["run"], ["report"], ["doctor"], ["db", "upgrade"]]


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WATTWATCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_every_command_has_help_with_an_example(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "example" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["report", "--since", "soon"], "--since"),
        (["report", "--format", "xml"], "--format"),
        (["report", "--limit", "0"], "--limit"),
        (["report", "--cursor", "not a cursor"], "--cursor"),
        (["collector", "--retention-days", "-2"], "--retention-days"),
        (["run", "--kind", "training"], "no command given"),
        (["run", "--label", "novalue", "--", "true"], "--label"),
        (["up", "--listen", "localhost"], "HOST:PORT"),
        (["up", "--simulate", "-1"], "--simulate"),
        (["agent", "--collector", "collector:8470"], "--collector"),
        (["agent", "--scrape", "bogus"], "PRESET:URL"),
        (["up", "--kubelet-url", "ftp://kubelet"], "not a URL"),
        (["agent", "--fine-interval", "-1"], "fine tick"),
        (["agent", "--simulate", "1", "--sim-flaws", "fancy"], "--sim-flaws"),
        (["agent", "--simulate", "1", "--sim-flaws", "noise_w=loud"], "noise_w"),
        (["up", "--sim-flaws", "realistic"], "--simulate"),
        (["demo", "--sim-flaws", "refresh_ms=0.1"], "refresh"),
        (["bogus"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == 2
    assert needle in one_line_error(capsys)


def test_report_on_a_missing_database_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--db", f"sqlite:///{tmp_path / 'nope.db'}"]) == 2
    err = one_line_error(capsys)
    assert "wattwatch up" in err or "db upgrade" in err
    assert not (tmp_path / "nope.db").exists()  # asking must not create it


def test_report_on_an_unmigrated_database_says_upgrade(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "empty.db"
    sqlite3.connect(db).execute("CREATE TABLE unrelated (x INTEGER)").connection.close()
    assert main(["report", "--db", f"sqlite:///{db}"]) == 2
    assert "db upgrade" in one_line_error(capsys)


def test_db_upgrade_then_empty_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    assert main(["db", "upgrade", "--db", url]) == 0
    capsys.readouterr()
    assert main(["report", "--db", url]) == 0
    assert "No jobs recorded yet" in capsys.readouterr().out
    assert main(["report", "--db", url, "--format", "json"]) == 0
    assert capsys.readouterr().out.strip().startswith("{")


def test_report_pages_with_a_default_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`wattwatch report` covers the last 7 days unless told, says so, and pages with --limit/--cursor."""
    url = f"sqlite:///{tmp_path / 'w.db'}"
    assert main(["db", "upgrade", "--db", url]) == 0
    engine = make_engine(url)
    now_s = time.time()
    starts = {f"job{i}": now_s - 3600 * (5 - i) for i in range(5)} | {"old": now_s - 9 * 86400}
    for seq, (job_id, t0_s) in enumerate(starts.items(), start=1):
        job = wire.Job(id=job_id, name=job_id, kind="training", started_at_s=t0_s, ended_at_s=t0_s + 10)
        gpu = wire.Device(key="gpu0", kind="gpu")
        intervals = [wire.Interval("gpu0", t0_s, t0_s + 10, 1000.0, "counter", shares={job_id: 1.0})]
        b = wire.Batch(seq=seq, agent_id="a", host="h", devices=[gpu], jobs=[job], intervals=intervals)
        repository.ingest_batch(engine, b, received_at_s=now_s)
    engine.dispose()
    capsys.readouterr()
    seen: list[str] = []
    cursor: list[str] = []
    for _page in range(5):
        assert main(["report", "--db", url, "--limit", "2", "--format", "json", *cursor]) == 0
        out = capsys.readouterr()
        page = json.loads(out.out)
        assert page["window"]["default"] is True and page["window"]["since"] == "7d"
        seen += [j["id"] for j in page["jobs"]]
        if page["next_cursor"] is None:
            break
        assert f"more jobs: --cursor {page['next_cursor']}" in out.err
        cursor = ["--cursor", page["next_cursor"]]
    assert seen == [f"job{i}" for i in range(5)]  # "old" ended 9 days ago: outside the default window
    assert main(["report", "--db", url, "--since", "30d", "--format", "json"]) == 0
    assert [j["id"] for j in json.loads(capsys.readouterr().out)["jobs"]] == ["old", *seen]
    assert main(["report", "--db", url, "--limit", "3"]) == 0
    table = capsys.readouterr().out
    assert "(the default; --since to change)" in table and "more jobs: --cursor " in table


def test_report_for_an_unknown_job_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    assert main(["db", "upgrade", "--db", url]) == 0
    capsys.readouterr()
    assert main(["report", "--db", url, "--job", "nope"]) == 2
    assert "no job 'nope'" in one_line_error(capsys)


def test_run_without_an_agent_still_runs_the_command_and_keeps_its_exit_code(home: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "wattwatch.cli.main",
            "run",
            "--kind",
            "training",
            "--",
            sys.executable,
            "-c",
            "import os, sys; print(os.environ['WATTWATCH_JOB']); sys.exit(3)",
        ],
        env={**os.environ, "WATTWATCH_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 3
    assert len(out.stdout.strip()) == 32  # the job id handed to the command
    assert "no agent" in out.stderr and "Traceback" not in out.stderr


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "wattwatch demo" in capsys.readouterr().out


def test_doctor_on_simulated_pre_volta_boards_says_there_is_no_energy_counter(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["doctor", "--simulate", "2", "--generation", "p100"]) == 0
    out = capsys.readouterr().out
    assert out.count("energy counter: NO") == 2
    assert "SIMULATED" in out


def test_doctor_examines_simulated_boards_with_flaws(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--simulate", "2", "--sim-flaws", "refresh_ms=20,latency_ms=0.2"]) == 0
    assert "SIMULATED" in capsys.readouterr().out


def test_doctor_rejects_an_unknown_generation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--simulate", "1", "--generation", "z80"]) == 2
    assert "h100" in one_line_error(capsys)
