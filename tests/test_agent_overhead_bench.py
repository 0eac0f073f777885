"""A short run of benchmarks/agent_overhead.py: it starts every process, measures them and prints the table
(whether the script works, not a speed target)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "agent_overhead.py"

pytestmark = pytest.mark.e2e


def table_rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows by their first cell (header and rule excluded)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "process":
            rows[cells[0]] = cells[1:]
    return rows


def test_short_run_prints_both_tools_with_positive_figures() -> None:
    # A 3 s run needs pushes more often than the agent's default 5 s to show its batches arriving.
    args = ["--duration", "3", "--warmup", "1", "--gpus", "2", "--push-interval", "1"]
    args += ["--metrics", "--scrape-every", "1"]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"`python benchmarks/agent_overhead.py {' '.join(args)}`")
    rows = table_rows(out.stdout)
    agent = next(v for k, v in rows.items() if k.startswith("wattwatch agent (--simulate 2, 1 s tick, pushing"))
    codecarbon = next(v for k, v in rows.items() if k.startswith("CodeCarbon OfflineEmissionsTracker (2 simulated"))
    for row in (agent, codecarbon):
        cpu_percent, rss_peak_mb = float(row[0]), float(row[1])
        assert math.isfinite(cpu_percent) and cpu_percent > 0, row
        assert math.isfinite(rss_peak_mb) and rss_peak_mb > 0, row
    assert codecarbon[2] == "1.00x"
    assert float(agent[2].rstrip("x")) == pytest.approx(float(agent[0]) / float(codecarbon[0]), rel=0.02)
    assert "CodeCarbon measured 2 GPUs" in out.stdout  # it really tracked the simulated boards
    assert "collector stored 0 batches" not in out.stdout  # the agent's pushes arrived
    assert "agent /metrics scraped" in out.stdout and "scraped 0 times" not in out.stdout
