"""``wattwatch spool list|show|requeue``: the batches the collector refused for good (``agent.poison``).

The agent keeps them in its spool file (``$WATTWATCH_HOME/spool.db``) with the reason; these commands
read that file, and ``requeue`` moves batches back into the queue, where the running agent (or the next
one to start) pushes them again. Safe while the agent runs: each move is one SQLite transaction.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from wattwatch.cli import options
from wattwatch.config import Settings
from wattwatch.errors import ConfigError

EPILOG = """examples:
  wattwatch spool list                     set-aside batches: seq, when, the collector's answer
  wattwatch spool show 7 | jq .            batch 7 as it was sent (JSON)
  wattwatch spool requeue 7                retry batch 7 (after fixing the cause, e.g. upgrading the collector)
  wattwatch spool requeue --all            retry every set-aside batch
  wattwatch --home /var/lib/wattwatch spool list     another agent home (default $WATTWATCH_HOME)

A batch is set aside when the collector refuses it with a 4xx about the batch itself (e.g. 422: a field out
of bounds), or answers 5xx / not at all WATTWATCH_POISON_AFTER times (default 5) while later batches land.
It stays in the spool file until requeued; `wattwatch doctor` shows how many there are and why."""


def add_parser(sub: Any) -> None:
    """Add ``spool`` and its actions to the command parsers ``sub``."""
    sp = options.add_command(sub, "spool", help="batches the collector refused: list, show, requeue", epilog=EPILOG)
    actions = options.add_actions(sp, "spool_command")
    listing = options.add_command(
        actions,
        "list",
        help="set-aside batches, latest first, with the reason",
        epilog="examples:\n  wattwatch spool list\n  wattwatch spool list --format json",
    )
    listing.add_argument("--format", choices=("table", "json"), default="table")
    show = options.add_command(
        actions,
        "show",
        help="print a set-aside batch's body (JSON)",
        epilog="examples:\n  wattwatch spool show 7 | jq '.intervals | length'",
    )
    show.add_argument("seq", type=int, metavar="SEQ", help="the batch's seq, as `wattwatch spool list` shows")
    requeue = options.add_command(
        actions,
        "requeue",
        help="put set-aside batches back in the queue, to be pushed again",
        epilog="examples:\n  wattwatch spool requeue 7 12\n  wattwatch spool requeue --all",
    )
    requeue.add_argument("seqs", type=int, nargs="*", metavar="SEQ", help="the batches to retry")
    requeue.add_argument("--all", action="store_true", help="retry every set-aside batch")


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Do the ``spool`` action; errors are ConfigError (one line, exit 2)."""
    from wattwatch.agent.spool import SPOOL_FILE, Spool

    if args.spool_command is None:
        raise ConfigError("say what to do, e.g. `wattwatch spool list` (see `wattwatch spool --help`)")
    path = settings.home / SPOOL_FILE
    if not path.is_file():
        raise ConfigError(f"no agent spool at {path}; pass the agent's home with --home (or WATTWATCH_HOME)")
    if args.spool_command == "requeue" and args.all == bool(args.seqs):
        raise ConfigError("name the batches to retry (`wattwatch spool requeue 7 12`) or say --all, not both")
    spool = Spool(path)
    try:
        if args.spool_command == "list":
            print(render(spool.set_aside_batches(), args.format, path))
            return 0
        if args.spool_command == "show":
            body = spool.set_aside_body(args.seq)
            if body is None:
                raise ConfigError(f"no set-aside batch {args.seq} in {path}; see `wattwatch spool list`")
            sys.stdout.write(body.decode("utf-8", "replace") + "\n")
            return 0
        moved = spool.requeue(None if args.all else args.seqs)
        missing = ", ".join(str(seq) for seq in sorted(set(args.seqs) - set(moved)))
        if missing and not moved:
            raise ConfigError(f"no set-aside batch {missing} in {path}; see `wattwatch spool list`")
        if missing:
            sys.stderr.write(f"wattwatch spool: not set aside, left alone: {missing}\n")
        print(f"wattwatch spool: {len(moved)} batch(es) back in the queue of {path}; the agent pushes them next")
        return 0
    finally:
        spool.close()


def render(batches: list[Any], fmt: str, path: Path) -> str:
    """``spool list``'s output: a table, or JSON (seq, size, and the stored reason)."""
    from wattwatch.agent.poison import describe

    if fmt == "json":
        return json.dumps([{"seq": b.seq, "size_bytes": b.size_bytes, **b.reason} for b in batches], indent=2)
    if not batches:
        return f"no set-aside batches in {path}"
    lines = [f"{len(batches)} set-aside batch(es) in {path}, latest first:", f"{'SEQ':>8}  {'SET ASIDE (UTC)':20}  WHY"]
    for b in batches:
        when = datetime.fromtimestamp(b.at_s, UTC).strftime("%Y-%m-%d %H:%M:%S") if b.at_s else "unknown"
        lines.append(f"{b.seq:>8}  {when:20}  {b.reason.get('reason', '?')}: {describe(b.reason)}")
    lines.append("retry with `wattwatch spool requeue SEQ ...` or `--all` once the cause is fixed")
    return "\n".join(lines)
