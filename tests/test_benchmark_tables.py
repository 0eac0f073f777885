"""Reduced runs of the benchmarks whose tables the documentation shows (docs/accuracy.md, docs/performance.md
and the pages they link): each prints its command line, then a markdown table of finite figures, whose header
is the one the docs show; and the truth they measure against is computed without wattwatch. Every benchmark
command the docs show names a script that exists and takes the options shown."""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import exact_split  # lives in benchmarks/, importable once the path above is set
import ingest
import mdtable
import query_energy
import query_energy_live

from wattwatch.sim.fleet import SimulatedFleet

T0 = 1_700_000_000.0
REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def tables(out: str) -> list[list[list[str]]]:
    """Every markdown table in ``out``: rows of cells, header first, the rule left out."""
    found: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in out.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(re.fullmatch(r"-+:?", c) for c in cells):
                continue
            if current is None:
                current = []
                found.append(current)
            current.append(cells)
        else:
            current = None
    return found


def figures(cells: list[str]) -> list[float]:
    """Every number in the cells (percentages, J, ms, 341k), as floats."""
    return [float(x) for c in cells for x in re.findall(r"[-+]?\d[\d,]*\.?\d*(?:e[-+]?\d+)?", c.replace(",", ""))]


def check_table(table: list[list[str]], header: tuple[str, ...], n_rows: int) -> None:
    assert tuple(table[0]) == header
    assert len(table) == 1 + n_rows
    for row in table[1:]:
        assert len(row) == len(header)
        values = figures(row[1:])
        assert values and all(math.isfinite(v) for v in values), row


def docs_headers() -> set[tuple[str, ...]]:
    """The header row of every markdown table in the docs (README and docs/), where the figures live."""
    pages = [REPO / "README.md", *DOCS.rglob("*.md")]
    return {tuple(t[0]) for page in pages for t in tables(page.read_text())}


def assert_docs_show(header: tuple[str, ...]) -> None:
    """A script's table appears in the docs with the same columns, so the pasted figures match its output."""
    assert header in docs_headers(), f"no table in docs/ has the columns {header}: re-run the script, paste it"


def docs_commands() -> list[tuple[str, list[str]]]:
    """(script, arguments) of every ``python benchmarks/NAME.py ...`` command the docs show."""
    found = []
    for page in [REPO / "README.md", *DOCS.glob("*.md")]:
        for m in re.finditer(r"`(?:PYTHONPATH=\S+ )?python benchmarks/(\w+)\.py([^`]*)`", page.read_text()):
            found.append((m.group(1), shlex.split(m.group(2).replace("\n", " "))))
    return found


