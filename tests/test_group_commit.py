"""Group commit (collector.group_commit, storage.group_ingest) on SQLite and PostgreSQL: batches stored
together stay all-or-nothing and idempotent one by one.

The expected rows and joules are computed here from the batches the test builds; the database is read
with plain SQL.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from wattwatch.collector.app import create_app
from wattwatch.collector.group_commit import GroupCommitter
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.storage.group_ingest import IngestResult, Pending
from wattwatch.storage.idempotency import AgentIdTaken, KeyReused

NOW_S = time.time()
DEVICES = [wire.Device(key=f"gpu{i}", kind="gpu", index=i) for i in range(2)] + [wire.Device(key="cpu0", kind="cpu")]


def batch(host: str, seq: int, *, energy_j: float = 100.0, ticks: int = 5, agent_id: str | None = None) -> wire.Batch:
    """``ticks`` seconds of every device of ``host``; GPUs held by the host's job, the CPU partly idle."""
    t0 = NOW_S - 3600 + seq * ticks
    intervals = [
        wire.Interval(
            device=d.key,
            t_start_s=t0 + k,
            t_end_s=t0 + k + 1,
            energy_j=energy_j,
            source="counter",
            shares={f"{host}-job": 1.0},
            idle_weight=1.0 if d.kind == "cpu" else 0.0,
        )
        for k in range(ticks)
        for d in DEVICES
    ]
    return wire.Batch(
        agent_id=agent_id or f"{host}-agent",
        seq=seq,
        host=host,
        sent_at_s=t0 + ticks,
        devices=DEVICES,
        intervals=intervals,
    )


def joules(b: wire.Batch) -> float:
    """What a batch carries, summed here (the truth)."""
    return sum(iv.energy_j for iv in b.intervals)


def stored(engine: Engine) -> dict[str, Any]:
    """Raw rows, batch keys and rolled-up joules (jobs + idle), read with plain SQL."""
    with engine.connect() as conn:
        return {
            "intervals": conn.execute(text("SELECT coalesce(sum(n_intervals), 0) FROM raw_batches")).scalar_one(),
            "raw_j": float(conn.execute(text("SELECT coalesce(sum(energy_j), 0) FROM raw_batches")).scalar_one()),
            "keys": {tuple(r) for r in conn.execute(text("SELECT agent_id, seq FROM ingested_batches"))},
            "rolled_j": float(
                conn.execute(text("SELECT coalesce(sum(energy_j), 0) FROM job_device_energy")).scalar_one()
                + conn.execute(text("SELECT coalesce(sum(energy_j), 0) FROM idle_energy")).scalar_one()
            ),
            "hosts": {r[0] for r in conn.execute(text("SELECT name FROM hosts"))},
        }


def test_one_group_stores_every_batch_and_refuses_the_bad_alone(db_engine: Engine) -> None:
    """Four new batches, a retry of one of them, a reused key and a cloned agent id: one transaction stores
    the four once; the reused key and the clone are refused alone."""
    committer = GroupCommitter(db_engine)
    good = [batch(f"host-{i}", 0) for i in range(4)]
    retry = Pending(good[1], NOW_S)
    reused = batch("host-2", 0, energy_j=999.0)  # same key as good[2], other content
    clone = batch("host-9", 0, agent_id="host-0-agent")  # host-0's agent id, from another host
    outcomes = committer.store_group(
        [Pending(b, NOW_S) for b in good] + [retry, Pending(reused, NOW_S), Pending(clone, NOW_S)]
    )

    assert outcomes[:4] == [IngestResult(duplicate=False, n_intervals=len(b.intervals)) for b in good]
    assert outcomes[4] == IngestResult(duplicate=True, n_intervals=0)
    assert isinstance(outcomes[5], KeyReused) and outcomes[5].field == "seq"
    assert isinstance(outcomes[6], AgentIdTaken)
    assert committer.groups == 1  # one transaction for all of them
    s = stored(db_engine)
    assert s["intervals"] == sum(len(b.intervals) for b in good)
    assert s["raw_j"] == pytest.approx(sum(joules(b) for b in good), rel=1e-12)
    assert s["rolled_j"] == pytest.approx(sum(joules(b) for b in good), rel=1e-9)
    assert s["keys"] == {(f"host-{i}-agent", 0) for i in range(4)}
    assert "host-9" not in s["hosts"]  # the refused clone wrote nothing


