"""Review findings (review10): write-path regressions on PostgreSQL and in decoding."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from test_raw_batches import two_hosts
from test_storage import T0
from wattwatch.collector.group_commit import GroupCommitter
from wattwatch.storage.dialect import pipelined
from wattwatch.storage.group_ingest import IngestResult, Pending

pytestmark = pytest.mark.postgres

# Fails the first statement that adds span marks with a deadlock's SQLSTATE, after a pause so that the
# error reaches the client only when the pipeline syncs (as a real deadlock does: detected after
# deadlock_timeout, 1 s by default).
_DEADLOCK_ONCE = """
CREATE SEQUENCE review10_fired;
CREATE FUNCTION review10_deadlock() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  -- A sequence is not rolled back: the retry of the group passes.
  IF nextval('review10_fired') = 1 THEN
    PERFORM pg_sleep(0.3);
    RAISE EXCEPTION 'deadlock detected (simulated)' USING ERRCODE = '40P01';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER review10_deadlock BEFORE INSERT ON span_dirty FOR EACH STATEMENT
  EXECUTE FUNCTION review10_deadlock();
"""


@pytest.fixture
def pg_engine(pg_url: str) -> Engine:
    engine = create_engine(pg_url)
    yield engine
    with engine.begin() as conn:
        conn.execute(text("DROP TRIGGER IF EXISTS review10_deadlock ON span_dirty"))
        conn.execute(text("DROP FUNCTION IF EXISTS review10_deadlock()"))
        conn.execute(text("DROP SEQUENCE IF EXISTS review10_fired"))
    engine.dispose()


def test_an_error_at_the_pipelines_end_is_a_sqlalchemy_error(pg_engine: Engine) -> None:
    """The collector maps SQLAlchemy errors to 503 and retries DBAPIErrors with a deadlock's SQLSTATE;
    an error reported when the pipeline syncs must reach them as one, not as a bare driver error."""
    with pytest.raises(DBAPIError) as info, pg_engine.connect() as conn, conn.begin(), pipelined(conn):
        conn.execute(text("DO $$ BEGIN PERFORM pg_sleep(0.3); RAISE EXCEPTION 'late' USING ERRCODE = '40P01'; END $$"))
    assert getattr(info.value.orig, "sqlstate", None) == "40P01"


def test_a_deadlock_in_the_pipeline_retries_the_group(pg_engine: Engine) -> None:
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(_DEADLOCK_ONCE)
    batch = next(b for b in two_hosts(random.Random(11)) if any(iv.shares for iv in b.intervals))
    committer = GroupCommitter(pg_engine, writers=1)
    (outcome,) = committer.store_group([Pending(batch, T0 + 100)])
    assert isinstance(outcome, IngestResult), outcome
    with pg_engine.connect() as conn:
        assert conn.execute(text("SELECT last_value FROM review10_fired")).scalar() == 2
