"""``wattwatch jobs`` as a user runs it, against a database a real collector filled from simulated GPUs, on
SQLite and PostgreSQL: the list takes the report's filters; an id prefix as listed and a name both show the
job, with per-host and per-device figures that add up to it and the reason for a zero; a collector answers
the same; unknown references and filters that exclude the job are one line, exit 2."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
from pathlib import Path

import pytest

from procs import WATTWATCH
from report_data import JOBS, Filled, cli, fill
from test_cli_ids import running_collector
from wattwatch.reporting.render import format_energy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def filled(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Filled:
    return fill(module_db_url, tmp_path_factory.mktemp("jobs"))


@pytest.fixture(scope="module")
def entries(filled: Filled) -> dict[str, dict]:
    """name -> the job's report entry, as ``report --format json`` gives it."""
    out = cli(filled, "report", "--db", filled.db_url, "--format", "json")
    return {j["name"]: j for j in json.loads(out.stdout)["jobs"]}


def jobs(filled: Filled, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    return cli(filled, "jobs", "--db", filled.db_url, *args, code=code)


def test_the_list_shows_every_job_with_a_prefix_that_selects_it(filled: Filled, entries: dict[str, dict]) -> None:
    table = jobs(filled).stdout.split("\n\n")[0].splitlines()  # the table; notes on their own lines follow
    assert table[0].split()[:3] == ["JOB", "NAME", "KIND"] and max(len(line) for line in table) <= 100
    listed = {line.split()[1]: line.split()[0] for line in table[1 : len(JOBS) + 1]}
    assert listed == {name: entries[name]["short_id"] for name, *_ in JOBS}
    for name, prefix in listed.items():
        shown = json.loads(jobs(filled, prefix, "--format", "json").stdout)
        assert shown["id"] == entries[name]["id"] and shown["name"] == name
    # The report's filters and order.
    kinds = [j["name"] for j in json.loads(jobs(filled, "--kind", "inference", "--format", "json").stdout)["jobs"]]
    assert kinds == ["chat"]
    by_energy = json.loads(jobs(filled, "--sort", "energy", "--format", "json").stdout)["jobs"]
    assert [j["energy_j"] for j in by_energy] == sorted((j["energy_j"] for j in entries.values()), reverse=True)
    md = jobs(filled, "--label", "team=nlp", "--format", "markdown").stdout.splitlines()
    assert md[0].startswith("| JOB | NAME |") and md[1] == "|" + "---|" * (md[0].count(" | ") + 1)
    assert sorted(r.split("|")[2].strip() for r in md[2:4]) == ["llama-a", "llama-b"] and not md[4].startswith("|")
    rows = list(csv.DictReader(io.StringIO(jobs(filled, "--format", "csv").stdout)))
    assert sorted(r["name"] for r in rows) == sorted(entries)


def test_a_prefix_and_a_name_show_the_same_job_with_its_breakdown(filled: Filled, entries: dict[str, dict]) -> None:
    job = entries["llama-b"]
    by_name = jobs(filled, "llama-b").stdout
    assert jobs(filled, job["short_id"]).stdout == by_name
    assert f"{job['id']} (shortest prefix: {job['short_id']})" in by_name
    assert format_energy(job["energy_j"]) in by_name
    shown = json.loads(jobs(filled, "llama-b", "--format", "json").stdout)
    # Per host and per device add up to the job; the devices are the GPUs it was given.
    assert math.fsum(h["energy_j"] for h in shown["per_host"]) == pytest.approx(shown["energy_j"], rel=1e-9)
    assert math.fsum(d["energy_j"] for d in shown["per_device"]) == pytest.approx(shown["energy_j"], rel=1e-9)
    gpus = {d["device"]: d for d in shown["per_device"] if d["kind"] == "gpu"}
    assert set(gpus) == {"gpu0", "gpu1"} and all(d["energy_j"] > 0 and d["sources"] for d in gpus.values())
    assert shown["per_host"][0]["peak_power_w"] > 0
    # The table sections and the CSV (a row per device) say the same.
    section = by_name.split("Per device:\n", 1)[1].splitlines()
    assert section[0].split() == ["HOST", "DEVICE", "KIND", "ENERGY", "SOURCES"]
    assert {line.split()[1] for line in section[1:] if line.strip()} == {d["device"] for d in shown["per_device"]}
    assert "Per host:\nHOST  " in by_name and "PEAK W" in by_name
    rows = list(csv.DictReader(io.StringIO(jobs(filled, "llama-b", "--format", "csv").stdout)))
    assert {r["device"]: float(r["energy_j"]) for r in rows} == pytest.approx(
        {d["device"]: d["energy_j"] for d in shown["per_device"]}
    )
    md = jobs(filled, "llama-b", "--format", "markdown").stdout
    assert md.startswith(f"**Job {job['id']}**") and "| HOST | DEVICE | KIND | ENERGY | SOURCES |" in md


def test_a_job_without_a_gpu_shows_why_and_what_to_do(filled: Filled, entries: dict[str, dict]) -> None:
    job = entries["no-gpu"]
    assert job["reason"] and job["fix"]
    lines = jobs(filled, "no-gpu").stdout.splitlines()
    assert f"why       {job['reason']}." in lines and f"fix       {job['fix']}." in lines
    # The list marks it and gives the note under the table.
    listing = jobs(filled).stdout
    assert f"[1] {job['short_id']}: {job['reason']}. Fix: {job['fix']}." in listing


def test_a_collector_shows_the_same_job(filled: Filled, entries: dict[str, dict]) -> None:
    with running_collector(filled.db_url, filled.tmp) as url:
        remote = json.loads(cli(filled, "jobs", "--server", url, "chat", "--format", "json").stdout)
        listed = json.loads(cli(filled, "jobs", "--server", url, "--format", "json").stdout)
        missing = cli(filled, "jobs", "--server", url, "nosuchjob", code=2)
    assert remote["id"] == entries["chat"]["id"] and remote["energy_j"] == pytest.approx(entries["chat"]["energy_j"])
    assert remote["per_device"] == entries["chat"]["per_device"]  # the same rows read by the same code
    assert sorted(j["name"] for j in listed["jobs"]) == sorted(entries)
    assert len(missing.stderr.strip().splitlines()) == 1 and "nosuchjob" in missing.stderr


def test_output_writes_one_job_to_a_file(filled: Filled, tmp_path: Path) -> None:
    path = tmp_path / "chat.json"
    out = jobs(filled, "chat", "--format", "json", "--output", str(path))
    assert out.stdout == "" and json.loads(path.read_text())["name"] == "chat"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["nosuchjob"], "no job 'nosuchjob' (an id, id prefix or name) in this database; list jobs with"),
        (["llama-a", "--kind", "inference"], "job 'llama-a' does not match the filters given"),
        (["--since", "-1d"], "negative durations are invalid"),
        (["--sort", "size"], "invalid choice: 'size'"),
    ],
)
def test_errors_are_one_line_exit_2(filled: Filled, args: list[str], needle: str) -> None:
    out = jobs(filled, *args, code=2)
    assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr, out.stderr


def test_jobs_has_help_with_examples() -> None:
    out = subprocess.run([*WATTWATCH, "jobs", "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "examples:" in out.stdout and "wattwatch jobs 3f2a9c1e" in out.stdout
