"""Identity in-process (the real ASGI app on SQLite and PostgreSQL): tokens and roles, per-host writes,
agent ids bound to their host, idempotency keys that tell a retry from other content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.exc import OperationalError

from test_storage import T0, WIDE_WINDOW_S, batch, iv, row_counts
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.storage import tokens
from wattwatch.storage.tables import api_tokens, hosts, jobs


@dataclass
class Tokens:
    agent_h1: str
    agent_h2: str
    reader: str
    admin: str
    revoked: str


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def post_batch(client: TestClient, b: wire.Batch, token: str | None = None) -> Any:
    return client.post("/api/v1/ingest", content=wire.encode(b), headers=bearer(token) if token else {})


def one_batch(seq: int = 1, host: str = "h1", agent_id: str = "a1", energy_j: float = 300.0) -> wire.Batch:
    return batch(
        seq,
        host=host,
        agent_id=agent_id,
        jobs=[wire.Job(id=f"job-{host}", name="llama-ft", kind="training", started_at_s=T0)],
        intervals=[iv("gpu0", T0 + t, energy_j, {f"job-{host}": 1.0}) for t in range(3)],
    )


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, time_window_past_s=WIDE_WINDOW_S)  # the data is from T0, the clock real


@pytest.fixture
def made(db_engine: Engine) -> Tokens:
    revoked = tokens.create_token(db_engine, "agent", "h1")[1]
    tokens.revoke_token(db_engine, tokens.prefix_of(revoked))
    return Tokens(
        agent_h1=tokens.create_token(db_engine, "agent", "h1")[1],
        agent_h2=tokens.create_token(db_engine, "agent", "h2")[1],
        reader=tokens.create_token(db_engine, "reader")[1],
        admin=tokens.create_token(db_engine, "admin")[1],
        revoked=revoked,
    )


@pytest.fixture
def client(settings: Settings, db_engine: Engine) -> Iterator[TestClient]:
    # token_refresh_s=0: every request sees the tokens as they are now. periodic=False: the retention pass
    # (started at once) would prune these 2023 batches while a test compares row counts.
    app = create_app(settings, db_engine, span_energy_interval_s=None, token_refresh_s=0.0, periodic=False)
    with TestClient(app) as c:
        yield c


def test_tokens_are_stored_hashed_and_look_random(db_engine: Engine, made: Tokens) -> None:
    with db_engine.connect() as conn:
        stored = conn.execute(select(api_tokens.c.prefix, api_tokens.c.sha256)).all()
    assert len(stored) == 5
    for token in (made.agent_h1, made.reader, made.admin):
        assert token.startswith("ww_") and len(token) == 46
        assert (tokens.prefix_of(token), tokens.hash_token(token)) in stored
        assert all(token not in row for row in stored)  # never the token itself
    assert len({made.agent_h1, made.agent_h2, made.reader, made.admin}) == 4


@pytest.mark.parametrize(
    ("who", "status", "field"),
    [
        (None, 401, "Authorization"),
        ("revoked", 401, "Authorization"),
        ("garbage", 401, "Authorization"),
        ("reader", 403, "Authorization"),
        ("agent_h2", 403, "host"),  # an agent token of another host
    ],
)
def test_rejected_writes_store_nothing(
    client: TestClient, db_engine: Engine, made: Tokens, who: str | None, status: int, field: str
) -> None:
    assert post_batch(client, one_batch(1), made.agent_h1).status_code == 200
    before = row_counts(db_engine)
    token = None if who is None else "ww_not-a-token" if who == "garbage" else str(getattr(made, who))
    r = post_batch(client, one_batch(2, energy_j=1e6), token)
    assert (r.status_code, r.json()["field"]) == (status, field), r.text
    assert r.json()["error"]
    assert row_counts(db_engine) == before
    # The job routes refuse the same callers the same way, and store nothing either.
    start = {"id": "job-h1", "name": "renamed", "kind": "inference", "host": "h1"}
    r = client.post("/api/v1/jobs", json=start, headers=bearer(token) if token else {})
    assert (r.status_code, r.json()["field"]) == (status, field)
    spans = {"queries": [{"t_start_s": T0, "t_end_s": T0 + 1}], "host": "h1"}
    r = client.post("/api/v1/jobs/job-h1/queries", json=spans, headers=bearer(token) if token else {})
    assert r.status_code == status
    assert row_counts(db_engine) == before


def test_an_agent_token_writes_only_as_its_own_host(client: TestClient, db_engine: Engine, made: Tokens) -> None:
    assert post_batch(client, one_batch(1, host="h1"), made.agent_h1).status_code == 200
    assert post_batch(client, one_batch(1, host="h2", agent_id="a2"), made.agent_h2).status_code == 200
    before = row_counts(db_engine)
    h2 = bearer(made.agent_h2)
    # Renaming, ending or adding spans to a job only h1 reported, as h2: 403 naming what was wrong.
    r = client.post("/api/v1/jobs", json={"id": "job-h1", "name": "mine", "host": "h1"}, headers=h2)
    assert (r.status_code, r.json()["field"]) == (403, "host")
    r = client.post("/api/v1/jobs/job-h1/end", json={"ended_at_s": 0.0}, headers=h2)
    assert (r.status_code, r.json()["field"]) == (403, "job_id")
    r = client.post("/api/v1/jobs/job-h1/queries", json={"queries": [{"t_start_s": T0, "t_end_s": T0}]}, headers=h2)
    assert (r.status_code, r.json()["field"]) == (403, "job_id")
    spans = {"queries": [{"t_start_s": T0, "t_end_s": T0}], "host": "h1"}
    r = client.post("/api/v1/jobs/job-h2/queries", json=spans, headers=h2)
    assert (r.status_code, r.json()["field"]) == (403, "host")
    assert row_counts(db_engine) == before
    with db_engine.connect() as conn:
        assert conn.execute(select(jobs.c.name, jobs.c.ended_at_s).where(jobs.c.id == "job-h1")).one() == (
            "llama-ft",
            None,
        )
    # Its own host's job: allowed, and the spans are recorded as its host's.
    r = client.post("/api/v1/jobs/job-h2/queries", json={"queries": [{"t_start_s": T0, "t_end_s": T0}]}, headers=h2)
    assert r.json() == {"accepted": 1}
    assert client.post("/api/v1/jobs/job-h2/end", json={"ended_at_s": T0 + 5}, headers=h2).status_code == 200
    # A job the agent announces itself is its host's from then on.
    r = client.post("/api/v1/jobs", json={"id": "srv", "name": "vllm", "kind": "inference", "host": "h2"}, headers=h2)
    assert r.status_code == 200 and r.json()["hosts"] == ["h2"]


def test_reads_need_a_reader_or_admin_token(client: TestClient, made: Tokens) -> None:
    reads = ["/api/v1/report", "/api/v1/jobs", "/metrics", "/openapi.json", "/docs"]
    for path in reads:
        r = client.get(path)
        assert (r.status_code, r.json()["field"]) == (401, "Authorization"), path
        assert r.headers["www-authenticate"] == "Bearer"
        assert client.get(path, headers=bearer(made.reader)).status_code == 200, path
        assert client.get(path, headers=bearer(made.admin)).status_code == 200, path
        assert client.get(path, headers=bearer(made.revoked)).status_code == 401, path
    for path in reads[:3]:  # an agent token writes; it does not read other hosts' reports
        r = client.get(path, headers=bearer(made.agent_h1))
        assert (r.status_code, r.json()["field"]) == (403, "Authorization"), path
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    assert client.get("/api/v1/jobs/x", headers=bearer(made.reader)).status_code == 404


def test_admin_and_the_static_token_may_do_everything(settings: Settings, db_engine: Engine, made: Tokens) -> None:
    app = create_app(replace(settings, token="s3cret-static"), db_engine, span_energy_interval_s=None)
    with TestClient(app) as c:
        for token in ("s3cret-static", made.admin):
            b = one_batch(1 if token == made.admin else 2, host="any-host")
            assert post_batch(c, b, token).status_code == 200
            assert c.get("/api/v1/report", headers=bearer(token)).status_code == 200
        assert c.post("/api/v1/jobs/job-any-host/end", headers=bearer(made.admin)).status_code == 200
        assert post_batch(c, one_batch(3), "s3cret-wrong").status_code == 401


def test_open_until_a_token_exists_and_never_again(client: TestClient, db_engine: Engine, settings: Settings) -> None:
    assert post_batch(client, one_batch(1)).status_code == 200  # an embedded app, no token ever: open
    assert client.get("/metrics").status_code == 200
    token_id, token = tokens.create_token(db_engine, "reader")
    assert client.get("/metrics").status_code == 401
    assert post_batch(client, one_batch(2)).status_code == 401
    assert client.get("/metrics", headers=bearer(token)).status_code == 200
    tokens.revoke_token(db_engine, str(token_id))
    # The last token revoked: still closed, to everyone, with the token and without.
    assert client.get("/metrics", headers=bearer(token)).status_code == 401
    r = post_batch(client, one_batch(3))
    assert (r.status_code, r.json()["field"]) == (401, "Authorization")
    assert "Bearer" in r.json()["error"]
    # A collector started later on the same database is closed from the start, --open or not.
    for anonymous in ("anyone", "loopback"):
        app = create_app(settings, db_engine, span_energy_interval_s=None, anonymous=anonymous, periodic=False)
        with TestClient(app, client=("127.0.0.1", 50000)) as c:
            assert post_batch(c, one_batch(4)).status_code == 401, anonymous
            assert c.get("/healthz").status_code == 200


def _app(settings: Settings, db_engine: Engine, anonymous: str) -> Any:
    return create_app(
        settings, db_engine, span_energy_interval_s=None, token_refresh_s=0.0, anonymous=anonymous, periodic=False
    )


def test_closed_by_default_names_the_way_in(settings: Settings, db_engine: Engine) -> None:
    with TestClient(_app(settings, db_engine, "nobody"), client=("127.0.0.1", 50000)) as c:
        r = post_batch(c, one_batch(1))
        assert (r.status_code, r.json()["field"]) == (401, "Authorization")
        assert "wattwatch token create" in r.json()["error"] and "--open" in r.json()["error"]
        assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/api/v1/report").status_code == 401
        assert c.post("/api/v1/jobs", json={"id": "j", "name": "n", "host": "h1"}).status_code == 401
        assert c.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("peer", "headers", "status"),
    [
        ("127.0.0.1", {}, 200),
        ("::1", {}, 200),
        ("::ffff:127.0.0.1", {}, 200),
        ("10.1.2.3", {}, 401),
        ("testclient", {}, 401),  # not an address: nothing says it is local
        # A reverse proxy on this host connects from loopback for callers anywhere.
        ("127.0.0.1", {"X-Forwarded-For": "127.0.0.1"}, 401),
        ("127.0.0.1", {"Forwarded": "for=127.0.0.1"}, 401),
        ("127.0.0.1", {"X-Real-IP": "127.0.0.1"}, 401),
    ],
)
def test_open_means_this_machine_straight_to_the_collector(
    settings: Settings, db_engine: Engine, peer: str, headers: dict[str, str], status: int
) -> None:
    with TestClient(_app(settings, db_engine, "loopback"), client=(peer, 50000)) as c:
        r = c.post("/api/v1/ingest", content=wire.encode(one_batch(1)), headers=headers)
        assert r.status_code == status, r.text
        assert c.get("/api/v1/report", headers=headers).status_code == status
        if status == 401:
            assert r.json()["field"] == "Authorization"
            assert "this machine only" in r.json()["error"] and "X-Forwarded-For" in r.json()["error"]


def test_last_used_is_recorded(client: TestClient, db_engine: Engine, made: Tokens) -> None:
    assert client.get("/metrics", headers=bearer(made.reader)).status_code == 200
    assert client.get("/metrics", headers=bearer(made.reader)).status_code == 200  # the next refresh writes it
    used = {r.prefix: r.last_used_s for r in tokens.list_tokens(db_engine)}
    assert used[tokens.prefix_of(made.reader)] is not None
    assert used[tokens.prefix_of(made.admin)] is None


# --- idempotency -------------------------------------------------------------------------------------------


def test_a_cloned_agent_id_from_another_host_is_refused_and_stores_nothing(
    client: TestClient, db_engine: Engine
) -> None:
    assert post_batch(client, one_batch(1, host="h1", agent_id="cloned")).json()["duplicate"] is False
    before = row_counts(db_engine)
    # A clone of h1's spool on h2: its own next batch, and one with a key h1 has not used yet.
    for seq in (1, 2):
        r = post_batch(client, one_batch(seq, host="h2", agent_id="cloned", energy_j=5e6))
        assert (r.status_code, r.json()["field"]) == (409, "agent_id"), r.text
        assert "cloned spool" in r.json()["error"] and "spool.db" in r.json()["error"]
        assert "'h1'" in r.json()["error"] and "'h2'" in r.json()["error"]
    assert row_counts(db_engine) == before
    with db_engine.connect() as conn:
        assert conn.execute(select(hosts.c.name)).scalars().all() == ["h1"]
    # h1 itself goes on, and nobody else's key can pre-empt its seq 2.
    assert post_batch(client, one_batch(2, host="h1", agent_id="cloned")).json()["duplicate"] is False
    assert "wattwatch_ingest_errors_total 2.0" in client.get("/metrics").text


def test_same_key_same_content_is_a_duplicate_other_content_a_conflict(client: TestClient, db_engine: Engine) -> None:
    assert post_batch(client, one_batch(7)).json() == {"accepted": True, "duplicate": False, "intervals": 3}
    again = post_batch(client, one_batch(7))
    assert again.status_code == 200 and again.json()["duplicate"] is True
    before = row_counts(db_engine)
    other = post_batch(client, one_batch(7, energy_j=301.0))
    assert (other.status_code, other.json()["field"]) == (409, "seq"), other.text
    assert "seq 7" in other.json()["error"]
    assert row_counts(db_engine) == before
    report = client.get("/api/v1/report").json()
    assert report["jobs"][0]["energy_j"] == 900.0  # the first content, once


def test_a_retried_span_post_counts_once(client: TestClient, db_engine: Engine) -> None:
    assert post_batch(client, one_batch(1)).status_code == 200
    spans = {"queries": [{"t_start_s": T0 + 1, "t_end_s": T0 + 2, "tokens_in": 3, "tokens_out": 4}] * 5}
    key = {"Idempotency-Key": "post-0001"}
    first = client.post("/api/v1/jobs/job-h1/queries", json=spans, headers=key)
    assert first.json() == {"accepted": 5, "duplicate": False}
    retry = client.post("/api/v1/jobs/job-h1/queries", json=spans, headers=key)
    assert retry.json() == {"accepted": 0, "duplicate": True}
    before = row_counts(db_engine)
    other = client.post("/api/v1/jobs/job-h1/queries", json={"queries": spans["queries"][:2]}, headers=key)
    assert (other.status_code, other.json()["field"]) == (409, "Idempotency-Key")
    assert row_counts(db_engine) == before
    # The same key on another job is another key; a post without a key is not deduplicated (as before).
    assert client.post("/api/v1/jobs/job-h1/queries", json=spans).json() == {"accepted": 5}
    job = client.get("/api/v1/jobs/job-h1").json()
    assert (job["queries"], job["tokens"]) == (10, 70)
    bad = client.post("/api/v1/jobs/job-h1/queries", json=spans, headers={"Idempotency-Key": "x" * 201})
    assert (bad.status_code, bad.json()["field"]) == (422, "Idempotency-Key")


SQL_HOST = "h'); DROP TABLE hosts; --"
UNICODE_HOST = "gpu-ノード-ü-🚀"
NAMES = ["Robert'); DROP TABLE jobs;--", '训练 llama "quoted" \\ back', "%_ like' OR '1'='1"]


@pytest.mark.parametrize("host", [SQL_HOST, UNICODE_HOST])
def test_sql_shaped_and_unicode_names_round_trip_as_text(
    client: TestClient, db_engine: Engine, host: str, made: Tokens
) -> None:
    _, token = tokens.create_token(db_engine, "agent", host)
    labels = {"team'; --": "ñlp 🚀", "x": "' OR 1=1 --"}
    b = batch(
        1,
        host=host,
        agent_id="a-" + str(len(host)),
        jobs=[
            wire.Job(id=f"j{i}", name=name, kind="training", started_at_s=T0, labels=labels)
            for i, name in enumerate(NAMES)
        ],
        intervals=[iv("gpu0", T0, 30.0, {f"j{i}": 1.0 for i in range(len(NAMES))})],
    )
    assert post_batch(client, b, token).status_code == 200
    report = client.get("/api/v1/report", headers=bearer(made.reader)).json()
    got = {j["id"]: j for j in report["jobs"]}
    for i, name in enumerate(NAMES):
        assert (got[f"j{i}"]["name"], got[f"j{i}"]["hosts"], got[f"j{i}"]["labels"]) == (name, [host], labels)
        assert got[f"j{i}"]["energy_j"] == pytest.approx(10.0)
    listed = {r.host for r in tokens.list_tokens(db_engine)}
    assert host in listed
    # A token of a host with a similar name is another host.
    _, near = tokens.create_token(db_engine, "agent", host + " ")
    r = post_batch(client, batch(2, host=host, agent_id="a-" + str(len(host))), near)
    assert (r.status_code, r.json()["field"]) == (403, "host")
    assert json.loads(r.text)["error"].endswith(f"not {host!r}")


def test_tokens_read_at_start_stay_in_force_while_the_database_is_away(
    settings: Settings, db_engine: Engine, made: Tokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(settings, db_engine, span_energy_interval_s=None, token_refresh_s=0.0)
    with TestClient(app) as c:  # its start read the tokens

        def away(_engine: Engine) -> None:
            raise OperationalError("SELECT", {}, Exception("connection refused"))

        monkeypatch.setattr(tokens, "active_tokens", away)
        # /metrics still answers (it is how Prometheus learns the database is down), and still needs a token.
        assert c.get("/metrics", headers=bearer(made.reader)).status_code == 200
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=bearer(made.revoked)).status_code == 401
