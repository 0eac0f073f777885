"""Short runs of benchmarks/agent_overhead.py: it starts every process, measures them and prints the table;
at the configuration docs/agent-cpu.md states its target for (8 simulated GPUs, 1 s tick, pushing every 5 s),
the agent uses at most 1.25x the CPU of CodeCarbon's tracker reading the same boards in the same run, and
under 60 MB."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "agent_overhead.py"

# slow: a benchmark guard, the agent and CodeCarbon's tracker side by side
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


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


# The target for the agent (docs/agent-cpu.md: "within 1.25x CodeCarbon's CPU at 8 GPUs, 1 s; RSS < 60 MB"): CPU
# as a ratio to CodeCarbon's tracker measured over the same window, so it holds on a slower or busier machine.
# Why 1.25x and not 1.0x: on a shared 2-core machine the ratio measures 1.06-1.14x (a single run moves by about
# +-10 %). Each push goes through httpx, about 1.3 ms of CPU where http.client on a kept connection takes about 1.0 ms,
# and the agent reads each GPU two to three times a tick through the simulator (CodeCarbon once), at the
# simulator's Python cost per read, which a real driver call does not have.
MAX_CPU_RATIO_TO_CODECARBON = 1.25
MAX_AGENT_RSS_MB = 60.0


def test_the_agent_uses_at_most_a_quarter_more_cpu_than_codecarbon_and_under_60_mb() -> None:
    # The script's defaults are the target's configuration (8 GPUs, 1 s tick, a push every 5 s); a 20 s
    # window after the default 5 s warm-up (start-up and the first push) holds four pushes. One window's
    # ratio moves by about +-10 % on a shared machine (one measured 1.27x where the same code measures
    # 1.13x alone): the claim is checked on the median of three windows, each measured afresh.
    args = ["--duration", "20", "--warmup", "5"]
    ratios, rss_mb = [], []
    for _ in range(3):
        out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        rows = table_rows(out.stdout)
        agent = next(v for k, v in rows.items() if k.startswith("wattwatch agent (--simulate 8, 1 s tick, pushing"))
        codecarbon = next(v for k, v in rows.items() if k.startswith("CodeCarbon OfflineEmissionsTracker (8 simulated"))
        assert "CodeCarbon measured 8 GPUs" in out.stdout and "collector stored 0 batches" not in out.stdout
        agent_cpu, codecarbon_cpu = float(agent[0]), float(codecarbon[0])
        assert codecarbon_cpu > 0, codecarbon
        ratios.append(agent_cpu / codecarbon_cpu)
        rss_mb.append(float(agent[1]))
    print(f"\nagent CPU / CodeCarbon's: {', '.join(f'{r:.2f}x' for r in ratios)}; agent RSS {max(rss_mb)} MB")
    assert statistics.median(ratios) <= MAX_CPU_RATIO_TO_CODECARBON, ratios
    assert max(rss_mb) < MAX_AGENT_RSS_MB, rss_mb
