"""What a bad value may cost beyond its own request: the span-energy pass walks windows with data, not the
empty years before a stray span; and a request that fails inside the collector answers a JSON 500 and
leaves the client's keep-alive connection working (a real uvicorn on loopback, one httpx client)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from sqlalchemy import Engine, select

from procs import free_port, wait_for
from test_storage import T0, batch, iv
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.storage import repository
from wattwatch.storage.engine import make_engine
from wattwatch.storage.span_energy import compute_span_energy
from wattwatch.storage.tables import queries, span_stats


class CallCounter:
    """A ``monotonic`` for the pass that advances one "second" per call: its ``budget_s`` then counts the
    pass's turns (a few calls per window), so a pass that walked millions of windows would stop, not hang."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return float(self.calls)


def test_one_span_from_1970_costs_one_window_not_millions(db_engine: Engine) -> None:
    spans = [wire.Query("serve", T0 + 2 * i, T0 + 2 * i + 1, tokens_in=1) for i in range(5)]
    stray = wire.Query("serve", 1000.0, 1001.0)  # a client's clock at 1970: ~2.8 million 600 s windows away
    b = batch(
        1,
        jobs=[wire.Job(id="serve", name="chat", kind="inference", started_at_s=T0)],
        intervals=[iv("gpu0", T0 + t, 100.0, {"serve": 1.0}) for t in range(10)],
        queries=[stray, *spans],
    )
    repository.ingest_batch(db_engine, b, received_at_s=T0 + 20)  # storage directly: no HTTP time window here
    counter = CallCounter()
    result = compute_span_energy(db_engine, now_s=T0 + 100, settle_s=0.0, budget_s=1000.0, monotonic=counter)
    assert result.complete, f"the pass did not finish in 1000 turns: {result}"
    # One window for the 1970 span, one for the job's 10 s of data: the empty 54 years are jumped over.
    assert result.windows <= 3, result
    with db_engine.connect() as conn:
        energies = dict(conn.execute(select(queries.c.t_start_s, queries.c.energy_j)).all())
        stats = conn.execute(select(span_stats.c.settled_energy_j, span_stats.c.waiting_energy_j)).one()
    assert energies[1000.0] == 0.0  # no tick of the job near it: no energy
    assert all(energies[s.t_start_s] == pytest.approx(100.0) for s in spans)  # 1 s of a 100 W job each
    assert stats.settled_energy_j + stats.waiting_energy_j == pytest.approx(1000.0)  # the job's energy, conserved


@pytest.fixture
def served(sqlite_url: str, tmp_path: Path) -> Iterator[str]:
    """The collector app on a real uvicorn server on loopback; yields its base URL."""
    engine = make_engine(sqlite_url)
    app = create_app(Settings(home=tmp_path), engine, span_energy_interval_s=None)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 20.0, "uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        engine.dispose()


def _local_port(response: httpx.Response) -> int:
    """The client-side port of the connection ``response`` came on."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_a_failure_inside_is_a_json_500_and_the_connection_keeps_working(
    served: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: object, **_kw: object) -> None:
        raise RuntimeError("secret detail of the failure")

    monkeypatch.setattr(repository, "build_report", broken)
    with httpx.Client(base_url=served, timeout=10) as client:
        first = client.get("/healthz")
        failed = client.get("/api/v1/report")
        assert failed.status_code == 500
        assert failed.headers["content-type"] == "application/json"
        assert failed.json()["field"] is None and failed.json()["error"]
        assert "secret detail" not in failed.text and "Traceback" not in failed.text
        after = client.get("/healthz")
        assert after.json() == {"ok": True}
        # All three on one keep-alive connection: the 500 did not make the server drop it.
        assert _local_port(first) == _local_port(failed) == _local_port(after)
