"""The Monday report as a user runs it, against a database a real collector filled from simulated GPUs, on
SQLite and PostgreSQL: every format parses and their totals agree with each other, with the sum of their
rows and with ``/api/v1/report``; ``--group-by`` groups add up to their jobs; ``--sort`` orders;
``--output`` writes the file; tables fit 100 columns, plain when piped, coloured only on a terminal."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import pty
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from procs import WATTWATCH, free_port
from report_data import JOBS, Filled, cli, fill
from test_cli_ids import running_collector
from wattwatch.reporting.render import format_energy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def filled(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Filled:
    return fill(module_db_url, tmp_path_factory.mktemp("views"))


@pytest.fixture(scope="module")
def server(filled: Filled) -> Iterator[str]:
    with running_collector(filled.db_url, filled.tmp) as url:
        yield url


def report(filled: Filled, *args: str) -> subprocess.CompletedProcess[str]:
    return cli(filled, "report", "--db", filled.db_url, *args)


def as_json(filled: Filled, *args: str) -> dict:
    return json.loads(report(filled, "--format", "json", *args).stdout)


def test_every_format_parses_and_the_totals_agree(filled: Filled, server: str) -> None:
    rep = as_json(filled)
    jobs, totals = rep["jobs"], rep["totals"]
    assert sorted(j["name"] for j in jobs) == sorted(name for name, *_ in JOBS)
    # The footer's totals are the sum of the rows; the idle share is idle over all measured.
    assert totals["jobs"] == len(JOBS)
    assert totals["energy_j"] == pytest.approx(math.fsum(j["energy_j"] for j in jobs), rel=1e-12)
    assert totals["emissions_g"] == pytest.approx(math.fsum(j["emissions_g"] for j in jobs), rel=1e-12)
    assert totals["energy_j"] > 100 and totals["idle_energy_j"] > 0
    idle_j = math.fsum(i["energy_j"] for i in rep["idle"])
    assert totals["idle_energy_j"] == pytest.approx(idle_j, rel=1e-12)
    assert totals["idle_share"] == pytest.approx(idle_j / totals["measured_energy_j"], rel=1e-12)

    rows = list(csv.DictReader(io.StringIO(report(filled, "--format", "csv").stdout)))
    assert [r["id"] for r in rows] == [j["id"] for j in jobs]  # one row per job, no more
    assert math.fsum(float(r["energy_j"]) for r in rows) == pytest.approx(totals["energy_j"], rel=1e-9)

    md = report(filled, "--format", "markdown").stdout.splitlines()
    assert md[0].startswith("| JOB | NAME |") and md[1] == "|" + "---|" * (md[0].count(" | ") + 1)
    table_rows = [line for line in md[2:] if line.startswith("| ")][: len(JOBS) + 1]
    assert all(r.count(" | ") == md[0].count(" | ") for r in table_rows)
    total_md = [c.strip() for c in table_rows[-1].strip("|").split("|")]
    header = [c.strip() for c in md[0].strip("|").split("|")]
    assert total_md[0] == "**TOTAL**" and total_md[header.index("ENERGY")] == f"**{format_energy(totals['energy_j'])}**"
    assert f"{totals['idle_share'] * 100:.1f} % of the" in "\n".join(md)

    table = report(filled).stdout.splitlines()
    (total_line,) = [line for line in table if line.startswith("TOTAL ")]
    assert format_energy(totals["energy_j"]) in total_line and f"{len(JOBS)} jobs" in total_line
    assert f"{totals['emissions_g']:.3g}" in total_line.split()

    # The collector's answer: the same jobs, the same totals, as the CLI's --server report.
    api = httpx.get(f"{server}/api/v1/report", timeout=30).json()
    assert api["totals"]["energy_j"] == pytest.approx(totals["energy_j"], rel=1e-12)
    assert api["totals"]["idle_energy_j"] == pytest.approx(totals["idle_energy_j"], rel=1e-12)
    assert api["totals"]["emissions_g"] == pytest.approx(totals["emissions_g"], rel=1e-12)
    remote = json.loads(cli(filled, "report", "--server", server, "--format", "json").stdout)
    assert remote["totals"] == pytest.approx(totals)


@pytest.mark.parametrize("by", ["kind", "host", "label:team"])
def test_groups_add_up_to_their_jobs_and_to_the_totals(filled: Filled, by: str) -> None:
    rep = as_json(filled, "--group-by", by)
    jobs = {j["id"]: j for j in rep["jobs"]}
    groups = rep["groups"]
    assert rep["group_by"] == by and groups
    for group in groups:
        members = [jobs[i] for i in group["job_ids"]]
        if by == "host":
            parts = [h for j in members for h in j["per_host"] if h["host"] == group["group"]]
            expected_j, expected_g = sum(h["energy_j"] for h in parts), sum(h["emissions_g"] for h in parts)
        else:
            expected_j, expected_g = sum(j["energy_j"] for j in members), sum(j["emissions_g"] for j in members)
            key = by.partition(":")[2]
            want = {j["kind"] if by == "kind" else j["labels"].get(key, "(none)") for j in members}
            assert want == {group["group"]}
        assert group["energy_j"] == pytest.approx(expected_j, rel=1e-9)
        assert group["emissions_g"] == pytest.approx(expected_g, rel=1e-9)
    assert math.fsum(g["energy_j"] for g in groups) == pytest.approx(rep["totals"]["energy_j"], rel=1e-9)
    if by == "label:team":
        assert {g["group"]: g["jobs"] for g in groups} == {"nlp": 2, "web": 1, "(none)": 1}

    # CSV: the groups, then a total row equal to their sum.
    rows = list(csv.DictReader(io.StringIO(report(filled, "--group-by", by, "--format", "csv").stdout)))
    assert [r["row"] for r in rows] == ["group"] * len(groups) + ["total"]
    total = rows[-1]
    assert total["group"] == "TOTAL" and float(total["idle_share"]) == pytest.approx(rep["totals"]["idle_share"])
    assert float(total["energy_j"]) == pytest.approx(sum(float(r["energy_j"]) for r in rows[:-1]), rel=1e-9)
    assert float(total["emissions_g"]) == pytest.approx(sum(float(r["emissions_g"]) for r in rows[:-1]), rel=1e-9)

    table = report(filled, "--group-by", by).stdout.splitlines()
    assert table[0].split()[-4:] == ["ENERGY", "SHARE", "CO2e", "g"]
    assert [line.split()[0] for line in table[1 : len(groups) + 1]] == [g["group"] for g in groups]
    assert table[len(groups) + 1].startswith("TOTAL ") and "100.0 %" in table[len(groups) + 1]
    md = report(filled, "--group-by", by, "--format", "markdown").stdout.splitlines()
    assert md[1] == "|---|---|---|---|---|---|" and md[len(groups) + 2].startswith("| TOTAL |")


def test_sort_orders_jobs_and_groups(filled: Filled) -> None:
    energies = [j["energy_j"] for j in as_json(filled, "--sort", "energy")["jobs"]]
    assert energies == sorted(energies, reverse=True) and len(energies) == len(JOBS)
    names = [j["name"] for j in as_json(filled, "--sort", "name")["jobs"]]
    assert names == sorted(names)
    started = [j["started_at_s"] for j in as_json(filled)["jobs"]]
    assert started == sorted(started)  # the default: oldest first
    groups = [g["energy_j"] for g in as_json(filled, "--group-by", "label:team", "--sort", "energy")["groups"]]
    assert groups == sorted(groups, reverse=True)
    by_energy = as_json(filled, "--sort", "energy")["jobs"]
    table = report(filled, "--sort", "energy").stdout.splitlines()
    assert [line.split()[0] for line in table[1 : len(JOBS) + 1]] == [j["short_id"] for j in by_energy]


@pytest.mark.parametrize("fmt", ["table", "json", "csv", "markdown"])
def test_output_writes_the_file_and_stdout_stays_empty(filled: Filled, tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"week.{fmt}"
    args = ("--format", fmt, "--group-by", "kind", "--since", "2020-01-01")  # a fixed window: the same twice
    out = report(filled, *args, "--output", str(path))
    assert out.stdout == "" and f"to {path}" in out.stderr
    text = path.read_text()
    assert text == report(filled, *args).stdout
    if fmt == "json":
        assert {g["group"] for g in json.loads(text)["groups"]} == {"training", "inference"}
    elif fmt == "csv":
        assert [r["group"] for r in csv.DictReader(io.StringIO(text))] == ["inference", "training", "TOTAL"]


def test_tables_fit_100_columns_in_plain_ascii_when_piped(filled: Filled) -> None:
    for args in ([], ["--group-by", "kind"]):
        text = report(filled, *args).stdout
        assert text.isascii() and "\x1b" not in text
        table = text.split("\n\n")[0].splitlines()
        assert max(len(line) for line in table) <= 100, table
    full = report(filled, "--width", "0").stdout.splitlines()
    assert "GPU" in full[0].split() and max(len(line) for line in full) > 100  # what fitting hid
    narrow = report(filled, "--width", "60")
    assert max(len(line) for line in narrow.stdout.split("\n\n")[0].splitlines()) <= 60
    assert "Hidden to fit 60 columns: " in narrow.stdout
    wide = cli(filled, "report", "--db", filled.db_url, env={"COLUMNS": "200"}).stdout.splitlines()
    assert "GPU" in wide[0].split()


def on_a_terminal(filled: Filled, *args: str, env: dict[str, str] | None = None) -> str:
    """What ``wattwatch ARGS`` prints on a terminal (a pty), 120 columns wide."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [*WATTWATCH, *args], env={**filled.env, **(env or {})}, stdout=follower, stderr=subprocess.PIPE
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the pty closes when the process exits
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode()


