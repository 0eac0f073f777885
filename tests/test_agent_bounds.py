"""The same bounds where data is born: the agent's socket and the SDK drop one bad span or label alone, say
so at once (a reply naming the field, a warning) and count it (``wattwatch_agent_refused_total``,
``sdk.refused()``); the rest of the batch reaches the collector (the real app on SQLite and PostgreSQL).
And, property-tested: the SDK accepts a span exactly when the collector would."""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, select

import wattwatch
import wattwatch.sdk as sdk
from test_agent import make_agent, wait_for
from wattwatch.agent.jobs import ActiveJob
from wattwatch.agent.runner import Agent
from wattwatch.agent.spool import Spool
from wattwatch.collector import create_app
from wattwatch.collector.bodies import QueriesIn
from wattwatch.config import Settings
from wattwatch.protocol import limits, wire
from wattwatch.sdk import AgentClient, notices
from wattwatch.storage.tables import jobs, queries


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    """A started agent (its socket served) on two constant-power GPUs; stopped after the test."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    a, _ = make_agent(tmp_path)
    a.start()
    try:
        yield a
    finally:
        a.stop(flush_timeout_s=0.2)


def spooled(agent: Agent) -> list[bytes]:
    """The stopped agent's batches, as it would push them."""
    return [body for _, body in Spool(agent.settings.home / "spool.db").peek(limit=1000)]


def push_all(bodies: list[bytes], db_engine: Engine, tmp_path: Path) -> list[int]:
    """POST each batch to the collector (real clock: the agent's data is from now); the status codes."""
    app = create_app(Settings(home=tmp_path / "collector"), db_engine, span_energy_interval_s=None)
    with TestClient(app) as client:
        return [client.post("/api/v1/ingest", content=b).status_code for b in bodies]


def refused_metric(agent: Agent) -> dict[str, float]:
    text = generate_latest(agent.metrics_registry).decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "wattwatch_agent_refused")
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_the_socket_drops_a_bad_span_alone_counts_it_and_the_batch_lands(
    agent: Agent, db_engine: Engine, tmp_path: Path
) -> None:
    client = AgentClient(agent.settings.socket_path)
    now = time.time()
    good = [
        {"job": "chat", "t_start_s": now - 2, "t_end_s": now - 1, "tokens_in": 5},
        {"job": "chat", "t_start_s": now - 1, "t_end_s": now},
    ]
    bad = [
        {"job": "chat", "t_start_s": (now - 1) * 1000, "t_end_s": now * 1000},  # time.time() * 1000
        {"job": "chat", "t_start_s": now - 1, "t_end_s": now, "tokens_in": 2**31},
        {"job": "chat", "t_start_s": now, "t_end_s": now - 1},
        {"job": "chat", "t_start_s": now - 40 * 86400, "t_end_s": now},
        {"job": "chat", "t_start_s": now - 8 * 86400, "t_end_s": now},  # in the window, longer than a span may be
    ]
    reply = client.request({"op": "queries", "spans": [good[0], *bad, good[1]]})
    assert (reply["ok"], reply["accepted"], reply["rejected"]) == (False, 2, 5)
    assert "spans[1].t_start_s" in reply["error"] and "not milliseconds" in reply["error"]
    assert "spans[2].tokens_in" in reply["error"] and "spans[3].t_end_s" in reply["error"]
    assert "spans[5].t_end_s" in reply["error"] and "at most 7 d" in reply["error"]
    one = client.request({"op": "query", "job": "chat", "t_start_s": 1.5, "t_end_s": 2.0})
    assert (one["ok"], one["field"], one["reason"]) == (False, "t_start_s", "timestamp")
    expected = {"timestamp": 3.0, "out_of_range": 2.0, "end_before_start": 1.0}
    assert refused_metric(agent) == {reason: expected.get(reason, 0.0) for reason in limits.REASONS}
    agent.stop(flush_timeout_s=0.2)
    assert set(push_all(spooled(agent), db_engine, tmp_path)) == {200}
    with db_engine.connect() as conn:
        stored = conn.execute(select(queries.c.t_start_s, queries.c.tokens_in).order_by(queries.c.t_start_s)).all()
    assert [tuple(r) for r in stored] == [(now - 2, 5), (now - 1, 0)]


