"""Report filters as a user types them, on SQLite and PostgreSQL: --since/--until (durations and dates),
--host, --name glob, --label, --kind; "no jobs match these filters" apart from "no jobs recorded yet";
idle energy following the window; one time parser for the CLI and the collector."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine

from test_cli_ids import running_collector
from wattwatch.accounting.rollup import hour_floor_s
from wattwatch.cli.main import main
from wattwatch.collector.contract import SINCE_PATTERN
from wattwatch.protocol import wire
from wattwatch.protocol.units import DATE_PATTERN, DURATION_PATTERN, parse_time_s
from wattwatch.storage import repository

# Whole hours back, so each job and its idle energy sit in hours of their own.
HOUR = 3600.0
NOW_HOUR = hour_floor_s(time.time())
GPU = wire.Device(key="gpu0", kind="gpu", index=0, uuid="GPU-0", model="H100")
# id: (name, kind, labels, host, start hours back, joules); each job runs 10 minutes.
JOBS = {
    "aaaa0001": ("llama-ft-1", "training", {"team": "nlp"}, "h1", 50, 1000.0),
    "aaaa0002": ("llama-ft-2", "training", {"team": "vision"}, "h2", 3, 2000.0),
    "bbbb0001": ("chat", "inference", {"team": "nlp", "tier": "gold"}, "h1", 2, 4000.0),
}
IDLE_J = 500.0  # per job hour, on its host's GPU, in the hour after the job


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATTWATCH_HOME", str(tmp_path / "home"))


@pytest.fixture
def seeded(db_url: str, db_engine: Engine) -> str:
    for seq, (job_id, (name, kind, labels, host, back_h, energy_j)) in enumerate(JOBS.items(), start=1):
        start = NOW_HOUR - back_h * HOUR
        job = wire.Job(id=job_id, name=name, kind=kind, labels=labels, started_at_s=start, ended_at_s=start + 600)
        intervals = [
            wire.Interval("gpu0", start, start + 600, energy_j, "counter", shares={job_id: 1.0}),
            wire.Interval("gpu0", start + HOUR, start + HOUR + 60, IDLE_J, "counter", shares={}),
        ]
        batch = wire.Batch(
            agent_id=f"agent-{host}",
            seq=seq,
            host=host,
            sent_at_s=start,
            devices=[GPU],
            intervals=intervals,
            jobs=[job],
        )
        repository.ingest_batch(db_engine, batch, received_at_s=start + 1)
    return db_url


def report(db: str, capsys: pytest.CaptureFixture[str], *args: str, fmt: str = "json") -> dict:
    code = main(["report", "--db", db, "--format", fmt, *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Traceback" not in out.err
    return json.loads(out.out)


def ids(rep: dict) -> list[str]:
    return [j["id"] for j in rep["jobs"]]


def test_each_filter_selects_the_jobs_it_names(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert ids(report(seeded, capsys)) == ["aaaa0001", "aaaa0002", "bbbb0001"]
    assert ids(report(seeded, capsys, "--since", "1d")) == ["aaaa0002", "bbbb0001"]
    assert ids(report(seeded, capsys, "--until", "1d")) == ["aaaa0001"]
    # Between the starts of aaaa0002 (3 h before this hour) and bbbb0001 (2 h before), whatever the minute.
    between = datetime.fromtimestamp(NOW_HOUR - 2.5 * HOUR, tz=UTC).strftime("%Y-%m-%dT%H:%MZ")
    assert ids(report(seeded, capsys, "--since", "1d", "--until", between)) == ["aaaa0002"]
    assert ids(report(seeded, capsys, "--host", "h1")) == ["aaaa0001", "bbbb0001"]
    assert ids(report(seeded, capsys, "--name", "llama-*")) == ["aaaa0001", "aaaa0002"]
    assert ids(report(seeded, capsys, "--name", "LLAMA-*")) == []  # case-sensitive on both databases
    assert ids(report(seeded, capsys, "--label", "team=nlp")) == ["aaaa0001", "bbbb0001"]
    assert ids(report(seeded, capsys, "--label", "team=nlp", "--label", "tier")) == ["bbbb0001"]
    assert ids(report(seeded, capsys, "--kind", "training", "--host", "h1")) == ["aaaa0001"]


def test_dates_work_like_durations(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    day_ago = datetime.fromtimestamp(NOW_HOUR - 24 * HOUR, tz=UTC)
    for since in (day_ago.strftime("%Y-%m-%dT%H:%MZ"), day_ago.strftime("%Y-%m-%dT%H:%M:%S+00:00")):
        rep = report(seeded, capsys, "--since", since)
        assert ids(rep) == ["aaaa0002", "bbbb0001"]
        assert rep["filters"]["since"] == day_ago.isoformat().replace("+00:00", "Z")


def test_idle_follows_the_window_and_the_host(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    def idle_j(rep: dict) -> float:
        return sum(i["energy_j"] for i in rep["idle"])

    assert idle_j(report(seeded, capsys)) == pytest.approx(3 * IDLE_J)
    # The idle minute of the 50 h old job is outside a 1 d window; the other two are inside.
    rep = report(seeded, capsys, "--since", "1d")
    assert idle_j(rep) == pytest.approx(2 * IDLE_J)
    assert rep["idle_from"] is not None and rep["idle_until"] is None
    assert idle_j(report(seeded, capsys, "--until", "1d")) == pytest.approx(IDLE_J)
    assert {i["host"] for i in report(seeded, capsys, "--host", "h2")["idle"]} == {"h2"}
    capsys.readouterr()
    assert main(["report", "--db", seeded, "--since", "1d"]) == 0
    assert "Idle energy (held by no job), whole hours from " in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--kind", "other"], ["--since", "0"], ["--name", "nothing*"], ["--host", "h9"]])
def test_no_match_names_the_filters_in_every_format(
    seeded: str, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", "--db", seeded, *args]) == 0
    out = capsys.readouterr().out
    assert out.startswith("No jobs match these filters: ") and args[1] in out and "recorded yet" not in out
    rep = report(seeded, capsys, *args)
    assert rep["jobs"] == [] and rep["jobs_recorded"] is True and rep["filters"]
    assert main(["report", "--db", seeded, "--format", "markdown", *args]) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[0].startswith("| JOB |") and md[1].startswith("|---|") and "No jobs match these filters" in md[3]
    assert main(["report", "--db", seeded, "--format", "csv", *args]) == 0
    assert list(csv.DictReader(io.StringIO(capsys.readouterr().out))) == []


def test_an_empty_database_says_no_jobs_yet_even_with_filters(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", "--db", sqlite_url, "--kind", "other"]) == 0
    assert capsys.readouterr().out.startswith("No jobs recorded yet.")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--since", "1e3"], "'1e3' is not a duration back from now"),
        (["--since", "inf"], "is not a duration"),
        (["--until", "2026-02-30"], "not a real date"),
        (["--since", "-5d"], "negative durations are invalid"),
        (["--until", "-1h"], "negative durations are invalid"),
        (["--since", "1h", "--until", "2h"], "is not before --until"),
        (["--label", "=x"], "--label"),
    ],
)
def test_bad_filters_are_one_line_exit_2(
    sqlite_url: str, args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", "--db", sqlite_url, *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


def test_the_cli_and_the_collector_read_times_alike() -> None:
    # One pattern, in units: the collector documents and enforces exactly it (test_contract: 422 outside).
    assert f"({DURATION_PATTERN})|({DATE_PATTERN})" == SINCE_PATTERN
    for text in ("1e3", "nan", "inf", "-5d", "0x10", "7d", "1.5h", "2026-11-30", "2026-11-30T08:00Z", "  3m "):
        try:
            parse_time_s(text, 0.0)
            parsed = True
        except ValueError:
            parsed = False
        # The CLI takes what the collector's pattern takes (after stripping blanks), and nothing else.
        assert parsed == (re.match(SINCE_PATTERN, text.strip()) is not None), text


def test_a_collector_filters_as_the_database_does(
    seeded: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    day_ago = datetime.fromtimestamp(NOW_HOUR - 24 * HOUR, tz=UTC).strftime("%Y-%m-%dT%H:%MZ")
    cases = [
        [],
        ["--since", "1d"],
        ["--since", day_ago, "--until", "2h"],
        ["--host", "h1"],
        ["--name", "llama-*"],
        ["--label", "team=nlp", "--label", "tier"],
        ["--kind", "other"],
    ]
    with running_collector(seeded, tmp_path) as url:
        for args in cases:
            local = report(seeded, capsys, *args)
            assert main(["report", "--server", url, "--format", "json", *args]) == 0
            remote = json.loads(capsys.readouterr().out)
            assert ids(remote) == ids(local), args
            assert [j["energy_j"] for j in remote["jobs"]] == [j["energy_j"] for j in local["jobs"]]
            assert remote["idle"] == local["idle"] and remote["filters"].keys() == local["filters"].keys()


def test_wattwatch_server_is_where_a_plain_report_asks(
    seeded: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With WATTWATCH_SERVER set, `report` and `jobs` without --server or --db ask that collector (here the
    seeded database's, while WATTWATCH_DB names an empty one); --db still reads a database; a value that
    is not a URL is one line, exit 2."""
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    assert main(["db", "upgrade", "--db", empty]) == 0
    capsys.readouterr()
    monkeypatch.setenv("WATTWATCH_DB", empty)
    local = report(seeded, capsys)
    assert ids(local)
    with running_collector(seeded, tmp_path) as url:
        monkeypatch.setenv("WATTWATCH_SERVER", url)
        capsys.readouterr()
        assert main(["report", "--format", "json"]) == 0
        assert ids(json.loads(capsys.readouterr().out)) == ids(local)
        assert main(["jobs", "--format", "json"]) == 0
        assert len(json.loads(capsys.readouterr().out)["jobs"]) == len(ids(local))
        assert main(["report", "--db", empty, "--format", "json"]) == 0
        assert json.loads(capsys.readouterr().out)["jobs"] == []
        monkeypatch.setenv("WATTWATCH_SERVER", url.replace("http://", "HTTP://"))  # schemes are case-blind
        assert main(["report", "--format", "json"]) == 0
        assert ids(json.loads(capsys.readouterr().out)) == ids(local)
    monkeypatch.setenv("WATTWATCH_SERVER", "collector:8470")
    capsys.readouterr()
    assert main(["report"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "wattwatch report: error: --server / WATTWATCH_SERVER 'collector:8470' is not a URL; "
        "use e.g. http://collector:8470"
    )


def test_report_server_imports_no_database_layer(seeded: str, tmp_path: Path) -> None:
    """`report --server` asks the collector, so it needs neither SQLAlchemy nor a database driver: a cluster's
    users run it with a reader token alone, and its start-up stays within its budget
    (benchmarks/report_startup.py)."""
    heavy = ("sqlalchemy", "psycopg", "alembic")
    probe = (
        "import sys\nfrom wattwatch.cli.main import main\n"
        f"code = main(['report', '--server', sys.argv[1]])\n"
        f"print('LOADED', [m for m in {heavy!r} if m in sys.modules], code)\n"
    )
    with running_collector(seeded, tmp_path) as url:
        out = subprocess.run(
            [sys.executable, "-c", probe, url], capture_output=True, text=True, timeout=60, check=False
        )
    assert out.returncode == 0, out.stderr
    assert "llama-ft-2" in out.stdout  # the report itself was printed
    assert out.stdout.strip().splitlines()[-1] == "LOADED [] 0", out.stdout[-500:]
