"""The options ``wattwatch report`` and ``wattwatch jobs`` share: where to read, which jobs, and how to show
them. One definition, so both commands take the same filters and say the same things about them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wattwatch.cli.errors import UsageError
from wattwatch.protocol.units import JOB_KINDS
from wattwatch.reporting.group import SORT_KEYS

FORMATS = ("table", "json", "csv", "markdown")
# Default page sizes. A table is read by a person: a hundred rows is already more than a screen, and a
# page of 1,000 jobs cost 0.3 s to build and 2.5 MB to send on a 20,000-job database (report_startup.py).
# Programs, groups and sorts get the API's page, since they sum or order the page they are given.
PAGE_FOR_PEOPLE = 100
PAGE_FOR_PROGRAMS = 1000


def page_limit(args: argparse.Namespace) -> int:
    """``--limit``, or the default page for ``args``' format and view."""
    if args.limit is not None:
        return int(args.limit)
    people = getattr(args, "format", "table") in ("table", "markdown")
    if people and not getattr(args, "group_by", None) and not getattr(args, "sort", None):
        return PAGE_FOR_PEOPLE
    return PAGE_FOR_PROGRAMS


def add_source(p: argparse.ArgumentParser) -> None:
    """``--server`` or ``--db``."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--server", metavar="URL", help="ask a running collector (default $WATTWATCH_SERVER, if set)")
    src.add_argument(
        "--db", metavar="URL", help="read a database directly (default: $WATTWATCH_DB, else the embedded one)"
    )


def add_filters(p: argparse.ArgumentParser) -> None:
    """``--kind``, ``--since``, ``--until``, ``--host``, ``--name``, ``--label``, ``--limit``, ``--cursor``."""
    p.add_argument("--kind", choices=JOB_KINDS, help="only jobs of this kind")
    p.add_argument(
        "--since",
        metavar="WHEN",
        help="only jobs running or ended after WHEN: a duration back from now (90s, 15m, 12h, 7d) or a date "
        "(2026-11-30, 2026-11-30T08:00Z); idle energy follows, in whole hours (default 7d unless --until or "
        "--job is given)",
    )
    p.add_argument("--until", metavar="WHEN", help="only jobs started before WHEN (as --since)")
    p.add_argument("--host", help="only jobs that ran on this host (and idle energy of this host)")
    p.add_argument("--name", metavar="GLOB", help="only jobs whose name matches this glob, e.g. 'llama-*'")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="K=V",
        help="only jobs with this label (K=V, or K for any value); repeatable, all must hold",
    )
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help=f"at most N jobs a page, oldest first (default {PAGE_FOR_PEOPLE} for a table or markdown, "
        f"{PAGE_FOR_PROGRAMS} for csv, json, --group-by or --sort); the page says how many match in all",
    )
    p.add_argument("--cursor", metavar="CURSOR", help="the next page: the cursor the previous page printed")


def add_view(p: argparse.ArgumentParser, *, group_by: bool = True) -> None:
    """``--format``, ``--sort``, ``--group-by`` (with ``group_by``), ``--output``, ``--width``, ``--no-color``."""
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument(
        "--sort",
        choices=SORT_KEYS,
        help="order of the rows: started (oldest first, the default), name, or largest first by energy, "
        "duration, emissions or cost; applies to the page (--limit) shown",
    )
    if group_by:
        p.add_argument(
            "--group-by",
            metavar="BY",
            help="one row per kind, host or label value (kind, host, label:KEY) with jobs, energy, emissions "
            "and cost summed; a job on several hosts is split by its energy on each",
        )
    p.add_argument("--output", metavar="FILE", help="write to FILE instead of stdout (never coloured)")
    p.add_argument(
        "--width",
        type=int,
        metavar="N",
        help="fit tables to N columns (default: the terminal's; $COLUMNS or 100 when not a terminal; 0: no limit)",
    )
    p.add_argument("--no-color", action="store_true", help="no colour even on a terminal (also NO_COLOR=1)")


def emit(text: str, args: argparse.Namespace, *, what: str = "") -> None:
    """Print ``text``, or write it to ``--output`` (saying so on stderr); an unwritable file is a usage
    error naming it."""
    if not getattr(args, "output", None):
        try:
            print(text, flush=True)
        except BrokenPipeError:
            # A reader that stopped early (`| head`) is not an error; stdout goes nowhere from here on, so
            # the interpreter's own flush at exit does not fail again.
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    path = Path(args.output).expanduser()
    try:
        path.write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(
            f"--output {args.output}: cannot write it ({exc.strerror or exc}); choose another path"
        ) from None
    sys.stderr.write(f"wrote {what or args.format} to {path}\n")


def table_style(args: argparse.Namespace) -> tuple[int | None, bool]:
    """(width, colour) for a table: stdout's, or a file's (no colour; $COLUMNS or 100 wide)."""
    if args.format != "table":
        return None, False  # the other formats neither fit nor colour: not even the import is paid
    from wattwatch.cli.render import table as table_render

    if getattr(args, "output", None):
        return table_render.width_for(None, args.width), False
    return table_render.width_for(sys.stdout, args.width), table_render.wants_color(sys.stdout, no_color=args.no_color)
