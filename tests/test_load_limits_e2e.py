"""Bounded work through a real ``wattwatch collector`` process, on SQLite and PostgreSQL: a crowd of readers
gets quick 429s with Retry-After rather than everyone a slow answer, and a valid agent keeps landing
batches meanwhile; a full ingest queue is a 503 with Retry-After."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from test_auth_e2e import env_for, run, stop
from test_front_door_e2e import fresh_batch, ingest, start_collector
from wattwatch.collector import create_app
from wattwatch.config import Settings

pytestmark = pytest.mark.e2e

READERS = 300


@pytest.mark.slow
def test_a_crowd_of_readers_gets_429s_not_a_slow_answer(db_url: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    reader = run(["token", "create", "--db", db_url, "--role", "reader"], env_for(home)).stdout.strip()
    agent = run(["token", "create", "--db", db_url, "--role", "agent", "--host", "h1"], env_for(home)).stdout.strip()
    proc, url = start_collector(db_url, home)
    try:
        assert ingest(url, agent, seq=1).status_code == 200
        start = threading.Barrier(READERS)
        answers: list[tuple[int, float, str | None]] = []

        def read() -> None:
            with httpx.Client(headers={"Authorization": f"Bearer {reader}"}, timeout=60) as client:
                start.wait()
                t0 = time.monotonic()
                r = client.get(f"{url}/api/v1/report")
                answers.append((r.status_code, time.monotonic() - t0, r.headers.get("retry-after")))

        readers = [threading.Thread(target=read) for _ in range(READERS)]
        for t in readers:
            t.start()
        assert ingest(url, agent, seq=2).status_code == 200  # a valid agent, during the crowd
        for t in readers:
            t.join(timeout=120)
        assert len(answers) == READERS
        statuses = {status for status, _, _ in answers}
        assert statuses <= {200, 429}, statuses
        busy = [a for a in answers if a[0] == 429]
        assert busy and all(retry == "1" for _, _, retry in busy), len(busy)
        served_s = sorted(elapsed_s for status, elapsed_s, _ in answers if status == 200)
        p99_s = served_s[int(0.99 * (len(served_s) - 1))]
        print(f"{len(served_s)} served (p99 {p99_s:.3f} s), {len(busy)} answered 429")
        assert served_s and p99_s <= 1.0, served_s[-5:]
    finally:
        stop(proc)


def test_a_full_ingest_queue_is_a_503_with_retry_after(tmp_path: Path, db_engine: Engine) -> None:
    app = create_app(Settings(home=tmp_path), db_engine, span_energy_interval_s=None, anonymous="anyone")
    with TestClient(app) as client:
        app.state.wattwatch.writer.max_queued = 0  # every batch finds the queue full
        r = client.post("/api/v1/ingest", content=fresh_batch(1))
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "retry after" in r.json()["error"]
        app.state.wattwatch.writer.max_queued = 10
        assert client.post("/api/v1/ingest", content=fresh_batch(1)).status_code == 200
