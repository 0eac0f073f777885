"""Engines for SQLite (embedded) and PostgreSQL (production), and the readiness check users see.

SQLite gets WAL (readers never block the writer), foreign keys (off by default in SQLite) and a busy
timeout (a second writer waits instead of failing). ``postgresql://`` URLs use psycopg 3.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from wattwatch import redact
from wattwatch.errors import StorageError
from wattwatch.storage.revisions import current_revision_of, head_revision, known_revisions

SQLITE_BUSY_TIMEOUT_MS = 10_000
# Execution option that makes a SQLite transaction take the write lock at BEGIN (see _begin).
WRITE_TX = "wattwatch_write"

log = logging.getLogger(__name__)


def normalize_url(url: str) -> URL:
    """Parse ``url``; map ``postgresql://``/``postgres://`` to psycopg 3. Raises StorageError if malformed."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StorageError(
            f"{url!r} is not a database URL; use e.g. sqlite:///path/wattwatch.db "
            "or postgresql://user@host:5432/wattwatch"
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        # SQLAlchemy would try to import a driver for it and fail with a traceback.
        raise StorageError(
            f"database URL scheme {parsed.drivername.split('+')[0]!r} is not supported; use "
            "sqlite:///path/wattwatch.db or postgresql://user@host:5432/wattwatch"
        )
    return parsed


def display_url(url: str | URL) -> str:
    """The URL as it may appear in logs and error messages: its password and secret parameters masked."""
    return redact.url(url if isinstance(url, str) else url.render_as_string(hide_password=False))


def sqlite_path(url: str | URL) -> Path | None:
    """The file behind a SQLite URL, or None for another backend or an in-memory database."""
    parsed = normalize_url(url) if isinstance(url, str) else url
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database).expanduser()


def make_engine(url: str, *, create: bool = False) -> Engine:
    """An Engine for ``url``. Connects lazily; ``create=True`` makes a SQLite file's parent directory.

    Without ``create``, a SQLite file in a missing directory fails on first use; ``check_ready``
    turns that into a message saying which command creates the database.
    """
    parsed = normalize_url(url)
    if parsed.get_backend_name() != "sqlite":
        # pool_pre_ping: a collector outlives PostgreSQL restarts and failovers.
        return create_engine(parsed, pool_pre_ping=True)
    path = sqlite_path(parsed)
    if path is not None and create:
        path.parent.mkdir(parents=True, exist_ok=True)
    # FastAPI runs sync endpoints on a thread pool, so connections move between threads.
    engine = create_engine(parsed, connect_args={"check_same_thread": False})
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_begin)
    return engine


def _sqlite_on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
    # Take BEGIN out of the sqlite3 module's hands (it starts transactions late and implicitly) and
    # issue it ourselves in _sqlite_begin, so write transactions can lock up front.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys = ON")
    cursor.execute("PRAGMA journal_mode = WAL")
    # In WAL mode NORMAL syncs at checkpoints, not on every commit: an OS crash may lose the last
    # commits (agents re-push unacknowledged batches anyway), a process crash loses nothing.
    cursor.execute("PRAGMA synchronous = NORMAL")
    cursor.close()


def _sqlite_begin(conn: Any) -> None:
    # A deferred transaction that reads first and writes later can fail with SQLITE_BUSY when
    # another writer got in between (busy_timeout cannot help a lock upgrade). Writers therefore
    # take the lock at BEGIN and queue behind each other instead.
    if conn.get_execution_options().get(WRITE_TX):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("BEGIN")


@contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """One write transaction (on SQLite it takes the write lock at BEGIN; see engine._sqlite_begin)."""
    with engine.connect().execution_options(**{WRITE_TX: True}) as conn, conn.begin():
        yield conn


def check_ready(url: str) -> Engine:
    """An Engine for ``url`` after checking the database exists, is reachable and fully migrated.

    Raises StorageError whose one-line message says what to run next.
    """
    path = sqlite_path(url)
    if path is not None and not path.exists():
        raise StorageError(
            f"no wattwatch database at {path}; start `wattwatch up` or run `wattwatch db upgrade --db {url}`"
        )
    engine = make_engine(url)
    try:
        check_schema(engine, url)
    except StorageError:
        engine.dispose()
        raise
    return engine


def check_schema(engine: Engine, url: str | None = None) -> None:
    """Raise StorageError unless ``engine``'s database is reachable and at this wattwatch's revision."""
    shown = display_url(url if url is not None else engine.url)
    try:
        with engine.connect() as conn:
            current = current_revision_of(conn)
    except SQLAlchemyError as exc:
        # The driver's own message ("connection refused", "password authentication failed") says most.
        orig = getattr(exc, "orig", None)
        reason = str(orig if orig is not None else exc).strip().splitlines()
        raise StorageError(
            f"cannot reach database {shown}: {reason[0] if reason else type(exc).__name__}; "
            "check that the server runs and the URL, user and password are right"
        ) from None
    head = head_revision()
    log.debug("database %s is at revision %s (this wattwatch's newest: %s)", shown, current, head)
    if current == head:
        return
    if current is not None and current not in known_revisions():
        raise StorageError(
            f"database {shown} is at revision {current}, newer than this wattwatch knows (its newest is "
            f"{head}); upgrade wattwatch"
        )
    raise StorageError(
        f"database {shown} is at revision {current or 'none'}, this wattwatch needs {head}; "
        f"run `wattwatch db upgrade --db {shown}`"
    )
