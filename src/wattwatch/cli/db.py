"""``wattwatch db upgrade``: create or migrate the database schema."""

from __future__ import annotations

import argparse
from typing import Any

from wattwatch.cli import options
from wattwatch.cli.errors import UsageError
from wattwatch.config import Settings


def add_parser(sub: Any) -> None:
    """Add ``db`` and its actions to the command parsers ``sub``."""
    db = options.add_command(
        sub,
        "db",
        help="database maintenance",
        epilog="example:\n  wattwatch db upgrade --db postgresql://wattwatch@db/wattwatch",
    )
    actions = options.add_actions(db, "db_command")
    upgrade = options.add_command(
        actions,
        "upgrade",
        help="create or migrate the schema to this version",
        epilog="example:\n  wattwatch db upgrade --db sqlite:///w.db",
    )
    options.add_db(upgrade)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Do the action; print what was done."""
    if args.db_command != "upgrade":
        raise UsageError("say what to do with the database, e.g. `wattwatch db upgrade`")
    if not settings.db_url:
        settings.home.mkdir(parents=True, exist_ok=True)
    print(f"wattwatch db: {upgrade_db(settings.resolved_db_url)}")
    return 0


def upgrade_db(url: str) -> str:
    """Migrate the database at ``url``; what was done, in words: created, upgraded, or already current."""
    from wattwatch.storage.engine import display_url
    from wattwatch.storage.migrate import current_revision, head_revision, upgrade

    shown = display_url(url)
    before = current_revision(url)
    upgrade(url)
    head = head_revision()
    if before is None:
        return f"created the schema (revision {head}) in {shown}"
    if before == head:
        return f"{shown} was already at the current schema (revision {head}); nothing to do"
    return f"upgraded {shown} from revision {before} to {head}"