def _refuse_host(engine: Engine, name: str) -> None:
    """A trigger that makes the database itself refuse ``name``'s host row: a failure inside the group's
    transaction that no check before it could see."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(
                text(
                    "CREATE OR REPLACE FUNCTION refuse_host() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    f"IF NEW.name = '{name}' THEN RAISE EXCEPTION 'host refused by the test'; END IF; "
                    "RETURN NEW; END $$"
                )
            )
            conn.execute(text("DROP TRIGGER IF EXISTS refuse_host ON hosts"))
            conn.execute(
                text("CREATE TRIGGER refuse_host BEFORE INSERT ON hosts FOR EACH ROW EXECUTE FUNCTION refuse_host()")
            )
        else:
            conn.execute(
                text(
                    f"CREATE TRIGGER refuse_host BEFORE INSERT ON hosts WHEN NEW.name = '{name}' "
                    "BEGIN SELECT RAISE(ABORT, 'host refused by the test'); END"
                )
            )


def _drop_refusal(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("DROP TRIGGER IF EXISTS refuse_host" + (" ON hosts" if engine.dialect.name == "postgresql" else ""))
        )


def test_a_group_that_fails_is_stored_again_without_the_failing_batch(db_engine: Engine) -> None:
    """The database fails the group's transaction because of one batch: the others are stored, each
    alone, and only that batch gets the error."""
    _refuse_host(db_engine, "bad-host")
    try:
        committer = GroupCommitter(db_engine)
        good = [batch(f"host-{i}", 0) for i in range(3)]
        items = [Pending(good[0], NOW_S), Pending(batch("bad-host", 0), NOW_S), *(Pending(b, NOW_S) for b in good[1:])]
        outcomes = committer.store_group(items)
    finally:
        _drop_refusal(db_engine)
    assert isinstance(outcomes[1], Exception) and "refused by the test" in str(outcomes[1])
    assert [o for i, o in enumerate(outcomes) if i != 1] == [
        IngestResult(duplicate=False, n_intervals=len(b.intervals)) for b in good
    ]
    s = stored(db_engine)
    assert s["hosts"] == {"host-0", "host-1", "host-2"}
    assert s["intervals"] == sum(len(b.intervals) for b in good)
    assert s["rolled_j"] == pytest.approx(sum(joules(b) for b in good), rel=1e-9)
    # Stored again one by one after the failed group: three transactions.
    assert committer.groups == 3


def test_concurrent_posts_one_bad_one_retried(db_url: str) -> None:
    """Sixteen agents post at once over HTTP, one of them a batch with a bad interval and one a retry of
    another's batch: the bad one alone gets a 422 naming the field, the retry is a duplicate, every good
    batch is stored once."""
    good = [batch(f"host-{i}", seq) for i in range(8) for seq in range(2)]
    bad_body = bytearray(wire.encode(batch("host-bad", 0)))
    bad = bytes(bad_body).replace(b'"energy_j":100.0', b'"energy_j":-5.0', 1)
    app = create_app(Settings(db_url=db_url), span_energy_interval_s=None)
    start = threading.Barrier(18)

    def post(body: bytes) -> tuple[int, dict[str, Any]]:
        start.wait(timeout=30)
        r = client.post("/api/v1/ingest", content=body, headers={"Content-Type": "application/json"})
        return r.status_code, r.json()

    with TestClient(app) as client, ThreadPoolExecutor(18) as pool:
        bodies = [wire.encode(b) for b in good] + [bad, wire.encode(good[3])]
        answers = list(pool.map(post, bodies))
        committer: GroupCommitter = app.state.wattwatch.writer
        groups = committer.groups
    # The retry of good[3] raced its original: whichever came second is the duplicate.
    dupes = [a for a in (answers[3], answers[-1]) if a[1].get("duplicate")]
    assert len(dupes) == 1 and dupes[0][0] == 200
    assert all(status == 200 for status, _ in answers[:16] + answers[17:])
    assert answers[16][0] == 422 and answers[16][1]["field"] == "intervals[0].energy_j"
    assert groups <= 16  # at most one transaction per stored batch; fewer when they were grouped
    engine_url_check = stored_from_url(db_url)
    assert engine_url_check["intervals"] == sum(len(b.intervals) for b in good)
    assert engine_url_check["rolled_j"] == pytest.approx(sum(joules(b) for b in good), rel=1e-9)
    assert engine_url_check["keys"] == {(b.agent_id, b.seq) for b in good}


def stored_from_url(url: str) -> dict[str, Any]:
    """``stored`` on a fresh engine for ``url``."""
    from wattwatch.storage.engine import make_engine

    engine = make_engine(url)
    try:
        return stored(engine)
    finally:
        engine.dispose()
