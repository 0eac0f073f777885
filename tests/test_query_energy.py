"""Energy per query, per step and waiting energy: conservation, windowed recomputation, the real pipeline.

- Hypothesis: for any jobs sharing any devices and any spans, per-span energy + waiting == job energy
  (1e-9 relative), and windows add up to the one-shot split.
- SQLite and PostgreSQL: batches in any order, from several hosts, passes at arbitrary horizons (and
  concurrently, as collector replicas) store exactly what one pure pass over everything gives.
- Acceptance on the simulated GPU: p50/p95 J/query from ingest -> pass -> report within 2% of the
  exact split (fine integration of the board's true power), with 0.1 s ticks; see
  ``test_one_second_ticks_miss_two_percent`` for why 1 s ticks cannot promise that.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from test_storage import T0
from wattwatch.accounting import IntervalIn, rollup_intervals
from wattwatch.accounting.quantiles import nearest_rank
from wattwatch.accounting.spans import split_job_energy
from wattwatch.protocol import wire
from wattwatch.reporting.render import render
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.storage import repository
from wattwatch.storage.span_energy import compute_span_energy
from wattwatch.storage.tables import queries, query_counts, span_dirty

# --- pure: conservation for any jobs, devices and spans -----------------------------------------------

times = st.floats(min_value=0.0, max_value=60.0, allow_nan=False).map(lambda t: round(t, 3))
energies = st.one_of(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), st.sampled_from([0.0, 1e-9, 5e-324]))
JOBS = ("a", "b", "c")


@st.composite
def device_intervals(draw: st.DrawFn, device: str) -> list[IntervalIn]:
    """Consecutive intervals of one device (some zero-length: boundary reads), held by any jobs."""
    bounds = sorted(draw(st.lists(times, min_size=2, max_size=12)))
    out = []
    for t0, t1 in itertools.pairwise(bounds):
        held = draw(st.lists(st.sampled_from(JOBS), unique=True, max_size=3))
        shares = {j: draw(st.sampled_from([0.0, 0.3, 1.0, 7.5])) for j in held}
        idle_weight = draw(st.sampled_from([0.0, 0.0, 1.0]))
        out.append(IntervalIn(device, t0, t1, draw(energies), "counter", shares, idle_weight))
    return out


spans_st = st.lists(st.tuples(times, times).map(lambda p: (min(p), max(p))), max_size=15)


def _job_ticks(ticks_j: dict[tuple[str, float, float], float], job: str) -> list[tuple[float, float, float]]:
    return [(t0, t1, e) for (j, t0, t1), e in ticks_j.items() if j == job]


@settings(max_examples=300, deadline=None)
@given(
    devices=st.lists(st.sampled_from(["gpu0", "gpu1", "cpu0"]), min_size=1, max_size=3, unique=True).flatmap(
        lambda ds: st.tuples(*(device_intervals(d) for d in ds))
    ),
    spans=st.fixed_dictionaries({j: spans_st for j in JOBS}),
    cut_s=times,
)
def test_energy_is_conserved_for_any_jobs_devices_and_spans(
    devices: tuple[list[IntervalIn], ...], spans: dict[str, list[tuple[float, float]]], cut_s: float
) -> None:
    intervals = [iv for ivs in devices for iv in ivs]
    rollup = rollup_intervals(intervals)
    device_j = math.fsum(iv.energy_j for iv in intervals)
    jobs_j = {j: math.fsum(t.energy_j for (job, _), t in rollup.job_device.items() if job == j) for j in JOBS}
    # Devices: every joule is a job's or idle.
    assert math.fsum([*jobs_j.values(), *rollup.idle_j.values()]) == pytest.approx(device_j, rel=1e-9, abs=1e-300)
    for job in JOBS:
        ticks = _job_ticks(rollup.job_ticks_j, job)
        whole = split_job_energy(ticks, spans[job])
        assert all(e >= 0.0 for e in whole.span_energy_j) and whole.waiting_energy_j >= 0.0
        # Jobs: every joule of the job is a span's or waiting, spans partly outside the job's ticks included.
        shared_j = math.fsum([*whole.span_energy_j, whole.waiting_energy_j])
        assert shared_j == pytest.approx(jobs_j[job], rel=1e-9, abs=1e-300)
        assert whole.energy_j == pytest.approx(jobs_j[job], rel=1e-9, abs=1e-300)
        # Windows: the split before a cut plus the split after it is the whole split, span by span.
        before = split_job_energy(ticks, spans[job], window_end_s=cut_s, bucket_s=7.0)
        after = split_job_energy(ticks, spans[job], window_start_s=cut_s, bucket_s=7.0)
        scale = max(jobs_j[job], 1e-300)
        for i, e in enumerate(whole.span_energy_j):
            assert before.span_energy_j[i] + after.span_energy_j[i] == pytest.approx(e, rel=1e-9, abs=1e-9 * scale)
        waiting_j = before.waiting_energy_j + after.waiting_energy_j
        assert waiting_j == pytest.approx(whole.waiting_energy_j, rel=1e-9, abs=1e-9 * scale)
        buckets_j = math.fsum([*before.waiting_by_bucket_j.values(), *after.waiting_by_bucket_j.values()])
        assert buckets_j == pytest.approx(waiting_j, rel=1e-9, abs=1e-300)


# --- storage: windowed, out-of-order, multi-host, replicated == one pure pass -----------------------------


@dataclass
class Workload:
    """Agent batches (intervals, job records, spans, counts) and the truth to compare against."""

    batches: list[wire.Batch] = field(default_factory=list)
    intervals: dict[str, list[IntervalIn]] = field(default_factory=dict)  # per host
    spans: list[wire.Query] = field(default_factory=list)
    counts: list[wire.QueryCount] = field(default_factory=list)
    end_s: float = 0.0


def make_workload(seed: int, duration_s: float = 400.0) -> Workload:
    """Three jobs on two hosts: a server on both hosts (queries), a job sharing a GPU by weight
    (queries), a training run (steps inside epochs), and a counts-only server; spans and counts come
    in their own batches, from an SDK-like agent, apart from the intervals they share."""
    rng = random.Random(seed)
    w = Workload(end_s=T0 + duration_s)
    devices = [wire.Device(key=f"gpu{i}", kind="gpu", index=i) for i in range(2)]
    job_records = [
        wire.Job(id="srv", name="chat", kind="inference", started_at_s=T0),
        wire.Job(id="mix", name="embed", kind="inference", started_at_s=T0),
        wire.Job(id="train", name="ft", kind="training", started_at_s=T0),
        wire.Job(id="cnt", name="vllm", kind="inference", started_at_s=T0),
    ]
    holders = {("h1", "gpu0"): {"srv": 1.0}, ("h2", "gpu0"): {"srv": 1.0}, ("h2", "gpu1"): {"cnt": 1.0}}
    for host in ("h1", "h2"):
        ivs: list[wire.Interval] = []
        for dev in devices:
            t = T0
            while t < w.end_s:
                # Ticks of about a second, sometimes cut short by a boundary read, sometimes a point read.
                step = rng.choice([1.0, 1.0, 1.0, 0.37, 0.0]) if t > T0 else 1.0
                t1 = min(t + step, w.end_s)
                shares = holders.get((host, dev.key)) or {"mix": rng.uniform(0.1, 1), "train": rng.uniform(0.1, 1)}
                energy_j = rng.uniform(50.0, 700.0) * max(t1 - t, 0.01)
                ivs.append(
                    wire.Interval(
                        device=dev.key, t_start_s=t, t_end_s=t1, energy_j=energy_j, source="simulated", shares=shares
                    )
                )
                t = t1
        w.intervals[host] = [
            IntervalIn(iv.device, iv.t_start_s, iv.t_end_s, iv.energy_j, iv.source, iv.shares) for iv in ivs
        ]
        ivs.sort(key=lambda iv: iv.t_start_s)
        for seq, k in enumerate(range(0, len(ivs), 150)):
            w.batches.append(
                wire.Batch(
                    agent_id=f"agent-{host}",
                    seq=seq,
                    host=host,
                    devices=devices,
                    jobs=job_records,
                    intervals=ivs[k : k + 150],
                )
            )
    for job, rate_hz in (("srv", 6.0), ("mix", 2.0)):
        t = T0 - 3.0  # some spans start before the job's first tick
        while t < w.end_s + 2.0:  # and some end after its last
            t += rng.expovariate(rate_hz)
            d = rng.choice([0.0, rng.uniform(0.05, 2.5)])
            w.spans.append(wire.Query(job=job, t_start_s=t, t_end_s=t + d, tokens_in=rng.randint(0, 500), tokens_out=9))
    t = T0 + 0.5
    for _ in range(3):
        epoch_start = t
        while t < epoch_start + 120.0:
            d = rng.uniform(0.4, 1.2)
            w.spans.append(wire.Query(job="train", t_start_s=t, t_end_s=t + d, kind="step"))
            t += d + rng.choice([0.0, 0.05])
        w.spans.append(wire.Query(job="train", t_start_s=epoch_start, t_end_s=t, kind="epoch"))
        t += 3.0  # evaluation between epochs: energy outside any step
    for t in range(int(T0), int(w.end_s), 15):
        w.counts.append(wire.QueryCount(job="cnt", t_start_s=t, t_end_s=t + 15.0, queries=rng.randint(0, 40)))
    rng.shuffle(w.spans)
    for seq, k in enumerate(range(0, len(w.spans), 200)):
        counts = w.counts[k // 20 : k // 20 + 10]
        w.batches.append(
            wire.Batch(agent_id="sdk", seq=seq, host="h1", queries=w.spans[k : k + 200], query_counts=counts)
        )
    rng.shuffle(w.batches)
    return w


def expected_split(w: Workload) -> dict[tuple[str, str], tuple[list[tuple[float, float, float]], float]]:
    """One pure pass over everything: per (job, kind), sorted (start, end, J) of every span, and waiting J."""
    ticks: list[tuple[str, float, float, float]] = []
    for ivs in w.intervals.values():
        ticks += [(j, t0, t1, e) for (j, t0, t1), e in rollup_intervals(ivs).job_ticks_j.items()]
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for q in w.spans:
        spans.setdefault((q.job, q.kind), []).append((q.t_start_s, q.t_end_s))
    for c in w.counts:
        spans.setdefault((c.job, "count"), []).append((c.t_start_s, c.t_end_s))
    out = {}
    for (job, kind), ss in spans.items():
        split = split_job_energy([(t0, t1, e) for j, t0, t1, e in ticks if j == job], ss)
        out[(job, kind)] = (
            sorted((s, e, x) for (s, e), x in zip(ss, split.span_energy_j, strict=True)),
            split.waiting_energy_j,
        )
    return out


def stored_spans(engine: Engine, job: str, kind: str) -> list[tuple[float, float, float]]:
    table = query_counts if kind == "count" else queries
    where = [table.c.job_id == job] + ([table.c.kind == kind] if table is queries else [])
    with engine.connect() as conn:
        rows = conn.execute(select(table.c.t_start_s, table.c.t_end_s, table.c.energy_j).where(*where)).all()
    return sorted((r.t_start_s, r.t_end_s, r.energy_j) for r in rows)


def check_against_truth(engine: Engine, w: Workload) -> dict[str, dict[str, Any]]:
    """Every stored energy equals the one-pure-pass truth; the report's figures follow from them."""
    truth = expected_split(w)
    report = {j["id"]: j for j in repository.build_report(engine, now_s=w.end_s + 100)["jobs"]}
    for (job, kind), (expected, waiting_j) in truth.items():
        got = stored_spans(engine, job, kind)
        assert len(got) == len(expected)
        for (s, e, x), (s2, e2, x2) in zip(got, expected, strict=True):
            assert (s, e) == (s2, e2)
            assert x == pytest.approx(x2, rel=1e-9, abs=1e-9), (job, kind, s, e)
        entry = report[job]
        settled_j = math.fsum(x for *_, x in expected)
        # Conservation through storage: the settled spans' energy + waiting == the job's measured energy.
        assert settled_j + waiting_j == pytest.approx(entry["energy_j"], rel=1e-9)
        energies = [x for *_, x in expected]
        if kind == "query":
            assert entry["query_method"] == "spans"
            assert entry["queries"] == entry["queries_settled"] == len(expected)
            assert entry["energy_per_query_j"] == pytest.approx(settled_j / len(expected), rel=1e-9)
            assert entry["waiting_energy_j"] == pytest.approx(waiting_j, rel=1e-9, abs=1e-6)
            assert entry["energy_per_query_p50_j"] == pytest.approx(nearest_rank(energies, 0.5), rel=0.002)
            assert entry["energy_per_query_p95_j"] == pytest.approx(nearest_rank(energies, 0.95), rel=0.002)
        elif kind == "step":
            assert entry["steps"] == entry["steps_settled"] == len(expected)
            assert entry["energy_per_step_j"] == pytest.approx(settled_j / len(expected), rel=1e-9)
            assert entry["energy_per_step_p95_j"] == pytest.approx(nearest_rank(energies, 0.95), rel=0.002)
        elif kind == "epoch":
            assert entry["epochs"] == 3
            assert entry["energy_per_epoch_j"] == pytest.approx(settled_j / 3, rel=1e-9)
        else:
            n = sum(c.queries for c in w.counts)
            assert (entry["query_method"], entry["queries"], entry["energy_per_query_p50_j"]) == ("counts", n, None)
            assert entry["energy_per_query_j"] == pytest.approx(settled_j / n, rel=1e-9)
            assert entry["waiting_energy_j"] == pytest.approx(waiting_j, rel=1e-9, abs=1e-6)
    assert report["train"]["queries"] == 0 and report["train"]["query_method"] is None
    with engine.connect() as conn:
        assert conn.execute(select(span_dirty.c.id)).first() is None  # nothing left to compute
    return report


