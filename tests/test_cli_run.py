"""``wattwatch run`` as a user sees it under ``wattwatch up --simulate 2``: the job id at start, a summary
at exit (from the collector the agent pushes to, or from ``--db``), whose id prefix ``report`` takes back."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from procs import WATTWATCH
from test_e2e import Up, report_json, start_up

pytestmark = pytest.mark.e2e

SLEEP = [sys.executable, "-c", "import time; time.sleep(1.5)"]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("run")
    started = start_up(tmp, f"sqlite:///{tmp / 'run.db'}", simulate=2)
    yield started
    started.stop()


def wattwatch_run(up: Up, *args: str, cvd: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(up.env)
    if cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    return subprocess.run([*WATTWATCH, "run", *args], env=env, capture_output=True, text=True, timeout=120, check=False)


def summary_prefix(stderr: str) -> str:
    done = [line for line in stderr.splitlines() if " done: " in line]
    assert len(done) == 1, stderr
    match = re.search(r"job (\S+) done: ", done[0])
    assert match, done[0]
    return match.group(1)


def test_run_says_the_job_id_at_start_and_a_summary_at_exit(up: Up) -> None:
    out = wattwatch_run(up, "--kind", "training", "--name", "burn", "--", *SLEEP, cvd="0")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    start = re.match(r"wattwatch run: job ([0-9a-f]{32}) \(training 'burn'\) on \S+: gpu0$", lines[0])
    assert start, lines[0]
    full_id = start.group(1)
    prefix = summary_prefix(out.stderr)
    assert full_id.startswith(prefix) and len(prefix) >= 8
    assert re.search(r"done: [0-9.]+ k?J in 1\.[5-9]s, avg [0-9]+ W, on .*/gpu0;", lines[-1]), lines[-1]
    assert f"`wattwatch report --job {prefix}`" in lines[-1]
    # The prefix the summary printed selects the job, and its energy is what the summary said.
    report = subprocess.run(
        [*WATTWATCH, "report", "--db", up.db_url, "--job", prefix, "--format", "json"],
        env=up.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    (job,) = json.loads(report.stdout)["jobs"]
    assert job["id"] == full_id and job["energy_j"] > 50  # an H100 idles at ~60-70 W for 1.5 s
    # `run` stayed to print the summary after the job ended; it is no GPU process of the job's, so no after
    # phase holds the GPU meanwhile (the simulator lists its pid for the job).
    assert job["after_energy_j"] is None and job["phases"] == []
    from wattwatch.reporting.render import format_energy

    assert f"done: {format_energy(job['energy_j'])} in " in lines[-1]


def test_run_reads_the_summary_from_a_database_too(up: Up) -> None:
    out = wattwatch_run(up, "--db", up.db_url, "--name", "db-summary", "--", *SLEEP, cvd="1")
    assert out.returncode == 0, out.stderr
    prefix = summary_prefix(out.stderr)
    jobs = {j["name"]: j for j in report_json(up)["jobs"]}
    assert jobs["db-summary"]["id"].startswith(prefix)


def test_run_keeps_stdout_for_the_command_and_its_exit_code(up: Up) -> None:
    out = wattwatch_run(up, "--summary-wait", "0", "--", sys.executable, "-c", "print('hi'); raise SystemExit(4)")
    assert out.returncode == 4
    assert out.stdout == "hi\n"
    assert " done: " not in out.stderr


def test_a_job_that_held_no_gpu_says_why_at_exit_and_in_every_format(up: Up) -> None:
    # The case: a training job with no CUDA_VISIBLE_DEVICES whose process never touches a GPU.
    out = wattwatch_run(up, "--kind", "training", "--name", "no-gpu", "--", "sleep", "2")
    assert out.returncode == 0, out.stderr
    prefix = summary_prefix(out.stderr)
    done = out.stderr.strip().splitlines()[-1]
    assert "never appeared on a GPU and had no CUDA_VISIBLE_DEVICES" in done and "set CUDA_VISIBLE_DEVICES" in done
    args = [*WATTWATCH, "report", "--db", up.db_url, "--job", prefix, "--format"]
    formats = {
        fmt: subprocess.run([*args, fmt], env=up.env, capture_output=True, text=True, timeout=60, check=True).stdout
        for fmt in ("json", "csv", "table", "markdown")
    }
    (job,) = json.loads(formats["json"])["jobs"]
    assert job["gpu_energy_j"] == 0 and "CUDA_VISIBLE_DEVICES" in job["reason"] and job["fix"]
    (row,) = csv.DictReader(io.StringIO(formats["csv"]))
    assert row["reason"] == job["reason"] and row["fix"] == job["fix"]
    assert f"[1] {prefix}: {job['reason']}. Fix: {job['fix']}." in formats["table"]
    assert f"- [1] {prefix}: {job['reason']}." in formats["markdown"]


STEPS = "import time, wattwatch\nfor _ in range(5):\n    with wattwatch.step():\n        time.sleep(0.2)\n"


@pytest.mark.slow
def test_the_summary_gives_energy_per_step_when_the_job_marks_steps(up: Up) -> None:
    # The collector computes per-step energy in a pass every 10 s: the summary waits for it (bounded).
    out = wattwatch_run(up, "--summary-wait", "60", "--kind", "training", "--", sys.executable, "-c", STEPS, cvd="1")
    assert out.returncode == 0, out.stderr
    done = out.stderr.strip().splitlines()[-1]
    assert re.search(r"avg [0-9]+ W, [0-9.]+ k?J/step over 5 steps, on ", done), done
    assert "still being computed" not in done
