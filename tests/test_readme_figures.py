"""Reduced runs of the scripts that print the whole-pipeline and other-checks figures of docs/accuracy.md and
the SDK cost of docs/performance.md: each prints its command line, a caption naming its truth, and markdown
tables of finite figures with the columns the docs show. They check that the scripts work; the figures' size
is asserted only loosely (a broken truth or a wrong sum is off by far more)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import checks  # lives in benchmarks/, importable once the path above is set
import pipeline
import sdk_overhead

from test_benchmark_tables import assert_docs_show, check_table, figures, tables

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # benchmark guards: each reruns a benchmark script


def errors_percent(table: list[list[str]], column: int) -> list[float]:
    """The percentages of one column (``-0.01% to +0.02%``), every row."""
    return [x for row in table[1:] for x in figures([row[column].replace("points", "")])]


def test_pipeline_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--runs", "1", "--jobs", "2", "--share-s", "1"]
    assert pipeline.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "`python benchmarks/pipeline.py " + " ".join(argv) + "`"
    assert "not by wattwatch's accounting" in " ".join(out.split())
    whole, setup = tables(out)
    check_table(whole, ("job", "duration", "measured vs exact, SQLite"), 3)
    assert_docs_show(tuple(whole[0]))
    assert [row[0] for row in whole[1:]] == [label for _, label, _ in pipeline.PIPELINE_ROWS]
    assert all(abs(e) < 2 for e in errors_percent(whole, 2)), whole
    check_table(setup, ("energy of", "duration", "measured vs exact, SQLite"), len(pipeline.SETUP_ROWS))
    assert_docs_show(tuple(setup[0]))
    # The first setup starts at a tick read, up to ~60 ms of power off in 0.5 s; the rest is within 2 %.
    assert all(abs(e) < 20 for e in errors_percent(setup, 2)), setup


def test_checks_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert checks.main(["--runs", "1", "--train-s", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("`python benchmarks/checks.py --runs 1 --train-s 1`")
    assert "not by wattwatch's accounting" in " ".join(out.split())
    (table,) = tables(out)
    check_table(table, ("check", "exact", "measured", "error"), 5)
    assert_docs_show(tuple(table[0]))
    assert all(abs(e) < 2 for e in errors_percent(table, 3)), table


def test_sdk_overhead_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert sdk_overhead.main(["--spans", "500", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("`python benchmarks/sdk_overhead.py --spans 500 --repeats 2`")
    (table,) = tables(out)
    check_table(table, ("span", "socket present", "÷ baseline", "no agent socket", "÷ baseline"), 3)
    baseline, query, step = (figures(row[1:]) for row in table[1:])
    assert baseline[1] == baseline[3] == 1.0
    for span in (query, step):  # a span does what the baseline does and more
        assert span[0] > baseline[0] and span[2] > baseline[2], table
