"""Job ids people can type: what a table shows, a prefix and a name all select the job, on a database and
through a collector; an ambiguous reference lists its candidates in one line, exit 2."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine

from procs import cli_outcome, collector_process, free_port
from wattwatch.protocol import wire
from wattwatch.storage import repository

NOW = time.time()
# Two ids sharing their first 16 characters, one unrelated; two runs share a name.
IDS = {
    "3f2a9c1e00000000aaaa": ("llama-ft", "training"),
    "3f2a9c1e00000000bbbb": ("llama-ft", "training"),
    "77aa0000cafe": ("chat-serve", "inference"),
}


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WATTWATCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def jobs_db(db_url: str, db_engine: Engine) -> str:
    for n, (job_id, (name, kind)) in enumerate(IDS.items()):
        job = wire.Job(id=job_id, name=name, kind=kind, started_at_s=NOW - 600 + n, ended_at_s=NOW - 300 + n)
        repository.upsert_job(db_engine, "h1", job, now_s=NOW)
    return db_url


def table_ids(out: str) -> list[str]:
    """The JOB column of a table."""
    lines = out.splitlines()
    assert lines[0].startswith("JOB")
    return [line.split()[0] for line in lines[1:] if line.strip() and not line.startswith(" ")][: len(IDS)]


def test_the_table_shows_prefixes_that_select_their_job(jobs_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_outcome(["report", "--db", jobs_db], capsys)
    assert code == 0
    shown = table_ids(out)
    # Shortest unique prefix, 8 characters at least: 17 for the pair sharing 16.
    assert shown == ["3f2a9c1e00000000a", "3f2a9c1e00000000b", "77aa0000"]
    for prefix, full in zip(shown, IDS, strict=True):
        code, out, _ = cli_outcome(["report", "--db", jobs_db, "--job", prefix, "--format", "json"], capsys)
        assert code == 0
        assert [j["id"] for j in json.loads(out)["jobs"]] == [full]


def test_markdown_shows_the_same_prefixes(jobs_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_outcome(["report", "--db", jobs_db, "--format", "markdown"], capsys)
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| JOB |")
    assert [r.split("|")[1].strip() for r in rows[1:4]] == ["3f2a9c1e00000000a", "3f2a9c1e00000000b", "77aa0000"]


def test_a_unique_name_selects_the_job(jobs_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_outcome(["report", "--db", jobs_db, "--job", "chat-serve", "--format", "csv"], capsys)
    assert code == 0
    assert [r["id"] for r in csv.DictReader(io.StringIO(out))] == ["77aa0000cafe"]


@pytest.mark.parametrize("ref", ["3f2a", "llama-ft"])
def test_an_ambiguous_reference_lists_the_candidates(
    jobs_db: str, ref: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli_outcome(["report", "--db", jobs_db, "--job", ref], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "ambiguous" in err and "matches 2 jobs" in err
    assert "3f2a9c1e00000000a" in err and "3f2a9c1e00000000b" in err
    assert "77aa" not in err


def test_a_full_id_wins_and_an_unknown_reference_exits_2(jobs_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_outcome(["report", "--db", jobs_db, "--job", "3f2a9c1e00000000aaaa", "--format", "json"], capsys)
    assert code == 0 and len(json.loads(out)["jobs"]) == 1
    code, _, err = cli_outcome(["report", "--db", jobs_db, "--job", "ffff"], capsys)
    assert code == 2 and "no job 'ffff'" in err


@contextmanager
def running_collector(db_url: str, tmp_path: Path) -> Iterator[str]:
    """A real collector process on ``db_url``; yields its base URL."""
    with collector_process(db_url, tmp_path) as (url, _proc):
        yield url


@pytest.fixture
def collector(jobs_db: str, tmp_path: Path) -> Iterator[str]:
    with running_collector(jobs_db, tmp_path) as url:
        yield url


def test_a_collector_resolves_references_the_same_way(collector: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_outcome(["report", "--server", collector], capsys)
    assert code == 0
    assert table_ids(out) == ["3f2a9c1e00000000a", "3f2a9c1e00000000b", "77aa0000"]
    code, out, _ = cli_outcome(
        ["report", "--server", collector, "--job", "3f2a9c1e00000000b", "--format", "json"], capsys
    )
    assert code == 0 and [j["id"] for j in json.loads(out)["jobs"]] == ["3f2a9c1e00000000bbbb"]
    code, out, _ = cli_outcome(["report", "--server", collector, "--job", "chat-serve", "--format", "json"], capsys)
    assert code == 0 and [j["id"] for j in json.loads(out)["jobs"]] == ["77aa0000cafe"]
    code, _, err = cli_outcome(["report", "--server", collector, "--job", "llama-ft"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "ambiguous" in err and "3f2a9c1e00000000a" in err
    # The HTTP answer itself: 422 naming the parameter.
    r = httpx.get(f"{collector}/api/v1/report", params={"job": "3f2a"}, timeout=10)
    assert r.status_code == 409 and r.json()["field"] == "job"  # several stored jobs answer to it


def test_an_unreachable_collector_is_a_runtime_error_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli_outcome(["report", "--server", f"http://127.0.0.1:{free_port()}"], capsys)
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "unreachable" in err
