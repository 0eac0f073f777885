"""Alembic migrations, configured from Python; ``upgrade(url)`` is what ``wattwatch db upgrade`` and
``wattwatch up`` call.

Where the migrations live, and the revision bookkeeping that needs no Alembic, is ``storage.revisions``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wattwatch.storage.engine import WRITE_TX, make_engine, sqlite_path
from wattwatch.storage.revisions import MIGRATIONS_DIR, current_revision_of, head_revision, known_revisions

if TYPE_CHECKING:
    from alembic.config import Config

# What ``wattwatch db upgrade`` and the tests read beside ``upgrade``; defined in ``storage.revisions``.
__all__ = [
    "MIGRATIONS_DIR",
    "alembic_config",
    "current_revision",
    "current_revision_of",
    "head_revision",
    "known_revisions",
    "upgrade",
]


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