def test_the_sdk_refuses_at_the_source_warns_once_per_reason_and_the_rest_flows(
    agent: Agent, db_engine: Engine, tmp_path: Path
) -> None:
    notices._refused.clear()
    client = AgentClient(agent.settings.socket_path)
    labels = {"team": "nlp", "big": "x" * (limits.MAX_LABEL_VALUE_CHARS + 1), "nul": "a\x00b"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with wattwatch.job("serve", kind="inference", job_id="serve-1", labels=labels, client=client):
            with wattwatch.query(tokens_in=3, client=client):
                pass
            now = time.time()
            sdk.record_span("query", now * 1000, now * 1000, client=client)  # milliseconds
            sdk.record_span("query", now - 1, now, tokens_in=2**31, client=client)
            sdk.record_span("query", now - 2, now - 1, tokens_in=2**40, client=client)  # counted, not warned again
            with wattwatch.query(tokens_out=4, client=client):
                pass
        wait_for(lambda: agent.registry.get("serve-1") is None)
    messages = [str(w.message) for w in caught if "dropped" in str(w.message)]
    assert len(messages) == 3, messages  # one per reason: labels (two left out), timestamp, out_of_range
    assert any("t_start_s" in m and "milliseconds" in m for m in messages)
    assert sdk.refused() == {"labels": 2, "timestamp": 1, "out_of_range": 2}
    assert sum(refused_metric(agent).values()) == 0  # nothing bad reached the agent
    agent.stop(flush_timeout_s=0.2)
    assert set(push_all(spooled(agent), db_engine, tmp_path)) == {200}
    with db_engine.connect() as conn:
        assert sorted(conn.execute(select(queries.c.tokens_in, queries.c.tokens_out)).all()) == [(0, 4), (3, 0)]
        stored_labels = conn.execute(select(jobs.c.labels).where(jobs.c.id == "serve-1")).scalar_one()
    assert stored_labels["team"] == "nlp" and "big" not in stored_labels and "nul" not in stored_labels


def test_the_socket_starts_a_job_without_its_bad_labels_and_says_which(agent: Agent) -> None:
    client = AgentClient(agent.settings.socket_path)
    many = {f"k{i:03d}": "v" for i in range(limits.MAX_LABELS + 5)}
    reply = client.request({"op": "job_start", "id": "j1", "name": "n\x00ame", "labels": {**many, "x" * 600: "v"}})
    assert reply["ok"] and "label left out" in reply["warning"]
    wait_for(lambda: agent.registry.get("j1") is not None)  # the worker registers it
    job = agent.registry.get("j1")
    assert job is not None and job.name == "name"
    assert "wattwatch.io/discovered-by" in job.labels and len(job.labels) == limits.MAX_LABELS
    # 70 that fit (the agent's own discovered-by label kept first): 6 beyond the count; and 1 key too long
    assert refused_metric(agent)["labels"] == 7.0
    client.request({"op": "job_end", "id": "j1"})


# --- the SDK and the collector agree ---------------------------------------------------------------------

NOW = 1_700_000_000.0
TIMES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=NOW - 40 * 86400, max_value=NOW + 2 * 86400),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.sampled_from([0.0, NOW * 1000, NOW - limits.DEFAULT_PAST_S, NOW + limits.DEFAULT_FUTURE_S, 1e10, 1e10 + 1]),
)
COUNTS = st.one_of(st.integers(min_value=-5, max_value=2**65), st.sampled_from([2**31 - 1, 2**31, 2**63]))


def _collector_accepts(span: dict[str, Any]) -> bool:
    """What the collector's span route decides about ``span`` (its decoding and its time window)."""
    try:
        posted = wire.decode_as(json.dumps({"queries": [span]}).encode(), QueriesIn)
        limits.check_span_times(posted.queries, NOW, limits.DEFAULT_WINDOW)
    except limits.BoundError:
        return False
    return True


@given(t_start_s=TIMES, t_end_s=TIMES, tokens_in=COUNTS, tokens_out=COUNTS)
@example(t_start_s=NOW * 1000, t_end_s=NOW * 1000, tokens_in=0, tokens_out=0)
@example(t_start_s=NOW - 1, t_end_s=NOW, tokens_in=2**31, tokens_out=0)
@example(t_start_s=math.nan, t_end_s=NOW, tokens_in=0, tokens_out=0)
def test_the_sdk_accepts_a_span_exactly_when_the_collector_would(
    t_start_s: float, t_end_s: float, tokens_in: int, tokens_out: int
) -> None:
    span = {"t_start_s": t_start_s, "t_end_s": t_end_s, "tokens_in": tokens_in, "tokens_out": tokens_out}
    try:
        limits.check_span(t_start_s, t_end_s, tokens_in, tokens_out, now_s=NOW)
        sdk_accepts = True
    except limits.BoundError:
        sdk_accepts = False
    assert sdk_accepts == _collector_accepts(span)


LABEL_TEXT = st.text(st.characters(codec="utf-8"), max_size=limits.MAX_LABEL_VALUE_CHARS + 10)


@given(st.dictionaries(st.text(st.characters(codec="utf-8"), max_size=600), LABEL_TEXT, max_size=80))
def test_fitted_labels_always_decode_and_only_bad_ones_are_left_out(labels: dict[str, str]) -> None:
    kept, dropped = limits.fit_labels(labels)
    assert len(kept) + len(dropped) == len(labels)
    wire.decode_as(msgspec.json.encode(kept), wire.Labels)  # the collector takes what is kept
    for key, value in labels.items():
        if key not in kept:
            fits = 0 < len(key) <= limits.MAX_LABEL_KEY_CHARS and len(value) <= limits.MAX_LABEL_VALUE_CHARS
            assert not fits or "\x00" in key + value or len(kept) == limits.MAX_LABELS


