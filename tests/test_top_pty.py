"""``wattwatch top`` and ``wattwatch run`` on a terminal, as a user sees them, under ``wattwatch up
--simulate 2``: top redraws its frame in place while a job loads a simulated GPU, the job's energy grows
from frame to frame, Ctrl-C leaves top with status 0 and the cursor shown; ``run`` prints the job id at
start and its summary at exit (energy, duration, average power). Piped, ``top --once`` is plain text."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import wcwidth

from procs import WATTWATCH
from ptys import PtyProcess
from test_e2e import Up, start_up
from wattwatch.reporting.render import format_energy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a real pty watching a live agent for several seconds

_UNITS = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}


def joules(text: str) -> float:
    """``"11.3 kJ"`` -> 11300.0 (what ``report.format_energy`` writes)."""
    number, unit = text.split()
    return float(number) * _UNITS[unit[:-1]]


def wait_for_file(path: Path) -> list[str]:
    """A command that runs until ``path`` exists (at most two minutes)."""
    code = (
        "import os, time\n"
        "deadline = time.monotonic() + 120\n"
        f"while not os.path.exists({str(path)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    return [sys.executable, "-c", code]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("top")
    started = start_up(tmp, f"sqlite:///{tmp / 'top.db'}", simulate=2)
    yield started
    started.stop()


def test_top_draws_live_frames_and_run_prints_its_summary(up: Up, tmp_path: Path) -> None:
    go = tmp_path / "go"
    run = PtyProcess(
        [*WATTWATCH, "run", "--kind", "training", "--name", "pty-burn", "--", *wait_for_file(go)],
        {**up.env, "CUDA_VISIBLE_DEVICES": "0"},
    )
    top = PtyProcess([*WATTWATCH, "top", "--interval", "0.5"], up.env)
    try:
        job_id = run.read_until(r"wattwatch run: job ([0-9a-f]{32}) \(training 'pty-burn'\) on \S+: gpu0", 60)[1]
        row = rf"gpu0 +(\d+) W +{job_id[:8]}[0-9a-f]* pty-burn \(training\) +([0-9.]+ [kMG]?J)"
        # Frames until one shows the GPU under load and the job's energy has grown since the first.
        first = top.read_until(row, 60)
        seen = first
        while not (joules(seen[2]) > joules(first[2]) and int(seen[1]) >= 200):
            seen = top.read_until(row, 30, start=seen.end())
        between = top.text[first.end() : seen.start()]
        assert re.search(r"\x1b\[\d*A", between)  # the later frame was drawn over the earlier one (cursor up)
        assert top.text.startswith("\x1b[?25l")  # the cursor hidden while frames are drawn
        assert re.search(rf"{job_id[:8]}[0-9a-f]* +pty-burn +training +\d+ W +[0-9.]+ [kM]?J", top.text)

        go.touch()  # the job's command exits: run prints the summary
        done = run.read_until(r"wattwatch run: job (\S+) done: ([0-9.]+ [kM]?J) in ([0-9.]+)s, avg (\d+) W, ", 60)
        assert run.wait(30) == 0
        assert job_id.startswith(done[1])
        report = subprocess.run(
            [*WATTWATCH, "report", "--db", up.db_url, "--job", done[1], "--format", "json"],
            env=up.env, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        (job,) = json.loads(report.stdout)["jobs"]
        assert done[2] == format_energy(job["energy_j"]) and job["energy_j"] > joules(first[2])
        assert float(done[3]) == pytest.approx(job["duration_s"], abs=0.1)
        assert int(done[4]) == round(job["avg_power_w"])

        # The ended job leaves gpu0: a later frame shows it idle; Ctrl-C quits with 0 and the cursor back.
        top.read_until(r"gpu0 +\d+ W +idle", 60, start=len(top.text))
        top.ctrl_c()
        assert top.wait(10) == 0
        assert top.text.endswith("\x1b[?25h")
        assert "Traceback" not in top.text and "KeyboardInterrupt" not in top.text
    finally:
        run.close()
        top.close()


def test_top_once_piped_is_one_plain_frame(up: Up) -> None:
    out = subprocess.run(
        [*WATTWATCH, "top", "--once"], env=up.env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout
    assert re.search(r"^\S+ +gpu0 +\d+ W ", out.stdout, re.M) and re.search(r"^\S+ +gpu1 +\d+ W ", out.stdout, re.M)
    assert "running jobs: " in out.stdout and out.stdout.count("wattwatch top ") == 1


def test_top_says_in_one_line_when_no_collector_answers(tmp_path: Path) -> None:
    out = subprocess.run(
        [*WATTWATCH, "--home", str(tmp_path), "top", "--once", "--server", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.startswith("wattwatch top: error: collector at http://127.0.0.1:9 unreachable")
    assert len(out.stderr.strip().splitlines()) == 1


def test_top_watches_the_collector_wattwatch_server_names(tmp_path: Path) -> None:
    """WATTWATCH_SERVER, set once for reports of a cluster, is where `top` looks too (before the local
    agent's collector): here an address where nothing answers, named in the one-line error."""
    env = {**os.environ, "WATTWATCH_SERVER": "http://127.0.0.1:9"}
    out = subprocess.run(
        [*WATTWATCH, "--home", str(tmp_path), "top", "--once"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert out.stderr.startswith("wattwatch top: error: collector at http://127.0.0.1:9 unreachable"), out.stderr


_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
WIDE_NAME = "训练-🚀-run"  # two CJK characters and an emoji: two terminal cells each


def screen_lines(text: str) -> list[str]:
    """What a pty showed, line by line, without the control codes (cursor moves, styles)."""
    return _CONTROL.sub("", text).split("\n")


def column_offsets(lines: list[str], field: int) -> set[int]:
    """The display cell (wcwidth) at which field ``field`` (0-based; fields are separated by two or more
    spaces) starts on each of ``lines``."""
    offsets = set()
    for line in lines:
        starts = [0] + [m.end() for m in re.finditer(r" {2,}", line.rstrip())]
        assert len(starts) > field, line
        offsets.add(wcwidth.wcswidth(line[: starts[field]]))
    return offsets


def test_a_wide_job_name_keeps_the_columns_of_top_and_report_in_line(up: Up, tmp_path: Path) -> None:
    go = tmp_path / "go"
    wide = PtyProcess(
        [*WATTWATCH, "run", "--kind", "training", "--name", WIDE_NAME, "--", *wait_for_file(go)],
        {**up.env, "CUDA_VISIBLE_DEVICES": "0"},
    )
    narrow = PtyProcess(
        [*WATTWATCH, "run", "--kind", "inference", "--name", "ascii-run", "--", *wait_for_file(go)],
        {**up.env, "CUDA_VISIBLE_DEVICES": "1"},
    )
    top: PtyProcess | None = None
    try:
        wide_id = wide.read_until(rf"wattwatch run: job ([0-9a-f]{{32}}) \(training '{re.escape(WIDE_NAME)}'\)", 60)[1]
        narrow_id = narrow.read_until(r"wattwatch run: job ([0-9a-f]{32}) \(inference 'ascii-run'\)", 60)[1]
        top = PtyProcess([*WATTWATCH, "top", "--interval", "0.5"], up.env)
        # A whole frame in which gpu0 shows the wide job, gpu1 the narrow one, and both jobs run: each job
        # binds its GPU on its own first tick, so early frames may show either GPU idle.
        wanted = (
            re.compile(rf"gpu0 +\d+ W +{wide_id[:8]}[0-9a-f]* {re.escape(WIDE_NAME)} "),
            re.compile(rf"gpu1 +\d+ W +{narrow_id[:8]}[0-9a-f]* ascii-run "),
            re.compile(r"^running jobs: 2", re.MULTILINE),
        )
        start = 0
        deadline = time.monotonic() + 60
        while True:
            begin = top.read_until(r"wattwatch top ", max(deadline - time.monotonic(), 0.1), start=start)
            end = top.read_until(r"power now: ", 30, start=begin.end())
            frame = screen_lines(top.text[begin.start() : end.start()])
            if all(regex.search("\n".join(frame)) for regex in wanted):
                break
            assert time.monotonic() < deadline, frame
            start = end.end()
        top.ctrl_c()
        assert top.wait(10) == 0

        # Running jobs: JOB, NAME, KIND, ...: KIND starts at one cell on the header and both rows.
        at = next(i for i, line in enumerate(frame) if line.startswith("running jobs: 2"))
        running = frame[at + 1 : at + 4]
        assert running[0].startswith("JOB ") and any(WIDE_NAME in line for line in running), frame
        assert len(column_offsets(running, 2)) == 1, running
        # Per GPU: HOST, GPU, POWER, JOB (id, name, kind), ENERGY SO FAR: the energy starts at one cell.
        gpus = [line for line in frame if line.startswith("HOST ") or re.search(r" gpu\d +\d+ W +[0-9a-f]{8}", line)]
        assert len(gpus) == 3 and any(WIDE_NAME in line for line in gpus), frame
        assert len(column_offsets(gpus, 4)) == 1, gpus

        go.touch()
        assert wide.wait(60) == 0 and narrow.wait(60) == 0
        report = PtyProcess([*WATTWATCH, "report", "--db", up.db_url], up.env)
        assert report.wait(60) == 0
        table = screen_lines(report.text)
        rows = [line for line in table if line.startswith("JOB ") or re.match(r"[0-9a-f]{4,} ", line)]
        assert any(WIDE_NAME in line for line in rows) and any("ascii-run" in line for line in rows), table
        # JOB, NAME, KIND: the kind starts at one cell on the header and every job's row.
        assert len(column_offsets(rows, 2)) == 1, rows
    finally:
        wide.close()
        narrow.close()
        if top is not None:
            top.close()
