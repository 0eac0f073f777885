"""Wall time of ``wattwatch report`` as a user runs it (a new process each time) on an empty database, beside
``python -c pass`` measured in the same run, and where the start-up goes (``python -X importtime``).

Each figure is the median of ``--repeat`` runs after one warm-up run (files in the page cache, bytecode
cached in ``__pycache__`` as an installed package has it, even where PYTHONDONTWRITEBYTECODE is set):
``wattwatch report --db URL`` on an empty, migrated SQLite file, ``wattwatch report --server`` against a
collector serving that file, and ``wattwatch report --db URL`` on an empty, migrated scratch
PostgreSQL database (WATTWATCH_TEST_PG_URL, default postgresql://postgres@127.0.0.1:5432/test; created and
dropped). The target is 200 ms; the ratio to ``python -c pass`` says how much of it is wattwatch's own,
whatever the machine's speed. Then the imports of one ``report`` run, by top-level module, largest first.

With ``--fill 10000000`` it also fills a scratch PostgreSQL database as ``report_scale.py`` does (10M raw
intervals, 20,000 jobs over 30 days, 64 hosts of 8 GPUs and a CPU) and times ``wattwatch report`` on it as
a user types it, straight from the database and through a collector serving it: the target's figure. The
filled database is left as one in service is (VACUUM ANALYZE, as autovacuum does after a bulk load; the
collector keeps 31 days, so its prune pass is not deleting the 30-day fill while reports are timed).

Run: ``python benchmarks/report_startup.py`` (``--repeat 15``; ``--sqlite-only`` skips PostgreSQL), or
``python benchmarks/report_startup.py --fill 10000000`` (about two minutes more). The reads alone, in
process, are ``report_scale.py``'s.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ingest import on_pg_scratch
from load import start_collector
from mdtable import command, paragraph, table

TARGET_MS = 200.0
WATTWATCH = [sys.executable, "-m", "wattwatch.cli.main"]


def median_ms(argv: Sequence[str], env: dict[str, str], repeat: int) -> float:
    """Median wall time of running ``argv`` to completion, in milliseconds, after one warm-up run."""
    times = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        out = subprocess.run(argv, env=env, capture_output=True, timeout=120, check=False)
        if i:
            times.append(time.perf_counter() - t0)
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed: {out.stderr.decode(errors='replace')[-500:]}")
    return statistics.median(times) * 1e3


def import_breakdown(argv: Sequence[str], env: dict[str, str], top: int) -> list[tuple[str, float, float]]:
    """``(module, cumulative ms, self ms)`` of the top-level imports of one run of ``argv``, largest first
    (``-X importtime``: nested imports count in their parent's cumulative time)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *argv[1:]], env=env, capture_output=True, text=True, timeout=120
    )
    rows = []
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m and not m[3]:  # nesting shows as indentation: top level has none
            rows.append((m[4], int(m[2]) / 1e3, int(m[1]) / 1e3))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, then print the command and the tables."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=15, help="runs per figure (median; default 15)")
    p.add_argument("--top", type=int, default=12, help="top-level imports to list (default 12)")
    p.add_argument("--sqlite-only", action="store_true", help="skip PostgreSQL")
    p.add_argument(
        "--db",
        default="",
        help="also a filled database (e.g. one report_scale.fill wrote): report --db on it, and --server "
        "through a collector on it",
    )
    p.add_argument(
        "--fill",
        type=int,
        default=0,
        metavar="INTERVALS",
        help="also fill a scratch PostgreSQL database as report_scale.py does (INTERVALS raw intervals, "
        "--jobs jobs over 30 days, --hosts hosts) and time report --db and --server on it; the target's "
        "figure is --fill 10000000",
    )
    p.add_argument("--jobs", type=int, default=20_000, help="jobs for --fill (default 20,000)")
    p.add_argument("--hosts", type=int, default=64, help="hosts of 8 GPUs and a CPU for --fill (default 64)")
    p.add_argument(
        "--limit",
        type=int,
        default=0,
        help="jobs per page on the filled database (default: none given, the page `wattwatch report` shows)",
    )
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.fill and args.sqlite_only:
        p.error("--fill fills a PostgreSQL database; drop --sqlite-only")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "WATTWATCH_HOME": str(Path(tmp) / "home")}
        env.pop("WATTWATCH_TOKEN", None)
        # As installed: compiled modules cached (the warm-up run writes them where a checkout lacks them).
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        sqlite_url = f"sqlite:///{tmp}/empty.db"
        subprocess.run([*WATTWATCH, "db", "upgrade", "--db", sqlite_url], env=env, check=True, capture_output=True)
        python_ms = median_ms([sys.executable, "-c", "pass"], env, args.repeat)
        help_ms = median_ms([*WATTWATCH, "--help"], env, args.repeat)
        rows = [("`python -c pass`", python_ms), ("`wattwatch --help`", help_ms)]
        report = [*WATTWATCH, "report", "--db", sqlite_url]
        rows.append(("`wattwatch report`, empty SQLite", median_ms(report, env, args.repeat)))
        # Through a running collector (on the same file): the client needs no database driver at all.
        collector, port = start_collector(sqlite_url, 1, Path(tmp))
        try:
            served = [*WATTWATCH, "report", "--server", f"http://127.0.0.1:{port}"]
            rows.append(("`wattwatch report --server`, a collector on it", median_ms(served, env, args.repeat)))
        finally:
            collector.terminate()
            collector.wait(timeout=30)
        note = ""
        if not args.sqlite_only:
            base = os.environ.get("WATTWATCH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")

            def on_pg(url: str) -> float:
                subprocess.run([*WATTWATCH, "db", "upgrade", "--db", url], env=env, check=True, capture_output=True)
                return median_ms([*WATTWATCH, "report", "--db", url], env, args.repeat)

            pg_ms, note = on_pg_scratch(base, on_pg)
            if pg_ms is not None:
                rows.append(("`wattwatch report`, empty PostgreSQL", pg_ms))
        if args.db:
            rows += filled(args.db, args, env, Path(tmp), "the filled database")
        if args.fill:
            base = os.environ.get("WATTWATCH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
            what = f"{args.fill:,} intervals, {args.jobs:,} jobs, PostgreSQL"
            found, fill_note = on_pg_scratch(base, lambda url: filled(url, args, env, Path(tmp), what, fill=True))
            rows += found or []
            note = " ".join(n for n in (note, fill_note) if n)
        imports = import_breakdown(report, env, args.top)
    print(command("report_startup.py", argv))
    print(
        paragraph(
            f"**Start-up of one command** (a new process per run, median of {args.repeat} after a warm-up; "
            f"target {TARGET_MS:.0f} ms for `wattwatch report`; the ratio is to `python -c pass` in the same "
            f"run, so it holds on a slower or busier machine){' ' + note if note else ''}:"
        )
    )
    print(
        table(
            ("what", "wall time", "x python -c pass", "within 200 ms"),
            [
                [what, f"{ms:.0f} ms", f"{ms / python_ms:.1f}", "" if "python" in what else _yes(ms)]
                for what, ms in rows
            ],
        )
    )
    print(paragraph("**Imports of `wattwatch report` (empty SQLite)**, by top-level module (`python -X importtime`):"))
    print(
        table(
            ("module", "cumulative", "itself"),
            [[f"`{name}`", f"{cum:.1f} ms", f"{own:.1f} ms"] for name, cum, own in imports],
        )
    )
    return 0


def filled(
    url: str, args: argparse.Namespace, env: dict[str, str], tmp: Path, what: str, *, fill: bool = False
) -> list[tuple[str, float]]:
    """``wattwatch report`` straight from the database at ``url`` and through a collector serving it, as a
    user types it (``--limit`` only if given); with ``fill``, first migrate and fill it as report_scale does."""
    if fill:
        from report_scale import fill as fill_history

        from wattwatch.storage import migrate
        from wattwatch.storage.engine import make_engine
        from wattwatch.storage.retention import fold_idle_days

        migrate.upgrade(url)
        engine = make_engine(url)
        now_s = time.time()
        fill_history(engine, intervals=args.fill, jobs=args.jobs, hosts=args.hosts, days=30.0, now_s=now_s)
        fold_idle_days(engine, now_s=now_s)  # as the collector's prune pass leaves it
        engine.dispose()
        # A database in service has its statistics (autovacuum analyzes what a bulk load just wrote).
        from sqlalchemy import create_engine, text

        admin = create_engine(url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text("VACUUM ANALYZE"))
        admin.dispose()
    page = ["--limit", str(args.limit)] if args.limit else []
    shown = f"{args.limit} jobs a page" if args.limit else "the default page"
    out = [
        (
            f"`wattwatch report --db`, {what} ({shown})",
            median_ms([*WATTWATCH, "report", "--db", url, *page], env, args.repeat),
        )
    ]
    # The fill spans 30 days: a collector keeping 31 leaves it as it is (its prune pass would otherwise be
    # deleting half of it while the reports are timed, which no steady state does).
    collector, port = start_collector(url, 1, tmp, ["--retention-days", "31"] if fill else [])
    try:
        served = [*WATTWATCH, "report", "--server", f"http://127.0.0.1:{port}", *page]
        out.append((f"`wattwatch report --server`, a collector on it ({shown})", median_ms(served, env, args.repeat)))
    finally:
        collector.terminate()
        collector.wait(timeout=30)
    return out


def _yes(ms: float) -> str:
    return "yes" if ms <= TARGET_MS else f"no (+{ms - TARGET_MS:.0f} ms)"


if __name__ == "__main__":
    raise SystemExit(main())
