"""Spans bounded in cost: a span longer than ``limits.MAX_SPAN_S`` is refused where spans enter, the
span-energy pass works at most about a second per call however long the spans in its backlog, and a
collector with a backlog stops within seconds of SIGTERM. SQLite and PostgreSQL; real collector processes
where the answer is the process's (HTTP refusals, shutdown)."""

from __future__ import annotations

import math
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from sqlalchemy import Engine, func, select

from procs import collector_process
from wattwatch.accounting.spans import split_job_energy
from wattwatch.collector.span_scheduler import FINAL_PASS_BUDGET_S, PASS_BUDGET_S, SpanEnergyScheduler
from wattwatch.protocol import limits, wire
from wattwatch.storage import repository, span_energy
from wattwatch.storage.engine import make_engine
from wattwatch.storage.spans import unpack_ticks
from wattwatch.storage.tables import job_ticks, queries, span_dirty

DAY_S = 86400.0
T0 = 1_700_000_000.0


# --- the maximum, where spans enter --------------------------------------------------------------------


def test_a_30_day_span_is_a_422_naming_its_end_and_a_6_day_span_is_taken(db_url: str, tmp_path: Path) -> None:
    now = time.time()
    # A window of 60 days back, so that a 30-day span is refused for its length, not for its start.
    with (
        collector_process(db_url, tmp_path, "--time-window-past", "60d") as (url, _proc),
        httpx.Client(base_url=url, timeout=10) as client,
    ):
        r = client.post("/api/v1/jobs", json={"id": "ft", "name": "ft", "host": "h1", "started_at_s": now - 40 * DAY_S})
        assert r.status_code == 200, r.text
        ok = {"t_start_s": now - 60, "t_end_s": now - 50}
        month = {"t_start_s": now - 30 * DAY_S - 10, "t_end_s": now - 10, "kind": "epoch"}
        r = client.post("/api/v1/jobs/ft/queries", json={"queries": [ok, month], "host": "h1"})
        assert (r.status_code, r.json()["field"]) == (422, "queries[1].t_end_s"), r.text
        assert "at most 7 d" in r.json()["error"], r.text
        # The direct route refuses the whole post; so does a batch (the agent's path) with that span.
        spans = [{"job": "ft", **ok}, {"job": "ft", **month}]
        bad = {"agent_id": "a1", "seq": 1, "host": "h1", "sent_at_s": now, "queries": spans}
        r = client.post("/api/v1/ingest", json=bad)
        assert (r.status_code, r.json()["field"]) == (422, "queries[1].t_end_s"), r.text
        assert "at most 7 d" in r.json()["error"], r.text
        week = {"t_start_s": now - 6 * DAY_S - 10, "t_end_s": now - 10, "kind": "epoch"}
        r = client.post("/api/v1/jobs/ft/queries", json={"queries": [ok, week], "host": "h1"})
        assert (r.status_code, r.json()) == (200, {"accepted": 2}), r.text
        good = wire.Batch(
            agent_id="a1", seq=1, host="h1", sent_at_s=now, queries=[wire.Query("ft", now - 60, now - 50)]
        )
        r = client.post("/api/v1/ingest", content=wire.encode(good), headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            lengths = sorted(conn.execute(select(queries.c.t_end_s - queries.c.t_start_s)).scalars())
    finally:
        engine.dispose()
    assert lengths == pytest.approx([10.0, 10.0, 6 * DAY_S])  # nothing of the refused post or batch


def test_the_sdk_check_refuses_a_span_over_the_maximum_alone_with_its_reason() -> None:
    now = time.time()
    start = now - limits.MAX_SPAN_S - 1.0
    wide = limits.TimeWindow(past_s=60 * DAY_S)
    with pytest.raises(limits.BoundError) as caught:
        limits.check_span(start, now, now_s=now, window=wide)
    assert (caught.value.field, caught.value.reason) == ("t_end_s", limits.REASON_RANGE)
    assert limits.check_span(start + 2.0, now, now_s=now, window=wide) == (start + 2.0, now, 0, 0)


# --- the pass: bounded per call ------------------------------------------------------------------------


def _interval(t_s: float, length_s: float, job: str) -> wire.Interval:
    return wire.Interval(
        device="gpu0",
        t_start_s=t_s,
        t_end_s=t_s + length_s,
        energy_j=300.0 * length_s,
        source="counter",
        shares={job: 1.0},
    )


def long_span_backlog(engine: Engine, *, start_s: float, days: float, tick_s: float = 10.0) -> list[wire.Query]:
    """A training job's ticks over ``days`` and its spans, unshared yet: one 6-day epoch starting every 6 hours
    (dozens in flight at once) and a 50 s step every minute. Returns the spans."""
    devices = [wire.Device(key="gpu0", kind="gpu", index=0)]
    job = wire.Job(id="train", name="ft", kind="training", started_at_s=start_s)
    end_s = start_s + days * DAY_S
    t_s, seq = start_s, 0
    while t_s < end_s:
        ivs = []
        while t_s < end_s and len(ivs) < 5000:
            ivs.append(_interval(t_s, tick_s, "train"))
            t_s += tick_s
        seq += 1
        b = wire.Batch(
            agent_id="a1", seq=seq, host="h1", devices=devices, intervals=ivs, jobs=[job] if seq == 1 else []
        )
        repository.ingest_batch(engine, b, received_at_s=start_s)
    epochs = [
        wire.Query("train", s, min(s + 6 * DAY_S - 1.0, end_s), kind="epoch")
        for s in (start_s + k * 6 * 3600.0 for k in range(int(days * 4)))
    ]
    steps = [
        wire.Query("train", start_s + 60.0 * k, start_s + 60.0 * k + 50.0, kind="step") for k in range(int(days * 1440))
    ]
    b = wire.Batch(agent_id="a1", seq=seq + 1, host="h1", devices=devices, queries=[*epochs, *steps])
    repository.ingest_batch(engine, b, received_at_s=start_s)
    return [*epochs, *steps]


def dense_backlog(engine: Engine, *, start_s: float, duration_s: float, rate_per_s: float) -> list[wire.Query]:
    """A server's 1 s ticks and ``rate_per_s`` requests of 2 s each, unshared yet. Returns the spans."""
    devices = [wire.Device(key="gpu0", kind="gpu", index=0)]
    job = wire.Job(id="srv", name="chat", kind="inference", started_at_s=start_s)
    spans: list[wire.Query] = []
    for k, t_s in enumerate(range(0, int(duration_s), 600)):
        ivs = [_interval(start_s + t, 1.0, "srv") for t in range(t_s, min(t_s + 600, int(duration_s)))]
        batch_spans = [
            wire.Query("srv", start_s + t_s + i / rate_per_s, start_s + t_s + i / rate_per_s + 2.0)
            for i in range(int(600 * rate_per_s))
        ]
        spans += batch_spans
        b = wire.Batch(
            agent_id="a1", seq=k + 1, host="h1", devices=devices, intervals=ivs, queries=batch_spans, jobs=[job]
        )
        repository.ingest_batch(engine, b, received_at_s=start_s)
    return spans


def truth_j(engine: Engine, job: str, spans: list[wire.Query], kind: str) -> list[float]:
    """Each span's energy by one pure split over all of the job's ticks."""
    with engine.connect() as conn:
        packed = conn.execute(select(job_ticks.c.ticks).where(job_ticks.c.job_id == job)).scalars().all()
    ticks = [tick for p in packed for tick in unpack_ticks(p)]
    of_kind = [(s.t_start_s, s.t_end_s) for s in spans if s.kind == kind]
    return split_job_energy(ticks, of_kind).span_energy_j


def stored_j(engine: Engine, job: str, kind: str) -> list[float | None]:
    """The stored energies of the job's spans of ``kind``, in the order they were sent."""
    with engine.connect() as conn:
        c = queries.c
        stmt = select(c.energy_j).where(c.job_id == job, c.kind == kind).order_by(c.id)
        return list(conn.execute(stmt).scalars())


class Timed:
    """``split_job_energy`` as the pass calls it, recording each window's length (s)."""

    def __init__(self) -> None:
        self.window_lengths_s: list[float] = []

    def __call__(self, ticks: Any, spans: Any, **kw: Any) -> Any:
        self.window_lengths_s.append(kw["window_end_s"] - kw["window_start_s"])
        return split_job_energy(ticks, spans, **kw)


def run_until_done(scheduler: SpanEnergyScheduler) -> list[float]:
    """Timed passes until the backlog is gone; the wall time (s) of each call."""
    calls_s: list[float] = []
    while True:
        started = time.monotonic()
        result = scheduler.run_once(budget_s=PASS_BUDGET_S)
        calls_s.append(time.monotonic() - started)
        if result.complete:
            return calls_s
        assert len(calls_s) < 1000, "the pass makes no progress"


# The pass starts a window only while one as long as the longest so far still fits in its budget, so a
# call overruns it by at most what one window costs beyond the longest before it; a window holds a
# minute of a server at 100 requests/s (the 2,000-span cap is a minute at least) or ten minutes of a
# training job: 0.1 s on SQLite, up to about 0.35 s on a loaded PostgreSQL, measured.
CALL_SLACK_S = 0.5


@pytest.mark.slow
def test_days_long_spans_cost_windows_of_ten_minutes_and_a_second_per_call(
    db_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    spans = long_span_backlog(db_engine, start_s=T0, days=6.5)
    timed = Timed()
    monkeypatch.setattr(span_energy, "split_job_energy", timed)
    scheduler = SpanEnergyScheduler(db_engine, clock=lambda: T0 + 6.5 * DAY_S + 100, interval_s=None, settle_s=0.0)
    calls_s = run_until_done(scheduler)
    assert max(calls_s) <= PASS_BUDGET_S + CALL_SLACK_S, calls_s
    # No window reaches back to the start of the epochs in flight at it: each covers at most a chunk.
    assert max(timed.window_lengths_s) <= span_energy.DEFAULT_CHUNK_S, max(timed.window_lengths_s)
    # Each kind's time line once (a window splits before and after its last minute edge), not once per window.
    assert sum(timed.window_lengths_s) <= 1.05 * 2 * 6.5 * DAY_S
    for kind in ("epoch", "step"):
        got, want = stored_j(db_engine, "train", kind), truth_j(db_engine, "train", spans, kind)
        assert None not in got and len(got) == len(want)
        assert all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-6) for g, w in zip(got, want, strict=True))


