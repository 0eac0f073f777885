"""``GET /api/v1/live`` (what ``wattwatch top`` draws) on the real app, SQLite and PostgreSQL: each GPU's
power over its latest second, the running job holding it, the job's energy so far; ended jobs are gone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event

from test_collector import post_batch
from test_storage import T0, WIDE_WINDOW_S, batch, iv
from wattwatch.cli.top import render
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sim.clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0 + 20)


@pytest.fixture
def client(tmp_path: Path, db_engine: Engine, clock: FakeClock) -> Iterator[TestClient]:
    settings = Settings(home=tmp_path, time_window_past_s=WIDE_WINDOW_S)
    with TestClient(create_app(settings, db_engine, clock=clock, span_energy_interval_s=None)) as c:
        yield c


def seconds(device: str, start_s: float, n: int, energy_j: float, shares: dict[str, float]) -> list[wire.Interval]:
    return [iv(device, start_s + t, energy_j, shares) for t in range(n)]


def test_live_shows_power_now_the_holder_and_its_energy_so_far(client: TestClient, clock: FakeClock) -> None:
    train = wire.Job(id="train-1", name="llama-ft", kind="training", started_at_s=T0)
    done = wire.Job(id="old-1", name="old", kind="other", started_at_s=T0 - 50, ended_at_s=T0 - 40)
    b = batch(
        1,
        jobs=[train, done],
        intervals=seconds("gpu0", T0, 10, 300.0, {"train-1": 1.0})
        # gpu1 draws 500 W until the last two seconds, then 80 W: power now is the latest second's; its
        # latest intervals name old-1, which has ended: no running job holds gpu1
        + seconds("gpu1", T0, 8, 500.0, {})
        + seconds("gpu1", T0 + 8, 2, 80.0, {"old-1": 1.0})
        + seconds("gpu1", T0 - 50, 10, 200.0, {"old-1": 1.0}),
    )
    assert post_batch(client, b).status_code == 200
    # A batch sealed at a boundary holds a sliver of gpu0 only: the power spans it and the batch before.
    sliver = wire.Interval(
        device="gpu0", t_start_s=T0 + 10, t_end_s=T0 + 10.5, energy_j=150.0, source="counter", shares={"train-1": 1}
    )
    assert post_batch(client, batch(2, intervals=[sliver])).status_code == 200
    live = client.get("/api/v1/live").json()
    (host,) = live["hosts"]
    assert host["host"] == "h1"
    gpus = {d["device"]: d for d in host["devices"] if d["kind"] == "gpu"}
    assert gpus["gpu0"]["power_w"] == pytest.approx(300.0)
    assert gpus["gpu0"]["jobs"] == ["train-1"] and gpus["gpu0"]["power_at_s"] == pytest.approx(T0 + 10.5)
    assert gpus["gpu1"]["power_w"] == pytest.approx(80.0)
    assert gpus["gpu1"]["jobs"] == []
    (job,) = live["jobs"]
    assert job["id"] == "train-1" and job["energy_j"] == pytest.approx(3150.0)
    assert job["gpu_power_w"] == pytest.approx(300.0)
    # What top prints from it.
    frame = render(live, server="http://c")
    assert "h1    gpu0  300 W  train-1 llama-ft (training)  3150 J" in frame, frame
    assert "gpu1  80 W   idle" in frame, frame
    # A minute after the last reading, no power is "now" any more.
    clock.advance(120)
    stale = client.get("/api/v1/live").json()
    assert all(d["power_w"] is None for d in stale["hosts"][0]["devices"])


def test_live_costs_the_same_statements_however_long_the_history(
    client: TestClient, db_engine: Engine, clock: FakeClock
) -> None:
    # O(running jobs + devices): the number of statements does not grow with the stored intervals.
    job = wire.Job(id="serve-1", name="chat", kind="inference", started_at_s=T0)
    post_batch(client, batch(1, jobs=[job], intervals=seconds("gpu0", T0, 5, 300.0, {"serve-1": 1.0})))
    client.get("/api/v1/live")  # a first request may set up the connection (dialect checks)
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    event.listen(db_engine, "before_cursor_execute", count)
    try:
        client.get("/api/v1/live")
        first = len(statements)
        for seq in range(2, 42):  # 40 more batches of 5 s
            start_s = T0 + 5 * (seq - 1)
            post_batch(client, batch(seq, intervals=seconds("gpu0", start_s, 5, 300.0, {"serve-1": 1.0})))
        statements.clear()
        clock.advance(200)
        live = client.get("/api/v1/live").json()
    finally:
        event.remove(db_engine, "before_cursor_execute", count)
    assert len(statements) == first
    assert live["jobs"][0]["energy_j"] == pytest.approx(205 * 300.0)
    assert live["hosts"][0]["devices"][0]["power_w"] == pytest.approx(300.0)
