"""Shared fixtures: real SQLite and PostgreSQL databases, migrated, one fresh state per test.

PostgreSQL comes from ``WATTWATCH_TEST_PG_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``).
The session creates its own database next to that one and drops it at the end, so parallel sessions
never share tables. Unreachable PostgreSQL skips its tests, unless ``WATTWATCH_REQUIRE_SERVICES=1``
(CI sets it), which makes that a failure: a green CI run must have exercised PostgreSQL.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine, normalize_url
from wattwatch.storage.tables import DATA_TABLES

PG_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


def require_services() -> bool:
    """True when a missing service (PostgreSQL, promtool) must fail the run instead of skipping."""
    return os.environ.get("WATTWATCH_REQUIRE_SERVICES") == "1"


def unavailable(reason: str) -> NoReturn:
    """Skip, or fail when the environment promised the service is there."""
    if require_services():
        pytest.fail(f"{reason} (WATTWATCH_REQUIRE_SERVICES=1, so this is a failure, not a skip)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Migrating once and copying the file is ~50x faster than running Alembic for every test.
    path = tmp_path_factory.mktemp("sqlite-template") / "wattwatch.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path, _sqlite_template: Path) -> str:
    """A migrated, empty SQLite database in this test's temporary directory."""
    path = tmp_path / "wattwatch.db"
    shutil.copyfile(_sqlite_template, path)
    return f"sqlite:///{path}"


def _admin_engine(url: str) -> Engine:
    return create_engine(normalize_url(url), isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})


@pytest.fixture(scope="session")
def _pg_database() -> Iterator[str]:
    base_url = os.environ.get("WATTWATCH_TEST_PG_URL", PG_DEFAULT_URL)
    admin = _admin_engine(base_url)
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # any failure to connect means "no PostgreSQL here"
        admin.dispose()
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        unavailable(f"PostgreSQL not reachable at {make_url(base_url).render_as_string()}: {first_line}")
    name = f"wattwatch_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(base_url).set(database=name).render_as_string(hide_password=False)
    try:
        migrate.upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            # FORCE: an engine a failed test left open must not keep the database alive.
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _emptied(pg_database: str) -> str:
    """``pg_database`` migrated, with every table emptied."""
    if migrate.current_revision(pg_database) != migrate.head_revision():
        migrate.upgrade(pg_database)  # a test before this one dropped the schema
    engine = make_engine(pg_database)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {', '.join(DATA_TABLES)} RESTART IDENTITY CASCADE"))
    finally:
        engine.dispose()
    return pg_database


@pytest.fixture
def pg_url(_pg_database: str) -> str:
    """A migrated PostgreSQL database with every table emptied for this test."""
    return _emptied(_pg_database)


@pytest.fixture
def pg_blank_url(_pg_database: str) -> str:
    """The session's PostgreSQL database with no tables at all (never migrated)."""
    engine = make_engine(_pg_database)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
    finally:
        engine.dispose()
    return _pg_database


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test that takes it runs on SQLite and on PostgreSQL."""
    return str(request.getfixturevalue(f"{'pg' if request.param == 'postgres' else 'sqlite'}_url"))


@pytest.fixture
def db_engine(db_url: str) -> Iterator[Engine]:
    """An engine on ``db_url``, disposed after the test."""
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def module_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _sqlite_template: Path
) -> str:
    """A migrated, empty database that one module's tests share (filled once, read by each), on SQLite and
    on PostgreSQL. Modules run one after another, so no other test empties it meanwhile."""
    if request.param == "postgres":
        return _emptied(str(request.getfixturevalue("_pg_database")))
    path = tmp_path_factory.mktemp("module-db") / "wattwatch.db"
    shutil.copyfile(_sqlite_template, path)
    return f"sqlite:///{path}"
