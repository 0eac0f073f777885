"""A reduced run of benchmarks/report_startup.py on SQLite: ``wattwatch report --server`` and
``wattwatch --help`` start within the README's target, stated as a ratio to ``python -c pass`` timed in the
same run so that it holds on a slower or busier machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_benchmark_tables import tables

ROOT = Path(__file__).resolve().parent.parent

# slow: a benchmark guard, a few dozen process start-ups
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The target is 200 ms for `wattwatch report` on the machine where `python -c pass` took 19 ms (README,
# "Start-up time of a command"): 200 / 19 = 10.5, so at most 10 times Python's own start-up.
MAX_RATIO_TO_PYTHON = 10.0


def test_report_through_a_collector_and_help_start_within_ten_pythons() -> None:
    args = ["--repeat", "5", "--sqlite-only", "--top", "3"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report_startup.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(f"`python benchmarks/report_startup.py {' '.join(args)}`")
    startup = tables(out.stdout)[0]
    assert startup[0][:3] == ["what", "wall time", "x python -c pass"]
    ratio = {row[0]: float(row[2]) for row in startup[1:]}
    print("\n" + "\n".join(f"{what}: {x:.1f}x python -c pass" for what, x in ratio.items()))
    assert ratio["`python -c pass`"] == 1.0
    for what in ("`wattwatch report --server`, a collector on it", "`wattwatch --help`"):
        assert ratio[what] <= MAX_RATIO_TO_PYTHON, (what, ratio)
