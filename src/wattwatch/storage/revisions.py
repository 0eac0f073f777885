"""Which migration revisions this wattwatch ships, and which one a database is at, without Alembic.

Read from the migration files' ``revision`` / ``down_revision`` lines and from the database's
``alembic_version`` table: every command that checks the schema before reading (``wattwatch report``)
would otherwise import Alembic, about 0.2 s of its start-up. ``storage.engine`` checks a database
against these; ``storage.migrate`` runs Alembic to move it.

The migrations live in the repository's top-level ``alembic/`` folder (so ``alembic upgrade head`` works
from a checkout, with the ``alembic.ini`` beside it). A wheel carries the same files as
``wattwatch/storage/migrations`` (pyproject maps the folder into the package at build time); a checkout or
an editable install finds them at the top level.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from sqlalchemy import Connection, inspect, text


def _migrations_dir() -> Path:
    """Where the migrations are: inside the installed package, else in the checkout's ``alembic/``."""
    packaged = Path(__file__).with_name("migrations")
    if (packaged / "env.py").is_file():
        return packaged
    return Path(__file__).resolve().parents[3] / "alembic"


MIGRATIONS_DIR = _migrations_dir()


def current_revision_of(conn: Connection) -> str | None:
    """The revision of the database behind an open connection; None when never migrated.

    Read straight from Alembic's ``alembic_version`` table: every command that checks the schema before
    reading (``wattwatch report``) would otherwise import Alembic, about 0.2 s of its start-up."""
    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


_REVISION = re.compile(r"^revision\s*(?::\s*str\s*)?=\s*[\"']([^\"']+)[\"']", re.MULTILINE)
_DOWN = re.compile(r"^down_revision\s*(?::[^=]+)?=\s*(?:None|[\"']([^\"']+)[\"'])", re.MULTILINE)


@cache
def _revisions() -> dict[str, str | None]:
    """Every shipped revision -> the one it revises, read from the migration files' ``revision`` and
    ``down_revision`` lines (what Alembic reads too; parsed here so checking needs no Alembic import)."""
    out: dict[str, str | None] = {}
    for path in sorted((MIGRATIONS_DIR / "versions").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        rev, down = _REVISION.search(source), _DOWN.search(source)
        if rev is not None and down is not None:
            out[rev.group(1)] = down.group(1)
    return out


def head_revision() -> str:
    """The newest revision this wattwatch ships."""
    revisions = _revisions()
    heads = set(revisions) - {down for down in revisions.values() if down is not None}
    if len(heads) != 1:  # none: the package lost its versions/ directory; several: a branch to merge
        raise RuntimeError(f"expected one newest migration under {MIGRATIONS_DIR}, found {sorted(heads) or 'none'}")
    return heads.pop()


def known_revisions() -> frozenset[str]:
    """Every revision this wattwatch ships."""
    return frozenset(_revisions())