def test_an_agents_own_labels_and_names_are_fitted_before_they_are_sent() -> None:
    """A discovered pod's name and labels are what Kubernetes holds: the agent cuts them to fit, never sends
    them to be refused with the whole batch."""
    pod_labels = {f"k8s.label.{i:02d}": "v" for i in range(90)}
    job = ActiveJob("k8s-1", "ns/" + "p" * 400, "inference", time.time(), labels=pod_labels)
    body = wire.encode(wire.Batch(agent_id="a", seq=1, host="h", jobs=[job.to_wire()]))
    decoded = wire.decode_batch(body).jobs[0]  # decoding checks every bound
    assert len(decoded.name) == limits.MAX_NAME_CHARS and decoded.name.startswith("ns/ppp")
    assert decoded.labels == {k: "v" for k in sorted(pod_labels)[: limits.MAX_LABELS]}


def test_a_sealed_batch_leaves_out_the_agents_own_bad_records_alone(tmp_path: Path, db_engine: Engine) -> None:
    """A counter glitch's absurd energy or a scraped count beyond the bounds costs that record, not the batch."""
    from wattwatch.agent.outbox import Outbox
    from wattwatch.agent.requests import Refusals

    now = time.time()
    refusals = Refusals()
    spool = Spool(tmp_path / "spool.db")
    devices = [wire.Device(key="gpu0", kind="gpu")]
    outbox = Outbox(spool, "a1", "h1", lambda: devices, time.time, refused=refusals.add)
    good = [wire.Interval("gpu0", now - 3 + i, now - 2 + i, 300.0, "counter") for i in range(3)]
    glitch = wire.Interval("gpu0", now - 1, now, 1.7e308, "counter")
    counts = [wire.QueryCount("chat", now - 5, now, queries=7), wire.QueryCount("chat", now - 5, now, queries=2**31)]
    outbox.add(intervals=[good[0], glitch, *good[1:]], counts=counts)
    seq = outbox.seal()
    bodies = [body for _, body in spool.peek()]
    spool.close()
    sealed = wire.decode_batch(bodies[0])
    assert seq == sealed.seq and sealed.intervals == good and [c.queries for c in sealed.query_counts] == [7]
    assert refusals.counts() == {"out_of_range": 2}
    assert push_all(bodies, db_engine, tmp_path) == [200]


def test_a_staged_span_over_the_maximum_is_left_out_alone_when_the_batch_is_sealed(
    tmp_path: Path, db_engine: Engine
) -> None:
    """A part staged before the agent stopped (by a version that took any length) keeps its other records."""
    from wattwatch.agent.outbox import Outbox
    from wattwatch.agent.requests import Refusals

    now = time.time()
    refusals = Refusals()
    spool = Spool(tmp_path / "spool.db")
    devices = [wire.Device(key="gpu0", kind="gpu")]
    part = {
        "agent_id": "a1",
        "seq": 1,
        "host": "h1",
        "sent_at_s": now,
        "devices": [msgspec.to_builtins(d) for d in devices],
        "intervals": [msgspec.to_builtins(wire.Interval("gpu0", now - 2, now - 1, 300.0, "counter"))],
        "queries": [
            {"job": "chat", "t_start_s": now - 8 * 86400, "t_end_s": now - 1, "kind": "epoch"},
            {"job": "chat", "t_start_s": now - 2, "t_end_s": now - 1},
        ],
    }
    spool.stage(1, json.dumps(part).encode(), created_s=now)
    outbox = Outbox(spool, "a1", "h1", lambda: devices, time.time, refused=refusals.add)
    assert outbox.recover() == [1]
    bodies = [body for _, body in spool.peek()]
    spool.close()
    sealed = wire.decode_batch(bodies[0])
    assert [(q.t_start_s, q.kind) for q in sealed.queries] == [(now - 2, "query")] and len(sealed.intervals) == 1
    assert refusals.counts() == {"out_of_range": 1}
    assert push_all(bodies, db_engine, tmp_path) == [200]


@pytest.mark.parametrize(
    "job_id", ["train-1", "train-1\n", "ns/name:1@x", "a b", "x" * 200, "x" * 201, "\ntrain", "tr\nain", "é"]
)
def test_the_agent_takes_a_job_id_exactly_when_the_collector_would(job_id: str) -> None:
    """A job id the agent starts is one the collector decodes: else every batch holding it is set aside."""
    from wattwatch.agent.requests import parse_job_start, parse_span
    from wattwatch.errors import ConfigError

    try:
        parse_job_start({"id": job_id}, [], None)
        agent_takes = True
    except ConfigError:
        agent_takes = False
    try:
        parse_span({"job": job_id, "t_start_s": NOW - 2, "t_end_s": NOW - 1}, now_s=NOW)
        span_takes = True
    except limits.BoundError:
        span_takes = False
    job = {"id": job_id, "name": "n", "kind": "training", "started_at_s": NOW}
    try:
        msgspec.json.decode(json.dumps(job).encode(), type=wire.Job)
        collector_takes = True
    except msgspec.ValidationError:
        collector_takes = False
    assert agent_takes == span_takes == collector_takes
