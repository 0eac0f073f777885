"""Alembic environment: runs on the connection ``wattwatch.storage.migrate`` hands over.

Run from the repository root (``alembic upgrade head``, with the ``alembic.ini`` there) it migrates the
database wattwatch's settings name (``WATTWATCH_DB``, else the embedded SQLite under ``$WATTWATCH_HOME``),
or the one given with ``-x url=...``; it builds its own engine with wattwatch's settings, so SQLite pragmas
and the psycopg driver mapping still apply.
"""

from __future__ import annotations

from alembic import context

from wattwatch.config import load_settings
from wattwatch.storage.engine import WRITE_TX, make_engine
from wattwatch.storage.tables import metadata


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds tables when a revision needs it.
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run migrations on the given connection, or on one made from ``-x url=...``."""
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option("sqlalchemy.url")
    if not url:
        settings = load_settings()
        if not settings.db_url:
            settings.home.mkdir(parents=True, exist_ok=True)
        url = settings.resolved_db_url
    engine = make_engine(url, create=True)
    try:
        with engine.connect().execution_options(**{WRITE_TX: True}) as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run against a database")
run_migrations_online()
