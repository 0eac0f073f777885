"""POST /api/v1/ingest served by the raw ASGI path (collector.ingest.IngestFastPath) answers exactly as the
FastAPI route does: the same status, JSON body and headers for stored batches, duplicates and every error."""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from test_storage import WIDE_WINDOW_S, batch, iv
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.storage import tokens
from wattwatch.storage.engine import make_engine

T_S = 1_700_000_000.0


def good(seq: int, host: str = "h1", agent_id: str = "a1") -> bytes:
    ivs = [iv("gpu0", T_S + t, 300.0, {"job-1": 1.0}) for t in range(3)]
    return wire.encode(batch(seq, host=host, agent_id=agent_id, intervals=ivs))


# (name, body, headers): each posted in turn to both apps.
REQUESTS: list[tuple[str, bytes, dict[str, str]]] = [
    ("stored", good(1), {}),
    ("duplicate", good(1), {}),
    ("gzip", gzip.compress(good(2)), {"Content-Encoding": "gzip"}),
    ("bad gzip", b"not gzip", {"Content-Encoding": "gzip"}),
    ("encoding", good(3), {"Content-Encoding": "br"}),
    ("not json", b"{", {}),
    ("bad field", good(4).replace(b'"energy_j":300.0', b'"energy_j":-1.0', 1), {}),
    ("unknown device", good(5).replace(b'"device":"gpu0"', b'"device":"gpu9"', 1), {}),
    ("key reused", wire.encode(batch(1, host="h1", agent_id="a1")), {}),
    ("agent id of another host", good(6, host="h2"), {}),
    ("in the future", wire.encode(batch(7, host="h1", agent_id="a1", intervals=[iv("gpu0", 4e9, 1.0, {})])), {}),
    ("empty", b"", {}),
]


def answers(app_of: Callable[[bool], Any], fast: bool, auth: dict[str, str]) -> list[tuple[Any, ...]]:
    with TestClient(app_of(fast)) as client:
        out = []
        for name, body, headers in REQUESTS:
            r = client.post("/api/v1/ingest", content=body, headers={**headers, **auth})
            out.append(
                (name, r.status_code, r.headers.get("content-type"), r.headers.get("www-authenticate"), r.json())
            )
        return out


@pytest.fixture
def app_of(tmp_path: Path, sqlite_url: str) -> Callable[[bool], Any]:
    """An app on a fresh copy of the migrated database for each path (fast or FastAPI)."""
    template = Path(sqlite_url.removeprefix("sqlite:///"))

    def make(fast: bool) -> Any:
        path = tmp_path / f"fast-{fast}.db"
        shutil.copyfile(template, path)
        engine = make_engine(f"sqlite:///{path}")
        settings = Settings(home=tmp_path, time_window_past_s=WIDE_WINDOW_S)
        return create_app(
            settings, engine, clock=lambda: T_S + 100, span_energy_interval_s=None, periodic=False, fast_ingest=fast
        )

    return make


def test_the_fast_path_answers_as_the_fastapi_route(app_of: Callable[[bool], Any]) -> None:
    fast, routed = answers(app_of, True, {}), answers(app_of, False, {})
    assert fast == routed
    statuses = {name: status for name, status, *_ in fast}
    assert statuses == {
        "stored": 200,
        "duplicate": 200,
        "gzip": 200,
        "bad gzip": 422,
        "encoding": 415,
        "not json": 422,
        "bad field": 422,
        "unknown device": 422,
        "key reused": 409,
        "agent id of another host": 409,
        "in the future": 422,
        "empty": 422,
    }
    assert fast[0][4] == {"accepted": True, "duplicate": False, "intervals": 3}
    assert fast[1][4] == {"accepted": True, "duplicate": True, "intervals": 0}
    assert fast[6][4]["field"] == "intervals[0].energy_j"
    assert fast[10][4]["field"] == "intervals[0].t_start_s"


def test_the_fast_path_authenticates_as_the_route(tmp_path: Path, sqlite_url: str) -> None:
    """401 (with WWW-Authenticate), 403 for a reader token or another host's agent token, 200 for the host's."""
    engine = make_engine(sqlite_url)
    agent = tokens.create_token(engine, "agent", "h1")[1]
    reader = tokens.create_token(engine, "reader")[1]
    results = {}
    for fast in (True, False):
        settings = Settings(home=tmp_path, time_window_past_s=WIDE_WINDOW_S)
        app = create_app(settings, engine, span_energy_interval_s=None, periodic=False, fast_ingest=fast)
        with TestClient(app) as client:
            got = []
            for seq, (token, host) in enumerate(
                [(None, "h1"), ("nope", "h1"), (reader, "h1"), (agent, "h2"), (agent, "h1")]
            ):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                r = client.post(
                    "/api/v1/ingest",
                    content=good(10 + seq + 100 * fast, host=host, agent_id=f"{host}-{fast}"),
                    headers=headers,
                )
                got.append(
                    (r.status_code, r.headers.get("www-authenticate"), json.dumps(r.json()).replace(str(fast), ""))
                )
            results[fast] = got
    assert results[True] == results[False]
    assert [status for status, *_ in results[True]] == [401, 401, 403, 403, 200]
    assert results[True][0][1] == "Bearer"


def test_a_database_error_is_a_503_on_the_fast_path(tmp_path: Path, sqlite_url: str) -> None:
    """The app's database handler answers (503 naming no field), not a 500."""
    engine = make_engine(sqlite_url)
    settings = Settings(home=tmp_path, time_window_past_s=WIDE_WINDOW_S)
    app = create_app(settings, engine, span_energy_interval_s=None, periodic=False)
    with TestClient(app) as client:
        writer = app.state.wattwatch.writer

        def broken(group: Any) -> Any:
            raise OperationalError("INSERT", {}, Exception("disk I/O error"))

        writer.store_group = broken
        r = client.post("/api/v1/ingest", content=good(1))
    assert r.status_code == 503 and r.json()["field"] is None


def test_other_methods_and_paths_still_reach_fastapi(app_of: Callable[[bool], Any]) -> None:
    with TestClient(app_of(True)) as client:
        assert client.get("/api/v1/ingest").status_code == 405
        assert client.post("/api/v1/ingest/x", content=good(1)).status_code == 404
        assert "/api/v1/ingest" in client.get("/openapi.json").json()["paths"]