def test_colour_only_on_a_terminal_and_never_when_refused(filled: Filled) -> None:
    args = ("report", "--db", filled.db_url, "--width", "120")
    assert "\x1b[1m" in on_a_terminal(filled, *args)
    assert "\x1b[" not in on_a_terminal(filled, *args, "--no-color")
    assert "\x1b[" not in on_a_terminal(filled, *args, env={"NO_COLOR": "1"})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--group-by", "team"], "--group-by 'team' is unknown; use kind, host or label:KEY"),
        (["--group-by", "label:"], "names no label key"),
        (["--sort", "joules"], "invalid choice: 'joules'"),
        (["--width", "-3"], "--width -3 is negative"),
        (["--output", "/nonexistent-dir/week.md"], "--output /nonexistent-dir/week.md: cannot write it"),
    ],
)
def test_bad_view_options_are_one_line_exit_2(filled: Filled, args: list[str], needle: str) -> None:
    out = cli(filled, "report", "--db", filled.db_url, *args, code=2)
    assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr, out.stderr
    assert out.stdout == ""


def test_the_window_and_a_filter_narrow_the_totals(filled: Filled) -> None:
    nlp = as_json(filled, "--label", "team=nlp", "--group-by", "kind")
    assert {j["name"] for j in nlp["jobs"]} == {"llama-a", "llama-b"}
    assert [g["group"] for g in nlp["groups"]] == ["training"]
    assert nlp["totals"]["energy_j"] == pytest.approx(sum(j["energy_j"] for j in nlp["jobs"]), rel=1e-12)
    assert re.search(r"^TOTAL +2 jobs ", report(filled, "--label", "team=nlp").stdout, re.M)


@pytest.mark.slow
def test_the_demo_table_fits_100_columns(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "NO_COLOR")}
    env["WATTWATCH_HOME"] = str(tmp_path / "home")
    argv = [*WATTWATCH, "demo", "--duration", "4", "--listen", f"127.0.0.1:{free_port()}"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("\n\n")[1].splitlines()  # after the demo's own lines
    assert table[0].startswith("JOB ") and any(line.startswith("TOTAL ") for line in table)
    assert max(len(line) for line in table) <= 100, table
    assert "\x1b" not in out.stdout
