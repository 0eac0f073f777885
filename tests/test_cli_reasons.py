"""Every zero explained: a job with 0 J, no device, or (training / inference) no GPU carries a reason and a
fix in every format; a job whose figures are plain carries none. On SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine

from wattwatch.cli.main import main
from wattwatch.protocol import wire
from wattwatch.storage import repository

NOW = time.time()
GPU = wire.Device(key="gpu0", kind="gpu", index=0, uuid="GPU-0", model="H100")
CPU = wire.Device(key="cpu0", kind="cpu")
# id -> (host, kind, running, intervals as (device, joules, share)), and the words its reason must hold.
CASES: dict[str, tuple[str, str, bool, list[tuple[str, float, float]], str | None]] = {
    "fine0001": ("gpuhost", "training", False, [("gpu0", 900.0, 1.0)], None),
    "cpuonly1": ("gpuhost", "other", False, [("cpu0", 30.0, 0.5)], None),
    "nogpu001": ("gpuhost", "training", False, [("cpu0", 0.2, 0.01)], "had no CUDA_VISIBLE_DEVICES"),
    "zerogpu1": ("gpuhost", "training", False, [("gpu0", 0.0, 1.0)], "GPUs reported no energy"),
    "cpuhost1": ("cpuhost", "training", False, [("cpu0", 40.0, 0.5)], "reported no GPU"),
    # Reported by its agent, but no interval gave it a share of anything.
    "unseen01": ("gpuhost", "inference", False, [], "held no GPU and no CPU time"),
    "pending1": ("gpuhost", "inference", True, [], "no energy stored for it yet"),
}


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATTWATCH_HOME", str(tmp_path / "home"))


@pytest.fixture
def seeded(db_url: str, db_engine: Engine) -> str:
    for seq, (job_id, (host, kind, running, parts, _)) in enumerate(CASES.items(), start=1):
        start = NOW - 3600 + seq * 60
        job = wire.Job(
            id=job_id, name=job_id, kind=kind, started_at_s=start, ended_at_s=None if running else start + 30
        )
        intervals = [
            wire.Interval(dev, start, start + 30, energy_j, "counter", shares={job_id: share}, idle_weight=1 - share)
            for dev, energy_j, share in parts
        ]
        devices = [GPU, CPU] if host == "gpuhost" else [CPU]
        batch = wire.Batch(agent_id=f"a-{host}", seq=seq, host=host, sent_at_s=start + 30, devices=devices)
        batch.intervals, batch.jobs = intervals, [job]
        repository.ingest_batch(db_engine, batch, received_at_s=start + 31)
    return db_url


def render(db: str, fmt: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["report", "--db", db, "--format", fmt]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return out.out


def test_json_carries_a_reason_and_a_fix_exactly_where_one_is_due(
    seeded: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = {j["id"]: j for j in json.loads(render(seeded, "json", capsys))["jobs"]}
    assert set(jobs) == set(CASES)
    for job_id, (*_, words) in CASES.items():
        job = jobs[job_id]
        if words is None:
            assert job["reason"] is None and job["fix"] is None, job_id
        else:
            assert words in job["reason"], (job_id, job["reason"])
            assert job["fix"], job_id


def test_csv_table_and_markdown_carry_them_too(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = {r["id"]: r for r in csv.DictReader(io.StringIO(render(seeded, "csv", capsys)))}
    explained = [job_id for job_id, case in CASES.items() if case[-1] is not None]
    for job_id in explained:
        assert rows[job_id]["reason"] and rows[job_id]["fix"]
    assert rows["fine0001"]["reason"] == "" and rows["fine0001"]["fix"] == ""

    table = render(seeded, "table", capsys).splitlines()
    assert table[0].split()[-1] == "NOTE"
    for job_id in explained:
        (row,) = [line for line in table if line.startswith(job_id)]
        mark = row.split()[-1]
        assert mark.startswith("[") and mark.endswith("]"), row
        (note,) = [line for line in table if line.startswith(f"{mark} {job_id}: ")]
        words = CASES[job_id][-1]
        assert words and words in note and "Fix: " in note
    (fine,) = [line for line in table if line.startswith("fine0001")]
    assert not fine.rstrip().endswith("]")

    md = render(seeded, "markdown", capsys).splitlines()
    assert md[0].startswith("| JOB |") and md[0].endswith("| NOTE |")
    assert md[1] == "|" + "---|" * (md[0].count(" | ") + 1)
    notes = [line for line in md if line.startswith("- [")]
    assert len(notes) == len(explained) and all("Fix: " in n for n in notes)