def test_every_benchmark_command_in_the_docs_runs_as_shown() -> None:
    commands = docs_commands()
    assert len({name for name, _ in commands}) >= 10, commands  # the docs show most of the scripts
    helps: dict[str, str] = {}
    for name, args in commands:
        script = REPO / "benchmarks" / f"{name}.py"
        assert script.exists(), f"the docs show benchmarks/{name}.py, which does not exist"
        if name not in helps:
            done = subprocess.run(
                [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=REPO
            )
            assert done.returncode == 0, f"{name}.py --help: {done.stderr}"
            helps[name] = done.stdout
        for option in (a.split("=")[0] for a in args if a.startswith("--")):
            assert option in helps[name], f"the docs run benchmarks/{name}.py {option}, which it does not take"


# -- the truth ------------------------------------------------------------------------------------


def test_exact_split_shares_each_instant_among_the_requests_in_flight() -> None:
    # 100 W constant: [0, 1) waiting, [1, 2) a alone, [2, 3) a and b, [3, 4) b alone, [4, 5) waiting.
    got, waiting = exact_split.exact_request_energy(lambda a, b: 100.0 * (b - a), [(1, 3), (2, 4)], 0.0, 5.0)
    assert got == pytest.approx([150.0, 150.0]) and waiting == pytest.approx(200.0)
    assert exact_split.quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0  # nearest rank: the 2nd of 4
    assert exact_split.quantile([3.0, 1.0, 2.0, 4.0], 0.95) == 4.0


@settings(max_examples=50, deadline=None)
@given(
    spans=st.lists(
        st.tuples(st.floats(0, 20), st.floats(0, 3)).map(lambda p: (T0 + p[0], T0 + p[0] + p[1])), max_size=12
    ),
    seed=st.integers(0, 3),
)
def test_exact_split_keeps_every_joule_of_the_simulated_board(spans: list[tuple[float, float]], seed: int) -> None:
    fleet = SimulatedFleet(1, seed=seed, clock=lambda: T0 - 10)
    fleet.set_activity(0, "inference", T0)
    got, waiting = exact_split.exact_request_energy(
        lambda a, b: fleet.exact_energy_j(0, a, b), spans, T0 + 1.0, T0 + 19.0
    )
    assert all(e >= 0 for e in got) and waiting >= 0
    assert math.fsum([*got, waiting]) == pytest.approx(fleet.exact_energy_j(0, T0 + 1.0, T0 + 19.0), rel=1e-9)


def test_the_simulators_integral_is_the_integral_of_its_instant_power() -> None:
    """The truth is the simulator's exact integral; check it against a sum of its instant power, which
    is constant on 10 ms slots from the activity's start (a 1 ms midpoint sum is then exact)."""
    fleet = SimulatedFleet(1, seed=4, clock=lambda: T0 - 10)
    fleet.set_activity(0, "inference", T0)
    fine_j = math.fsum(fleet.power_w(0, T0 + (k + 0.5) / 1000) / 1000 for k in range(3000))
    assert fine_j == pytest.approx(fleet.exact_energy_j(0, T0, T0 + 3.0), rel=1e-9)


# -- the scripts ----------------------------------------------------------------------------------


def test_markdown_table_pads_and_aligns() -> None:
    text = mdtable.table(("a", "b"), [["x", "1"], ["yy", "22"]])
    assert text.splitlines() == ["| a   |   b |", "|-----|----:|", "| x   |   1 |", "| yy  |  22 |"]
    assert mdtable.command("x.py", ["--n", "a b"]) == "`python benchmarks/x.py --n 'a b'`"


def test_query_energy_accuracy_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--part", "accuracy", "--seeds", "1", "--duration", "15", "--intervals", "1", "0.1"]
    assert query_energy.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "`python benchmarks/query_energy.py " + " ".join(argv) + "`"
    assert "computed without wattwatch" in " ".join(out.split())  # the caption says what it is against
    (table,) = tables(out)
    check_table(table, query_energy.ACCURACY_HEADER, 2)
    assert_docs_show(tuple(table[0]))
    one_s, fine = (figures(row[1:]) for row in table[1:])
    assert abs(fine[2]) < abs(one_s[2])  # shorter intervals: closer per query (the median error)
    assert all(abs(x) < 50 for x in fine[:4])  # percent: the figures are errors, not raw joules


def test_query_energy_cost_prints_its_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert query_energy.main(["--part", "cost", "--backlog", "10", "--passes", "1", "--sqlite-only"]) == 0
    pure, db = tables(capsys.readouterr().out)
    check_table(pure, ("intervals", "10k spans"), 2)
    check_table(db, ("database", "spans", "ingest", "backlog pass", "per 10k spans", "pass every 10 s"), 1)
    assert_docs_show(tuple(pure[0]))
    assert_docs_show(tuple(db[0]))


def test_ingest_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert ingest.main(["--batches", "2", "--intervals", "100", "--sqlite-only"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("`python benchmarks/ingest.py --batches 2 --intervals 100 --sqlite-only`")
    (table,) = tables(out)
    check_table(table, ("database", "decode/s", "ingest/s", "baseline/s", "ingest ÷ baseline", "report"), 1)
    assert_docs_show(tuple(table[0]))


@pytest.mark.slow
def test_query_energy_live_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert query_energy_live.main(["--seconds", "3", "--fine-intervals", "0.1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("`python benchmarks/query_energy_live.py --seconds 3 --fine-intervals 0.1`")
    assert "computed without wattwatch" in " ".join(out.split())
    (table,) = tables(out)
    header = ("intervals", "queries", "p50 J/query", "p95 J/query", "per-query error, median")
    check_table(table, (*header, "per-query error, p95", "sum"), 1)
    assert_docs_show(tuple(table[0]))
    assert table[1][0] == "fine tick 0.1 s" and int(table[1][1]) > 0


def test_ingest_cpu_prints_cpu_per_interval_through_the_real_route(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/ingest_cpu.py: every batch goes through the app's ingest route and is stored (the run
    asserts each answer is a 200); the table holds a finite CPU figure per run."""
    import ingest_cpu

    assert ingest_cpu.main(["--batches", "16", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "`python benchmarks/ingest_cpu.py --batches 16 --repeat 1`"
    (found,) = tables(out)
    row = dict(zip(found[0], found[1], strict=True))
    assert row["intervals"] == str(16 * 300) and int(row["groups"]) >= 1
    assert 0 < float(row["CPU µs/interval"]) < 10_000
