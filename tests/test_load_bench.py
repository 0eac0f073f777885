"""A few seconds of benchmarks/load.py on SQLite: it prints its command and a table of finite figures,
with no errors and every row sent stored (counted with plain SQL by the benchmark)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.e2e]


def run_load(*args: str) -> str:
    """The benchmark's output for ``args``."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def parse(out: str) -> dict[str, str]:
    """The one data row of the table, keyed by header."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines() if line.startswith("|")
    ]
    header, rule, *data = rows
    assert all(re.fullmatch(r"-+:?", c) for c in rule)
    assert len(data) == 1 and len(data[0]) == len(header)
    return dict(zip(header, data[0], strict=True))


@pytest.mark.parametrize("mode", ["throughput", "fleet"])
def test_load_on_sqlite_parses_with_no_errors(mode: str) -> None:
    args = ["--db", "sqlite", "--mode", mode, "--seconds", "3"]
    args += ["--senders", "2"] if mode == "throughput" else ["--agents", "20", "--push-interval", "1"]
    out = run_load(*args)
    assert out.startswith(f"`python benchmarks/load.py {' '.join(args)}`")
    row = parse(out)
    assert row["mode"] == mode
    assert row["errors"] == "0"
    stored, sent = (int(x) for x in row["stored/sent"].split("/"))
    assert stored == sent > 0
    rate = float(row["intervals/s"].rstrip("k")) * (1e3 if row["intervals/s"].endswith("k") else 1)
    assert rate > 0
    for key in ("p50", "p99"):
        assert re.fullmatch(r"\d+ ms", row[key])
    assert 0 < float(row["ratio"]) < 10
