"""The write path's error cases: errors a PostgreSQL pipeline reports at its end (retried, answered 503),
no pipeline mode, and a malformed interval device refused as a malformed key."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from test_raw_batches import two_hosts
from test_storage import T0
from wattwatch.collector.group_commit import GroupCommitter
from wattwatch.storage.dialect import pipelined
from wattwatch.storage.engine import make_engine
from wattwatch.storage.group_ingest import IngestResult, Pending

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
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_url)
    yield engine
    with engine.begin() as conn:
        conn.execute(text("DROP TRIGGER IF EXISTS review10_deadlock ON span_dirty"))
        conn.execute(text("DROP FUNCTION IF EXISTS review10_deadlock()"))
        conn.execute(text("DROP SEQUENCE IF EXISTS review10_fired"))
    engine.dispose()


@pytest.mark.postgres
def test_an_error_at_the_pipelines_end_is_a_sqlalchemy_error(pg_engine: Engine) -> None:
    """The collector maps SQLAlchemy errors to 503 and retries DBAPIErrors with a deadlock's SQLSTATE;
    an error reported when the pipeline syncs must reach them as one, not as a bare driver error."""
    with pytest.raises(DBAPIError) as info, pg_engine.connect() as conn, conn.begin(), pipelined(conn):
        conn.execute(text("DO $$ BEGIN PERFORM pg_sleep(0.3); RAISE EXCEPTION 'late' USING ERRCODE = '40P01'; END $$"))
    assert getattr(info.value.orig, "sqlstate", None) == "40P01"


@pytest.mark.postgres
def test_a_deadlock_in_the_pipeline_retries_the_group(pg_engine: Engine) -> None:
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(_DEADLOCK_ONCE)
    batch = next(b for b in two_hosts(random.Random(11)) if any(iv.shares for iv in b.intervals))
    committer = GroupCommitter(pg_engine, writers=1)
    (outcome,) = committer.store_group([Pending(batch, T0 + 100)])
    assert isinstance(outcome, IngestResult), outcome
    with pg_engine.connect() as conn:
        assert conn.execute(text("SELECT last_value FROM review10_fired")).scalar() == 2


def _batch_body(interval_device: str) -> bytes:
    from wattwatch.protocol import wire

    interval = {"device": interval_device, "t_start_s": T0, "t_end_s": T0 + 1, "energy_j": 1.0, "source": "counter"}
    return wire.encode(
        {
            "version": wire.WIRE_VERSION,
            "agent_id": "a1",
            "seq": 1,
            "host": "h",
            "sent_at_s": T0 + 2,
            "devices": [{"key": "gpu0", "kind": "gpu"}],
            "intervals": [interval],
        }
    )


@pytest.mark.parametrize("device", ["gpu 0", "gpü0"])
def test_a_malformed_interval_device_is_refused_as_a_malformed_key(device: str) -> None:
    """As before the key pattern moved into Batch: the reason is a bad string, not an unlisted device."""
    from wattwatch.protocol import wire

    with pytest.raises(wire.WireError) as info:
        wire.decode_batch(_batch_body(device))
    assert info.value.field == "intervals[0].device"
    assert "matching regex" in str(info.value)
    assert info.value.reason == "string"


@pytest.mark.postgres
def test_a_database_error_in_the_pipeline_answers_503(tmp_path: Path, pg_engine: Engine) -> None:
    """Every other database error of an ingest is a 503 saying so; one the pipeline reports at its end too."""
    from test_bounds import NOW, good_batch, post
    from wattwatch.collector import create_app
    from wattwatch.config import Settings

    with pg_engine.begin() as conn:
        conn.exec_driver_sql(_DEADLOCK_ONCE.replace("'40P01'", "'22012'"))  # never retried: a data error
    app = create_app(Settings(home=tmp_path), pg_engine, clock=lambda: NOW, span_energy_interval_s=None)
    with TestClient(app) as client:
        r = post(client, good_batch(1))
    assert r.status_code == 503, r.text
    assert r.json()["field"] is None


@pytest.mark.postgres
def test_groups_are_stored_where_libpq_has_no_pipeline_mode(pg_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg on a system libpq older than 14 has no pipeline mode: a group is then written statement by
    statement, not refused. (libpq's version is the one thing faked here.)"""
    import psycopg

    def has_pipeline(check: bool = False) -> bool:
        if check:
            raise psycopg.NotSupportedError("pipeline mode needs libpq 14 or later (faked)")
        return False

    monkeypatch.setattr(psycopg.capabilities, "has_pipeline", has_pipeline)
    batch = next(b for b in two_hosts(random.Random(11)) if any(iv.shares for iv in b.intervals))
    (outcome,) = GroupCommitter(pg_engine, writers=1).store_group([Pending(batch, T0 + 100)])
    assert isinstance(outcome, IngestResult), outcome
    assert outcome.n_intervals == len(batch.intervals)