@pytest.mark.slow
def test_a_dense_backlog_is_worked_off_a_second_per_call(db_engine: Engine) -> None:
    spans = dense_backlog(db_engine, start_s=T0, duration_s=1800.0, rate_per_s=100.0)
    scheduler = SpanEnergyScheduler(db_engine, clock=lambda: T0 + 1900.0, interval_s=None, settle_s=0.0)
    calls_s = run_until_done(scheduler)
    assert len(calls_s) > 1  # a backlog bigger than one call's budget
    assert max(calls_s) <= PASS_BUDGET_S + CALL_SLACK_S, calls_s
    got, want = stored_j(db_engine, "srv", "query"), truth_j(db_engine, "srv", spans, "query")
    assert None not in got
    assert all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-6) for g, w in zip(got, want, strict=True))


def test_a_pass_in_progress_ends_at_its_next_window_when_told_to_stop(db_engine: Engine) -> None:
    long_span_backlog(db_engine, start_s=T0, days=1.0)
    windows = 0

    def stop() -> bool:
        nonlocal windows
        windows += 1
        return windows > 3  # asked before each window: three windows, then the stop

    result = span_energy.compute_span_energy(db_engine, now_s=T0 + DAY_S + 100, settle_s=0.0, stop=stop)
    assert (result.complete, result.windows) == (False, 3)
    with db_engine.connect() as conn:  # what is left waits for the next pass, which resumes it
        assert conn.execute(select(func.count()).select_from(span_dirty)).scalar_one() > 0
    rest = span_energy.compute_span_energy(db_engine, now_s=T0 + DAY_S + 100, settle_s=0.0)
    assert rest.complete and rest.windows > 100