def test_out_of_order_batches_and_passes_at_any_horizon_give_the_one_pass_result(db_engine: Engine) -> None:
    w = make_workload(seed=11)
    rng = random.Random(3)
    for i, b in enumerate(w.batches):
        repository.ingest_batch(db_engine, b, received_at_s=T0)
        if i % 3 == 2:
            # A pass at an arbitrary point in time, in short chunks: late batches must redo their windows.
            compute_span_energy(db_engine, now_s=rng.uniform(T0, w.end_s + 30), settle_s=5.0, chunk_s=47.0)
    result = compute_span_energy(db_engine, now_s=w.end_s + 100, settle_s=0.0)
    assert result.complete and result.skipped == 0
    report = check_against_truth(db_engine, w)
    # Idempotent: another pass changes nothing.
    assert compute_span_energy(db_engine, now_s=w.end_s + 200, settle_s=0.0).windows == 0
    assert repository.build_report(db_engine, now_s=w.end_s + 100)["jobs"] == list(report.values())


def test_concurrent_passes_like_collector_replicas(db_engine: Engine) -> None:
    w = make_workload(seed=5, duration_s=200.0)
    done = threading.Event()
    errors: list[BaseException] = []

    def replica(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not done.is_set():
                compute_span_energy(db_engine, now_s=rng.uniform(T0, w.end_s + 10), settle_s=0.0, chunk_s=30.0)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for b in w.batches:
            repository.ingest_batch(db_engine, b, received_at_s=T0)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    # Steps run past the last tick (to about T0 + 370 s): a horizon past them settles them too.
    compute_span_energy(db_engine, now_s=w.end_s + 1000, settle_s=0.0)
    check_against_truth(db_engine, w)


# --- acceptance: simulated GPU, exact split by fine integration -----------------------------------------

SIM_DURATION_S = 240.0


@dataclass
class Simulated:
    """An inference job on board 0 of a simulated fleet (board 1 idles), its spans, and the exact split."""

    fleet: SimulatedFleet
    spans: list[tuple[float, float]]
    exact_j: list[float]
    exact_waiting_j: float


def simulate(seed: int) -> Simulated:
    fleet = SimulatedFleet(2, seed=seed, clock=lambda: T0)
    fleet.set_activity(0, "inference", T0)
    rng = random.Random(seed)
    spans = []
    t = T0 + 0.5
    while True:  # about 4 requests/s, 0.2-1.5 s each: typically 2-4 in flight
        t += rng.expovariate(4.0)
        d = rng.uniform(0.2, 1.5)
        if t + d >= T0 + SIM_DURATION_S:
            break
        spans.append((t, t + d))
    # Exact split: the board's true power integrated by the midpoint rule on 1 ms steps (its power is
    # constant on 10 ms slots), each step's energy shared by the requests in flight at its midpoint.
    dt_s = 0.001
    by_start = sorted(range(len(spans)), key=lambda i: spans[i][0])
    by_end = sorted(range(len(spans)), key=lambda i: spans[i][1])
    exact_j = [0.0] * len(spans)
    waiting_j = 0.0
    in_flight: set[int] = set()
    si = ei = 0
    for k in range(int(SIM_DURATION_S / dt_s)):
        mid_s = T0 + (k + 0.5) * dt_s
        while si < len(by_start) and spans[by_start[si]][0] <= mid_s:
            in_flight.add(by_start[si])
            si += 1
        while ei < len(by_end) and spans[by_end[ei]][1] <= mid_s:
            in_flight.discard(by_end[ei])
            ei += 1
        step_j = fleet.power_w(0, mid_s) * dt_s
        if in_flight:
            for i in in_flight:
                exact_j[i] += step_j / len(in_flight)
        else:
            waiting_j += step_j
    return Simulated(fleet, spans, exact_j, waiting_j)


def tick_intervals(sim: Simulated, tick_s: float) -> list[wire.Interval]:
    """What an agent reading the boards' counters every ``tick_s`` sends (exact energies, no quantisation)."""
    out = []
    for k in range(round(SIM_DURATION_S / tick_s)):
        t0, t1 = T0 + k * tick_s, T0 + (k + 1) * tick_s
        for index, shares in ((0, {"srv": 1.0}), (1, {})):
            energy_j = sim.fleet.exact_energy_j(index, t0, t1)
            out.append(
                wire.Interval(
                    device=f"gpu{index}", t_start_s=t0, t_end_s=t1, energy_j=energy_j, source="simulated", shares=shares
                )
            )
    return out


@pytest.fixture(scope="module")
def sim() -> Simulated:
    return simulate(seed=2)


def test_p50_p95_per_query_within_two_percent_through_ingest_pass_and_report(db_engine: Engine, sim: Simulated) -> None:
    devices = [wire.Device(key=f"gpu{i}", kind="gpu", index=i) for i in range(2)]
    job = wire.Job(id="srv", name="llm-serve", kind="inference", started_at_s=T0, ended_at_s=T0 + SIM_DURATION_S)
    intervals = tick_intervals(sim, 0.1)
    batches = [
        wire.Batch(
            agent_id="node", seq=k, host="gpu-node", devices=devices, jobs=[job], intervals=intervals[i : i + 500]
        )
        for k, i in enumerate(range(0, len(intervals), 500))
    ]
    spans = [wire.Query(job="srv", t_start_s=s, t_end_s=e, tokens_in=200, tokens_out=50) for s, e in sim.spans]
    batches += [
        wire.Batch(agent_id="sdk", seq=k, host="gpu-node", queries=spans[i : i + 100])
        for k, i in enumerate(range(0, len(spans), 100))
    ]
    random.Random(1).shuffle(batches)  # spans and intervals arrive apart, in any order
    for k, b in enumerate(batches):
        repository.ingest_batch(db_engine, b, received_at_s=T0 + SIM_DURATION_S)
        if k % 4 == 3:
            compute_span_energy(db_engine, now_s=T0 + 20 * k, settle_s=5.0)
    compute_span_energy(db_engine, now_s=T0 + SIM_DURATION_S + 60)
    (entry,) = repository.build_report(db_engine, job_id="srv", now_s=T0 + 1000)["jobs"]
    exact = sim.exact_j
    p50, p95 = nearest_rank(exact, 0.5), nearest_rank(exact, 0.95)
    assert p50 is not None and p95 is not None
    print(
        f"\n{len(exact)} queries, 0.1 s ticks: p50 {entry['energy_per_query_p50_j']:.2f} J vs exact {p50:.2f} J "
        f"({entry['energy_per_query_p50_j'] / p50 - 1:+.2%}), p95 {entry['energy_per_query_p95_j']:.2f} J vs "
        f"{p95:.2f} J ({entry['energy_per_query_p95_j'] / p95 - 1:+.2%}), waiting {entry['waiting_energy_j']:.0f} J "
        f"vs {sim.exact_waiting_j:.0f} J"
    )
    assert (entry["query_method"], entry["queries"], entry["queries_settled"]) == ("spans", len(exact), len(exact))
    assert entry["energy_per_query_p50_j"] == pytest.approx(p50, rel=0.02)
    assert entry["energy_per_query_p95_j"] == pytest.approx(p95, rel=0.02)
    assert entry["energy_per_query_j"] == pytest.approx(math.fsum(exact) / len(exact), rel=0.005)
    assert entry["energy_per_token_j"] == pytest.approx(math.fsum(exact) / (250 * len(exact)), rel=0.005)
    assert entry["waiting_energy_j"] == pytest.approx(sim.exact_waiting_j, rel=0.02)
    # Exact conservation through the pipeline: queries + waiting == the job's measured energy.
    total_j = entry["energy_per_query_j"] * entry["queries"] + entry["waiting_energy_j"]
    assert total_j == pytest.approx(entry["energy_j"], rel=1e-9)


@pytest.mark.parametrize(("tick_s", "within"), [(0.1, 0.02), (0.5, 0.04), (1.0, 0.08)])
def test_one_second_ticks_miss_two_percent(sim: Simulated, tick_s: float, within: float) -> None:
    """Inside a tick the job's power is taken as constant, but this board swings from ~100 W (between
    requests) to ~700 W (prefill) many times a second. Averaging over the tick pulls every query's energy
    toward the mean: p95 comes out low and p50 high. With 1 s ticks that costs up to ~6% at p95 over the
    seeds tried (benchmarks/query_energy.py); 0.1 s, the NVML counter's own update period, keeps p50 and
    p95 within ~1%. Agents that want per-query figures within 2% tick at 0.1-0.2 s (or read the
    counter at span boundaries, as they do at job boundaries)."""
    ticks = [(iv.t_start_s, iv.t_end_s, iv.energy_j) for iv in tick_intervals(sim, tick_s) if iv.shares]
    split = split_job_energy(ticks, sim.spans)
    errors = []
    for q in (0.5, 0.95):
        got, exact = nearest_rank(split.span_energy_j, q), nearest_rank(sim.exact_j, q)
        assert got is not None and exact is not None
        errors.append(got / exact - 1)
    print(f"\n{tick_s} s ticks: p50 {errors[0]:+.2%}, p95 {errors[1]:+.2%}")
    assert max(map(abs, errors)) <= within


def test_renderings_show_p50_p95_per_query_where_present(db_engine: Engine) -> None:
    repository.ingest_batch(
        db_engine,
        wire.Batch(
            agent_id="a",
            seq=1,
            host="h1",
            devices=[wire.Device(key="gpu0", kind="gpu")],
            jobs=[wire.Job(id="srv", name="chat", kind="inference", started_at_s=T0, ended_at_s=T0 + 10)],
            intervals=[
                wire.Interval(
                    device="gpu0",
                    t_start_s=T0 + t,
                    t_end_s=T0 + t + 1,
                    energy_j=100.0,
                    source="counter",
                    shares={"srv": 1.0},
                )
                for t in range(10)
            ],
            queries=[wire.Query(job="srv", t_start_s=T0 + t, t_end_s=T0 + t + 1) for t in range(0, 10, 2)],
        ),
        received_at_s=T0 + 11,
    )
    compute_span_energy(db_engine, now_s=T0 + 100)
    report = repository.build_report(db_engine, now_s=T0 + 100)
    table = render(report, "table")
    header, row = table.splitlines()[:2]
    assert header.split() == [
        "JOB", "NAME", "KIND", "STATUS", "DURATION", "ENERGY", "GPU", "CPU", "AVG", "W", "PEAK", "W", "QUERIES",
        "J/QUERY", "P50", "J/Q", "P95", "J/Q", "WAITING", "CO2e", "g", "SOURCES",
    ]  # fmt: skip
    # 5 queries; J/query, p50, p95 (rounded for display) and waiting.
    assert row.split()[13:22] == ["5", "100", "J", "100", "J", "100", "J", "500", "J"]
    assert "| P50 J/Q | P95 J/Q |" in render(report, "markdown")
    lines = render(report, "csv").splitlines()
    fields = dict(zip(lines[0].split(","), lines[1].split(","), strict=True))
    assert (fields["query_method"], fields["waiting_energy_j"], fields["steps"]) == ("spans", "500.0", "0")
    assert float(fields["energy_per_query_p95_j"]) == pytest.approx(100.0, rel=0.002)
    # A training report keeps its narrow table.
    no_queries = {"energy_per_query_p50_j": None, "energy_per_query_p95_j": None, "waiting_energy_j": None}
    assert "P50" not in render({"jobs": [{**report["jobs"][0], **no_queries}]}, "table")
