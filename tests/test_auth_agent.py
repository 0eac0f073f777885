"""The agent's side of identity: a cloned spool's pushes refused by the real collector app (SQLite and
PostgreSQL), said loudly at most once a minute, counted, and nothing of the clone stored."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select

from test_storage import T0, WIDE_WINDOW_S, batch, iv, row_counts
from wattwatch.agent.push import Pusher
from wattwatch.agent.spool import Spool
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sim.clock import FakeClock
from wattwatch.storage import tokens
from wattwatch.storage.tables import hosts


def put(spool: Spool, host: str, energy_j: float = 100.0) -> int:
    """Seal one batch of ``host`` into ``spool`` under the spool's agent id, as an agent's outbox does."""
    seq = spool.next_seq()
    agent_id = spool.meta("agent_id")
    assert agent_id is not None
    b = batch(seq, agent_id=agent_id, host=host, intervals=[iv("gpu0", T0 + seq, energy_j, {})])
    spool.put(seq, wire.encode(b), T0)
    return seq


@pytest.fixture
def client(tmp_path: Path, db_engine: Engine) -> Iterator[TestClient]:
    app = create_app(Settings(home=tmp_path, time_window_past_s=WIDE_WINDOW_S), db_engine, span_energy_interval_s=None)
    with TestClient(app) as c:
        yield c


def test_a_cloned_spool_is_refused_loudly_and_nothing_of_it_is_stored(
    tmp_path: Path, db_engine: Engine, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    original = Spool(tmp_path / "h1" / "spool.db")
    original.set_meta("agent_id", "0123abcd")
    put(original, "h1")
    original.close()
    (tmp_path / "h2").mkdir()
    shutil.copyfile(tmp_path / "h1" / "spool.db", tmp_path / "h2" / "spool.db")  # the VM image, copied
    original, clone = Spool(tmp_path / "h1" / "spool.db"), Spool(tmp_path / "h2" / "spool.db")
    clock = FakeClock(0.0)
    first = Pusher(original, "http://testserver", client=client, clock=clock)
    second = Pusher(clone, "http://testserver", client=client, clock=clock)
    assert first.push_pending() is True
    # The clone re-sends the batch it inherited (same content: a harmless duplicate), then its own.
    put(clone, "h2", energy_j=5e6)
    put(clone, "h2")
    before = row_counts(db_engine)
    with caplog.at_level(logging.ERROR, logger="wattwatch.agent.push"):
        assert second.push_pending(force=True) is False
        clock.t_s = 30.0
        assert second.push_pending(force=True) is False
        errors_at_30 = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        clock.t_s = 61.0
        assert second.push_pending(force=True) is False
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors_at_30) == 1 and len(errors) == 2  # once a minute, not once per retry
    assert "cloned spool?" in errors[0] and "agent_id '0123abcd' belongs to host 'h1'" in errors[0]
    assert "spool.db" in errors[0]
    assert second.stats.conflicts == 3 and second.stats.pushed == 1
    assert clone.pending() == 2 and clone.dead() == 0  # kept: nothing the clone measured is thrown away
    assert row_counts(db_engine) == before
    with db_engine.connect() as conn:
        assert conn.execute(select(hosts.c.name)).scalars().all() == ["h1"]
    # The original goes on undisturbed.
    put(original, "h1")
    assert first.push_pending() is True and first.stats.conflicts == 0


def test_a_reused_seq_with_other_content_is_set_aside_loudly(
    tmp_path: Path, db_engine: Engine, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    # Two agents sharing one spool on one host (same host name): the same seq with different content.
    a, b = Spool(tmp_path / "a.db"), Spool(tmp_path / "b.db")
    for spool in (a, b):
        spool.set_meta("agent_id", "shared")
    put(a, "h1", energy_j=100.0)
    seq = put(b, "h1", energy_j=250.0)
    put(b, "h1", energy_j=250.0)
    assert Pusher(a, "http://testserver", client=client).push_pending() is True
    pusher = Pusher(b, "http://testserver", client=client)
    with caplog.at_level(logging.ERROR, logger="wattwatch.agent.push"):
        assert pusher.push_pending() is True  # the conflicting batch is set aside, the next one flows
    assert (b.pending(), b.dead(), pusher.stats.conflicts, pusher.stats.pushed) == (0, 1, 1, 1)
    assert any(f"seq {seq}" in r.getMessage() and "stored before with other content" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    report = client.get("/api/v1/report", params={"since": "2000-01-01"}).json()
    assert sum(d["energy_j"] for d in report["idle"]) == 350.0  # batch 0 from a, batch 1 from b; never b's 0


def test_a_token_for_another_host_is_said_plainly_and_the_batches_wait(tmp_path: Path, db_engine: Engine) -> None:
    _, token = tokens.create_token(db_engine, "agent", "h2")
    spool = Spool(tmp_path / "s.db")
    spool.set_meta("agent_id", "a1")
    put(spool, "h1")
    settings = Settings(home=tmp_path, time_window_past_s=WIDE_WINDOW_S)
    with TestClient(create_app(settings, db_engine, span_energy_interval_s=None)) as client:
        pusher = Pusher(spool, "http://testserver", client=client, token=token)
        assert pusher.push_pending() is False
    assert "HTTP 403: host: this agent token is for host 'h2', not 'h1'" in pusher.stats.last_error
    assert "--host" in pusher.stats.last_error
    assert spool.pending() == 1 and spool.dead() == 0  # a configuration problem: fixing it lets them through
