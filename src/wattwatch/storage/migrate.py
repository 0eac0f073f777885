"""Alembic migrations, configured from Python; ``upgrade(url)`` is what ``wattwatch db upgrade`` and
``wattwatch up`` call.

The migrations live in the repository's top-level ``alembic/`` folder (so ``alembic upgrade head`` works
from a checkout, with the ``alembic.ini`` beside it). A wheel carries the same files as
``wattwatch/storage/migrations`` (pyproject maps the folder into the package at build time); a checkout or
an editable install finds them at the top level.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, inspect, text

from wattwatch.storage.engine import WRITE_TX, make_engine, sqlite_path

if TYPE_CHECKING:
    from alembic.config import Config


def _migrations_dir() -> Path:
    """Where the migrations are: inside the installed package, else in the checkout's ``alembic/``."""
    packaged = Path(__file__).with_name("migrations")
    if (packaged / "env.py").is_file():
        return packaged
    return Path(__file__).resolve().parents[3] / "alembic"


MIGRATIONS_DIR = _migrations_dir()


def alembic_config() -> Config:
    """An Alembic Config pointing at the packaged migrations; for developers' ``command.revision`` too."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` to ``revision`` (default: newest), creating a SQLite file if needed."""
    from alembic import command

    engine = make_engine(url, create=True)
    try:
        with engine.connect().execution_options(**{WRITE_TX: True}) as conn:
            cfg = alembic_config()
            # env.py runs on this connection instead of building its own engine from a URL.
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at; None when it was never migrated (or does not exist)."""
    path = sqlite_path(url)
    if path is not None and not path.exists():
        return None  # connecting would create the file: asking must not change anything
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return current_revision_of(conn)
    finally:
        engine.dispose()


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