def _out_of_order_long_spans(seed: int) -> tuple[list[wire.Batch], list[wire.Query], float]:
    """Four hours of a training job: 5 s ticks, overlapping epochs of 30-90 minutes and steps of 5-25 s,
    in batches shuffled so that ticks and spans arrive late, before and after passes. Returns the batches,
    the spans and the end."""
    rng = random.Random(seed)
    end_s = T0 + 4 * 3600.0
    devices = [wire.Device(key="gpu0", kind="gpu", index=0)]
    job = wire.Job(id="train", name="ft", kind="training", started_at_s=T0)
    ivs = []
    t_s = T0
    while t_s < end_s:
        step_s = rng.choice([5.0, 5.0, 2.5])
        ivs.append(
            wire.Interval(
                device="gpu0",
                t_start_s=t_s,
                t_end_s=t_s + step_s,
                energy_j=rng.uniform(100.0, 700.0) * step_s,
                source="counter",
                shares={"train": 1.0},
            )
        )
        t_s += step_s
    spans = []
    t_s = T0 - 30.0  # an epoch starting before the first tick
    while t_s < end_s:
        spans.append(wire.Query("train", t_s, t_s + rng.uniform(1800.0, 5400.0), kind="epoch"))
        t_s += rng.uniform(600.0, 2400.0)
    t_s = T0
    while t_s < end_s + 60.0:
        length_s = rng.uniform(5.0, 25.0)
        spans.append(wire.Query("train", t_s, t_s + length_s, kind="step"))
        t_s += length_s + rng.choice([0.0, 0.0, 7.0])
    batches = [
        wire.Batch(agent_id="a1", seq=0, host="h1", devices=devices, intervals=ivs[k : k + 200], jobs=[job])
        for k in range(0, len(ivs), 200)
    ]
    shuffled = spans[:]
    rng.shuffle(shuffled)
    batches += [
        wire.Batch(agent_id="a1", seq=0, host="h1", devices=devices, queries=shuffled[k : k + 40])
        for k in range(0, len(shuffled), 40)
    ]
    rng.shuffle(batches)
    return [msgspec.structs.replace(b, seq=i + 1) for i, b in enumerate(batches)], spans, end_s


