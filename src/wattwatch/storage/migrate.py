"""Alembic migrations, configured from Python; ``upgrade(url)`` is what ``wattwatch db upgrade`` and
``wattwatch up`` call.

The migrations live in the repository's top-level ``alembic/`` folder (so ``alembic upgrade head`` works
from a checkout, with the ``alembic.ini`` beside it). A wheel carries the same files as
``wattwatch/storage/migrations`` (pyproject maps the folder into the package at build time); a checkout or
an editable install finds them at the top level.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

from wattwatch.storage.engine import WRITE_TX, make_engine, sqlite_path


def _migrations_dir() -> Path:
    """Where the migrations are: inside the installed package, else in the checkout's ``alembic/``."""
    packaged = Path(__file__).with_name("migrations")
    if (packaged / "env.py").is_file():
        return packaged
    return Path(__file__).resolve().parents[3] / "alembic"


MIGRATIONS_DIR = _migrations_dir()


def alembic_config() -> Config:
    """An Alembic Config pointing at the packaged migrations; for developers' ``command.revision`` too."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` to ``revision`` (default: newest), creating a SQLite file if needed."""
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
    """The revision of the database behind an open connection; None when never migrated."""
    return MigrationContext.configure(conn).get_current_revision()


@cache
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The newest revision this wattwatch ships."""
    head = _script().get_current_head()
    if head is None:  # only if the package lost its versions/ directory
        raise RuntimeError(f"no migrations found under {MIGRATIONS_DIR}; the installation is broken")
    return head


def known_revisions() -> frozenset[str]:
    """Every revision this wattwatch ships."""
    return frozenset(s.revision for s in _script().walk_revisions())
