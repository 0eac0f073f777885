"""The schema check reads revisions without Alembic (``storage.migrate``); Alembic must agree with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine


def test_head_and_known_revisions_are_alembics() -> None:
    script = ScriptDirectory.from_config(migrate.alembic_config())
    assert migrate.head_revision() == script.get_current_head()
    assert migrate.known_revisions() == frozenset(s.revision for s in script.walk_revisions())


def test_current_revision_is_alembics_before_and_after_upgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    engine = make_engine(url, create=True)
    try:
        with engine.connect() as conn:
            assert migrate.current_revision_of(conn) is None
            assert MigrationContext.configure(conn).get_current_revision() is None
        migrate.upgrade(url)
        with engine.connect() as conn:
            assert migrate.current_revision_of(conn) == migrate.head_revision()
            assert MigrationContext.configure(conn).get_current_revision() == migrate.head_revision()
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_current_revision_is_alembics_on_postgres(pg_url: str) -> None:
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            assert migrate.current_revision_of(conn) == MigrationContext.configure(conn).get_current_revision()
            assert migrate.current_revision_of(conn) == migrate.head_revision()
    finally:
        engine.dispose()


def test_checking_the_schema_does_not_import_alembic() -> None:
    code = (
        "import sys, tempfile, os\n"
        "from wattwatch.storage import migrate\n"
        "from wattwatch.storage.engine import make_engine, check_schema\n"
        "d = tempfile.mkdtemp(); url = f'sqlite:///{d}/x.db'\n"
        "migrate.upgrade(url)\n"
        "for m in [m for m in sys.modules if m.startswith('alembic')]: del sys.modules[m]\n"
        "check_schema(make_engine(url), url)\n"
        "assert not any(m.startswith('alembic') for m in sys.modules), 'alembic imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
