"""Progress for what takes more than a second, seen as a user sees it (real processes): ``wattwatch demo``
redraws a status line on a terminal and writes plain lines when piped; ``wattwatch agent`` with its
collector away stops at once on Ctrl-C and says what stays in its spool (all of it, for the next start)."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from procs import WATTWATCH, free_port, wait_for
from ptys import PtyProcess
from wattwatch.agent.spool import SPOOL_FILE, Spool

pytestmark = pytest.mark.e2e


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "WATTWATCH_HOME": str(home)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.mark.slow
def test_demo_redraws_a_status_line_on_a_terminal(tmp_path: Path) -> None:
    demo = PtyProcess([*WATTWATCH, "demo", "--duration", "6", "--listen", f"127.0.0.1:{free_port()}"], _env(tmp_path))
    try:
        status = r"demo: (\d+) s of 6 s \((\d+) s left\); power now (\d+) W; jobs so far ([0-9.]+ k?J); (\d+) queries"
        first = demo.read_until(status, 60)
        later = demo.read_until(status, 30, start=first.end())
        while int(later[1]) == int(first[1]):
            later = demo.read_until(status, 30, start=later.end())
        assert int(later[1]) > int(first[1]) and int(later[2]) < int(first[2])
        assert int(later[3]) > 100  # four simulated H100s, three of them loaded
        # The line is wiped before the report (the cursor back up on it, the line erased), and the report follows.
        demo.read_until(r"\x1b\[1A\x1b\[2K(wattwatch up: stopping|\r?\n)", 60, start=later.end())
        demo.read_until(r"llama-ft \(demo\)", 60)
        assert demo.wait(60) == 0
        assert "Traceback" not in demo.text
    finally:
        demo.close()


@pytest.mark.slow
def test_demo_piped_writes_plain_progress_lines_on_stderr(tmp_path: Path) -> None:
    out = subprocess.run(
        [*WATTWATCH, "demo", "--duration", "7", "--listen", f"127.0.0.1:{free_port()}"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("demo: ")]
    assert len(lines) >= 2, out.stderr  # one at once, then one every 5 s
    assert all(re.fullmatch(r"demo: \d+ s of 7 s \(\d+ s left\); .*", line) for line in lines), lines
    assert "\x1b" not in out.stderr and not re.search(r"^demo: ", out.stdout, re.M)


def spooled(path: Path) -> int:
    """Batches in the agent's spool; 0 while the agent has created the file but not yet its table."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'batches'").fetchone() is None:
            return 0
        return int(db.execute("SELECT count(*) FROM batches").fetchone()[0])


def test_agent_with_its_collector_away_stops_at_once_on_ctrl_c_and_keeps_its_spool(tmp_path: Path) -> None:
    away = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    agent = subprocess.Popen(
        [*WATTWATCH, "agent", "--simulate", "1", "--collector", away, "--interval", "0.2", "--push-interval", "0.5"],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    spool = tmp_path / SPOOL_FILE
    try:
        wait_for(lambda: spool.exists() and spooled(spool) >= 3, 60, "three batches spooled")
        before = spooled(spool)
        agent.send_signal(signal.SIGINT)
        sent_s = time.monotonic()
        _, err = agent.communicate(timeout=30)
        took_s = time.monotonic() - sent_s
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, err
    assert took_s < 2.5, f"took {took_s:.1f} s to stop"
    said = re.search(r"wattwatch agent: (\d+) batches not yet accepted by the collector \(.*unreachable.*\) stay in "
                     rf"{re.escape(str(spool))} for the next start; nothing is lost", err)  # fmt: skip
    assert said, err
    kept = Spool(spool)
    try:
        assert kept.pending() == int(said[1]) >= before
    finally:
        kept.close()
