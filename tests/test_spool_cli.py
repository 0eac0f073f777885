"""`wattwatch spool list|show|requeue` and the doctor's spool section on a real spool file: what is set
aside and why, one-line errors with exit 2, --help with examples, and --poison-after's bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wattwatch.agent.spool import SPOOL_FILE, Spool
from wattwatch.cli.doctor import describe_spool, run_doctor
from wattwatch.cli.main import main
from wattwatch.sim.fleet import SimulatedFleet


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WATTWATCH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WATTWATCH_POISON_AFTER", raising=False)
    return tmp_path / "home"


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def spool_with_set_aside(home: Path) -> Spool:
    """Batches 0..3 queued; 1 refused (422, at t=1000 s) and 2 failed (500 x5, at t=2000 s), set aside."""
    spool = Spool(home / SPOOL_FILE)
    for _ in range(4):
        seq = spool.next_seq()
        spool.put(seq, json.dumps({"seq": seq}).encode(), 100.0 + seq)
    assert spool.set_aside(1, {"reason": "rejected", "status": 422, "error": "unknown field `bogus`",
                               "field": "intervals[0].bogus", "attempts": 1, "set_aside_at_s": 1000.0})  # fmt: skip
    assert spool.set_aside(2, {"reason": "repeated_failure", "status": 500, "error": "boom", "field": None,
                               "attempts": 5, "set_aside_at_s": 2000.0})  # fmt: skip
    assert not spool.set_aside(99, {"reason": "rejected"})  # not queued: nothing to move
    return spool


@pytest.mark.parametrize("command", [["spool"], ["spool", "list"], ["spool", "show"], ["spool", "requeue"]])
def test_spool_commands_have_help_with_an_example(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "wattwatch spool" in capsys.readouterr().out.split("example")[1]


def test_list_show_and_requeue(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spool_with_set_aside(home).close()
    assert main(["spool", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 set-aside batch(es) in ") and lines[1].split() == [
        "SEQ",
        "SET",
        "ASIDE",
        "(UTC)",
        "WHY",
    ]
    assert lines[2].split()[:3] == ["2", "1970-01-01", "00:33:20"]  # the latest first
    assert lines[2].endswith("repeated_failure: HTTP 500: boom (5 attempts)")
    assert lines[3].endswith("rejected: HTTP 422 on intervals[0].bogus: unknown field `bogus`")
    assert main(["spool", "list", "--format", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    rows = [(b["seq"], b["status"], b["created_s"], b["size_bytes"]) for b in listed]
    assert rows == [(2, 500, 102.0, 10), (1, 422, 101.0, 10)]
    assert main(["spool", "show", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == {"seq": 1}
    assert main(["spool", "requeue", "2"]) == 0
    assert "1 batch(es) back in the queue" in capsys.readouterr().out
    spool = Spool(home / SPOOL_FILE)
    assert [seq for seq, _ in spool.peek()] == [0, 2, 3] and spool.dead() == 1
    spool.close()
    assert main(["spool", "requeue", "--all"]) == 0
    assert "1 batch(es) back in the queue" in capsys.readouterr().out
    spool = Spool(home / SPOOL_FILE)
    assert [seq for seq, _ in spool.peek()] == [0, 1, 2, 3] and spool.dead() == 0
    spool.close()
    assert main(["spool", "list"]) == 0
    assert capsys.readouterr().out.startswith("no set-aside batches in ")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["spool"], "`wattwatch spool list`"),
        (["spool", "requeue"], "or say --all"),
        (["spool", "requeue", "1", "--all"], "or say --all"),
        (["spool", "requeue", "7"], "no set-aside batch 7 in"),
        (["spool", "show", "7"], "no set-aside batch 7 in"),
    ],
)
def test_spool_usage_errors_are_one_line_exit_2(
    home: Path, argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    Spool(home / SPOOL_FILE).close()
    assert main(argv) == 2
    assert needle in one_line_error(capsys)
    with pytest.raises(SystemExit) as exit_info:
        main(["spool", "show", "x"])
    assert exit_info.value.code == 2 and "invalid int value" in one_line_error(capsys)


def test_no_spool_at_home_says_where_it_looked(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spool", "list"]) == 2
    err = one_line_error(capsys)
    assert f"no agent spool at {home / SPOOL_FILE}" in err and "--home" in err
    assert not (home / SPOOL_FILE).exists()  # looking created nothing


@pytest.mark.parametrize(
    ("value", "said"), [("0", "is out of range"), ("1001", "is out of range"), ("x", "is not a number")]
)
def test_poison_after_out_of_range_is_a_one_line_error(
    value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["agent", "--poison-after", value]) == 2
    line = one_line_error(capsys)
    assert f"--poison-after {value} {said}; a batch is set aside after 1 to 1000 failed attempts" in line, line


def test_poison_after_from_the_environment_is_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WATTWATCH_POISON_AFTER", "five")
    assert main(["agent", "--simulate", "1"]) == 2
    assert "WATTWATCH_POISON_AFTER=five is not a number" in one_line_error(capsys)


def test_doctor_shows_set_aside_batches_latest_first_and_how_to_retry(home: Path) -> None:
    spool_with_set_aside(home).close()
    text, code = run_doctor(simulate_fleet=SimulatedFleet(1), powercap_root=home, spool_path=home / SPOOL_FILE)
    assert code == 1, text
    section = text.split("Agent spool\n")[1]
    assert "FIX   spool" in section and "2 batch(es) SET ASIDE" in section and "2 batch(es) waiting" in section
    assert section.index("seq 2: repeated_failure, HTTP 500: boom (5 attempts)") < section.index(
        "seq 1: rejected, HTTP 422 on intervals[0].bogus: unknown field `bogus`"
    )
    assert "`wattwatch spool requeue --all`" in section and "1 problem(s) to fix" in text


def test_doctor_on_a_clean_spool_and_on_none(home: Path) -> None:
    spool = Spool(home / SPOOL_FILE)
    spool.put(spool.next_seq(), b"{}", 1.0)
    spool.close()
    lines, problems = describe_spool(home / SPOOL_FILE)
    assert problems == 0 and lines == [
        f"ok    spool          {home / SPOOL_FILE}: 1 batch(es) waiting to be pushed, none set aside"
    ]
    lines, problems = describe_spool(home / "elsewhere" / SPOOL_FILE)
    assert problems == 0 and "no agent spool at" in lines[0] and lines[0].startswith("skip")
    assert not (home / "elsewhere").exists()