@pytest.mark.parametrize("replicas", [0, 2])
def test_long_spans_arriving_in_any_order_get_the_one_pass_energies(db_engine: Engine, replicas: int) -> None:
    batches, spans, end_s = _out_of_order_long_spans(seed=7 + replicas)
    rng = random.Random(replicas)
    done = threading.Event()
    errors: list[BaseException] = []

    def replica(seed: int) -> None:
        r = random.Random(seed)
        try:
            while not done.is_set():
                span_energy.compute_span_energy(
                    db_engine, now_s=r.uniform(T0, end_s + 100), settle_s=0.0, chunk_s=r.choice([600.0, 130.0])
                )
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(k,)) for k in range(replicas)]
    for t in threads:
        t.start()
    try:
        for i, b in enumerate(batches):
            repository.ingest_batch(db_engine, b, received_at_s=T0)
            if i % 4 == 3:
                # Passes at any horizon, cut short by a budget: late data lands behind and inside carried walks.
                span_energy.compute_span_energy(
                    db_engine,
                    now_s=rng.uniform(T0, end_s + 100),
                    settle_s=0.0,
                    chunk_s=rng.choice([600.0, 130.0, 47.0]),
                    budget_s=rng.choice([None, 0.05]),
                )
    finally:
        done.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    last_s = max(s.t_end_s for s in spans)  # epochs run past the last tick
    assert span_energy.compute_span_energy(db_engine, now_s=last_s + 100, settle_s=0.0).complete
    for kind in ("epoch", "step"):
        got, want = stored_j(db_engine, "train", kind), truth_j(db_engine, "train", spans, kind)
        assert None not in got and len(got) == len(want)
        ordered = sorted(zip((s.t_start_s for s in spans if s.kind == kind), want, strict=True))
        with db_engine.connect() as conn:
            c = queries.c
            stored = sorted(tuple(r) for r in conn.execute(select(c.t_start_s, c.energy_j).where(c.kind == kind)))
        for (start_s, want_j), (start2_s, got_j) in zip(ordered, stored, strict=True):
            assert start_s == start2_s
            assert math.isclose(got_j, want_j, rel_tol=1e-9, abs_tol=1e-6), (kind, start_s, got_j, want_j)


# --- shutdown ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_collector_stops_within_3_s_of_sigterm_with_span_work_pending(db_url: str, tmp_path: Path) -> None:
    engine = make_engine(db_url)
    try:
        # Six days of epochs and steps, ending an hour ago: seconds of span work, due at once.
        long_span_backlog(engine, start_s=time.time() - 6 * DAY_S - 3600, days=6.0)
        with collector_process(db_url, tmp_path) as (_url, proc):
            time.sleep(1.5)  # the first pass starts with the collector: let it be at work
            with engine.connect() as conn:
                assert conn.execute(select(func.count()).select_from(span_dirty)).scalar_one() > 0
            sent_s = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            stopped_s = time.monotonic() - sent_s
        # The final pass had its budget and no more: work is still left for the next collector.
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(span_dirty)).scalar_one() > 0
    finally:
        engine.dispose()
    assert stopped_s < 3.0, f"{stopped_s:.2f} s; log:\n{(tmp_path / 'collector.log').read_text()[-3000:]}"
    assert FINAL_PASS_BUDGET_S <= 1.0
