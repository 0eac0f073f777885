"""The span-energy pass: share each job's energy among its spans, window by window, once data settles.

Where and when, and why there:

- Not at report time: a report reads O(jobs) rows (``span_stats``), never spans or ticks.
- Not at ingest: a job's ticks and spans come in different batches, from several hosts, in any order;
  sharing at ingest would re-read the neighbours of every batch and slow the hot path down.
- In a periodic pass (the collector's scheduler runs ``compute_span_energy`` every few seconds, and
  once more at shutdown). Ingest appends a ``span_dirty`` mark "job J changed from t on"; the pass
  recomputes each marked job over ``[w0, w1)`` and stores per-span joules and per-job stats.
  ``w1`` is the *horizon*, ``now - settle_s``: windows are computed once their data has most likely
  arrived. Correctness does not rest on that guess: data arriving later leaves a mark of its own
  and its window is recomputed.

The window. Marks say the data changed from ``a`` on. A span in flight at ``a`` started at some
``a' <= a`` and may have changed, so the window starts at ``w0`` = the minute containing the earliest
such start (minutes, because waiting energy is kept per minute and a window replaces whole minutes).
A span crossing ``w0`` ended before ``a`` (else it would be in flight at ``a``), so nothing that
changed touches it: windows never need what lies before them. Spans wholly inside ``[w0, w1)`` are
settled; spans crossing ``w1`` wait for the next window. Each window is one transaction; the
per-job stats change by difference (old energies out of sums and quantile sketch, new ones in), so
the stats always equal what the stored rows say.

Replicas: a job's window holds a PostgreSQL advisory transaction lock on the job (try-lock: another
replica already on it makes this one skip it) and consumes the marks it read (``DELETE ...
RETURNING``), so a batch committing meanwhile keeps its mark for the next pass. Recomputation is
idempotent: the same data gives the same joules. On SQLite, write transactions are serial anyway.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Row, Table, and_, bindparam, delete, exists, func, select, text, update

from wattwatch.accounting.quantiles import EnergySketch
from wattwatch.accounting.spans import bucket_floor_s, split_job_energy
from wattwatch.storage.engine import WRITE_TX
from wattwatch.storage.spans import COUNT_KIND, FROM_START_S, mark_dirty, unpack_ticks
from wattwatch.storage.tables import job_ticks, jobs, query_counts, span_dirty, span_stats, span_waiting
from wattwatch.storage.tables import queries as queries_table

DEFAULT_SETTLE_S = 5.0
# One window covers at most this much new data, so a backlog (a job's first pass, a long outage)
# becomes many short transactions instead of one that holds SQLite's write lock for minutes.
DEFAULT_CHUNK_S = 600.0
BUCKET_S = 60.0
# A recomputed energy this close to the stored one is the same number (another window cut the same
# ticks at other instants): keep the row as it is rather than rewrite it.
SAME_REL = 1e-12
_LOCK_CLASS = 0x5757  # advisory-lock namespace of this pass ("WW")


@dataclass
class PassResult:
    """What one ``compute_span_energy`` pass did."""

    jobs: int = 0  # jobs with at least one window computed
    windows: int = 0
    settled: int = 0  # span rows (or count windows) written
    skipped: int = 0  # jobs another replica was computing
    complete: bool = True  # False when the deadline cut the pass short


def compute_span_energy(
    engine: Engine,
    *,
    now_s: float,
    settle_s: float = DEFAULT_SETTLE_S,
    chunk_s: float = DEFAULT_CHUNK_S,
    budget_s: float | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> PassResult:
    """Compute per-span energies and per-job stats for every job with data older than ``now_s - settle_s``.

    Safe to run at any time, as often as wanted, from several processes. ``budget_s`` bounds the
    pass's own running time (the rest waits for the next pass).
    """
    horizon_s = now_s - settle_s
    started = monotonic()
    result = PassResult()
    with _write(engine) as conn:
        # Jobs without spans (most training runs) leave marks on every batch; nothing to compute for them.
        conn.execute(delete(span_dirty).where(~exists().where(span_stats.c.job_id == span_dirty.c.job_id)))
        due = (
            conn.execute(
                select(span_dirty.c.job_id)
                .group_by(span_dirty.c.job_id)
                .having(func.min(span_dirty.c.t_s) < horizon_s)
                .order_by(func.min(span_dirty.c.t_s), span_dirty.c.job_id)
            )
            .scalars()
            .all()
        )
    for job_id in due:
        computed = False
        while True:
            if budget_s is not None and monotonic() - started > budget_s:
                result.complete = False
                return result
            outcome = _compute_window(engine, job_id, horizon_s, chunk_s, now_s, result)
            if outcome == "locked":
                result.skipped += 1
            computed = computed or outcome in ("more", "done")
            if outcome != "more":
                break
        result.jobs += computed
    return result


@contextmanager
def _write(engine: Engine) -> Iterator[Connection]:
    with engine.connect().execution_options(**{WRITE_TX: True}) as conn, conn.begin():
        yield conn


def _try_lock(conn: Connection, job_id: str) -> bool:
    if conn.dialect.name != "postgresql":
        return True
    key = zlib.crc32(job_id.encode()) - (1 << 31)  # a signed int4
    return bool(conn.execute(text("SELECT pg_try_advisory_xact_lock(:c, :k)"), {"c": _LOCK_CLASS, "k": key}).scalar())


def _compute_window(
    engine: Engine, job_id: str, horizon_s: float, chunk_s: float, now_s: float, out: PassResult
) -> str:
    """One window of one job, in one transaction: "more" (another chunk is due), "done", "idle" or "locked"."""
    with _write(engine) as conn:
        if not _try_lock(conn, job_id):
            return "locked"
        marks = conn.execute(
            delete(span_dirty).where(span_dirty.c.job_id == job_id).returning(span_dirty.c.t_s, span_dirty.c.max_tick_s)
        ).all()
        if not marks:
            return "idle"  # another replica consumed them
        a_s = min(m.t_s for m in marks)
        stats = {r.kind: r for r in conn.execute(select(span_stats).where(span_stats.c.job_id == job_id))}
        if not stats:
            return "idle"
        max_tick_s = _max_tick_s(conn, job_id, max(m.max_tick_s for m in marks), from_start=a_s <= FROM_START_S)
        if a_s <= FROM_START_S:
            first_s = _first_data_s(conn, job_id, stats)
            if first_s is None:
                return "idle"
            a_s = max(a_s, first_s)
        if a_s >= horizon_s:
            mark_dirty(conn, {job_id: a_s})  # not settled yet: keep it for a later pass
            return "idle"
        w1 = min(horizon_s, a_s + chunk_s)
        starts = {
            kind: bucket_floor_s(_in_flight_from_s(conn, job_id, kind, r.max_span_s, a_s), BUCKET_S)
            for kind, r in stats.items()
        }
        w0_all = min(starts.values())
        t = job_ticks.c
        ticks = [
            tick
            for (packed,) in conn.execute(
                select(t.ticks).where(
                    t.job_id == job_id, t.t_start_s >= w0_all - max_tick_s, t.t_start_s < w1, t.t_end_s >= w0_all
                )
            )
            for tick in unpack_ticks(packed)
            if tick[1] >= w0_all and tick[0] < w1
        ]
        for kind, row in sorted(stats.items()):
            out.settled += _settle_kind(conn, job_id, row, ticks, starts[kind], w1, now_s)
        out.windows += 1
        next_s = _next_data_s(conn, job_id, stats, max_tick_s, w1)
        if next_s is not None:
            mark_dirty(conn, {job_id: next_s})
            return "more" if next_s < horizon_s else "done"
        return "done"


def _spans_table(kind: str) -> Table:
    return query_counts if kind == COUNT_KIND else queries_table


def _kind_filter(table: Table, job_id: str, kind: str) -> list[Any]:
    where = [table.c.job_id == job_id]
    if table is queries_table:
        where.append(table.c.kind == kind)
    return where


def _max_tick_s(conn: Connection, job_id: str, marked_s: float, *, from_start: bool) -> float:
    """The job's longest ``job_ticks`` row, kept on its jobs row from what the marks carried.

    Marks of jobs without spans are dropped unread, so when a job gets its first spans of a kind
    (``from_start``) the longest row is measured once over everything stored.
    """
    stored_s = float(conn.execute(select(jobs.c.max_tick_s).where(jobs.c.id == job_id)).scalar_one())
    longest_s = max(stored_s, marked_s)
    if from_start:
        t = job_ticks.c
        measured = conn.execute(select(func.max(t.t_end_s - t.t_start_s)).where(t.job_id == job_id)).scalar()
        longest_s = max(longest_s, float(measured or 0.0))
    if longest_s > stored_s:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(max_tick_s=longest_s))
    return longest_s


def _first_data_s(conn: Connection, job_id: str, stats: Mapping[str, Row[Any]]) -> float | None:
    """The earliest tick or span start of the job (index-ordered lookups), None when it has neither."""
    firsts = [conn.execute(select(func.min(job_ticks.c.t_start_s)).where(job_ticks.c.job_id == job_id)).scalar()]
    for kind in stats:
        table = _spans_table(kind)
        firsts.append(
            conn.execute(select(func.min(table.c.t_start_s)).where(*_kind_filter(table, job_id, kind))).scalar()
        )
    known = [float(f) for f in firsts if f is not None]
    return min(known, default=None)


def _in_flight_from_s(conn: Connection, job_id: str, kind: str, max_span_s: float, a_s: float) -> float:
    """``a_s``, or the earliest start of a span of ``kind`` in flight at ``a_s`` if earlier."""
    table = _spans_table(kind)
    c = table.c
    earliest = conn.execute(
        select(func.min(c.t_start_s)).where(
            *_kind_filter(table, job_id, kind), c.t_start_s >= a_s - max_span_s, c.t_start_s < a_s, c.t_end_s > a_s
        )
    ).scalar()
    return a_s if earliest is None else min(a_s, float(earliest))


def _next_data_s(
    conn: Connection, job_id: str, stats: Mapping[str, Row[Any]], max_tick_s: float, w1: float
) -> float | None:
    """Where the next window must start for what ``[.., w1)`` could not settle; None when nothing is left.

    ``w1`` when a tick row or a span crosses it. Otherwise the stretch up to the next tick or span start
    holds no energy and no span, so the walk jumps over it: the pass costs windows with data in them,
    never the empty time between a stray early span (a client's 1970) and the job's own ticks.
    """
    t = job_ticks.c
    crossing_tick = conn.execute(
        select(func.min(t.t_start_s)).where(t.job_id == job_id, t.t_start_s >= w1 - max_tick_s, t.t_end_s > w1)
    ).scalar()
    if crossing_tick is not None and crossing_tick < w1:
        return w1
    starts = [crossing_tick]
    for kind, row in stats.items():
        table = _spans_table(kind)
        c = table.c
        where = _kind_filter(table, job_id, kind)
        in_flight = conn.execute(
            select(c.id).where(*where, c.t_start_s >= w1 - row.max_span_s, c.t_start_s < w1, c.t_end_s > w1).limit(1)
        ).first()
        if in_flight is not None:
            return w1
        starts.append(conn.execute(select(func.min(c.t_start_s)).where(*where, c.t_start_s >= w1)).scalar())
    starts.append(conn.execute(select(func.min(t.t_start_s)).where(t.job_id == job_id, t.t_start_s >= w1)).scalar())
    known = [float(x) for x in starts if x is not None]
    return min(known) if known else None


def _settle_kind(
    conn: Connection,
    job_id: str,
    stat: Row[Any],
    ticks: Sequence[tuple[float, float, float]],
    w0: float,
    w1: float,
    now_s: float,
) -> int:
    """Share ``[w0, w1)`` among the spans of one kind; store settled spans, waiting minutes and stats."""
    kind = stat.kind
    table = _spans_table(kind)
    c = table.c
    count_col = c.queries if table is query_counts else None
    columns = [c.id, c.t_start_s, c.t_end_s, c.tokens_in, c.tokens_out, c.energy_j]
    rows = conn.execute(
        select(*columns, *([count_col] if count_col is not None else [])).where(
            *_kind_filter(table, job_id, kind),
            c.t_start_s >= w0 - stat.max_span_s,
            c.t_start_s < w1,
            c.t_end_s >= w0,
        )
    ).all()
    split = split_job_energy(
        ticks, [(r.t_start_s, r.t_end_s) for r in rows], window_start_s=w0, window_end_s=w1, bucket_s=BUCKET_S
    )
    sketch = None if kind == COUNT_KIND else EnergySketch.from_json(stat.sketch)
    spans, queries, tokens = stat.settled_spans, stat.settled_queries, stat.settled_tokens
    energy_delta: list[float] = []
    writes: list[dict[str, Any]] = []
    for r, energy_j in zip(rows, split.span_energy_j, strict=True):
        if r.t_start_s < w0 or r.t_end_s > w1:
            continue  # crosses the window's edge: settled by another window
        old_j = r.energy_j
        if old_j is None:
            spans += 1
            queries += r.queries if count_col is not None else 1
            tokens += r.tokens_in + r.tokens_out
        elif abs(energy_j - old_j) <= SAME_REL * max(abs(energy_j), abs(old_j)):
            continue
        else:
            energy_delta.append(-old_j)
            if sketch is not None:
                sketch.remove(old_j)
        energy_delta.append(energy_j)
        if sketch is not None:
            sketch.add(energy_j)
        writes.append({"b_id": r.id, "b_energy": energy_j})
    if writes:
        conn.execute(update(table).where(c.id == bindparam("b_id")).values(energy_j=bindparam("b_energy")), writes)
    waiting_delta = _replace_waiting(conn, job_id, kind, w0, w1, split.waiting_by_bucket_j)
    values: dict[str, Any] = {
        "settled_spans": spans,
        "settled_queries": queries,
        "settled_tokens": tokens,
        "settled_energy_j": math.fsum([stat.settled_energy_j, *energy_delta]),
        # A window may only move waiting energy around by rounding: never let that show as -1e-13 J.
        "waiting_energy_j": max(stat.waiting_energy_j + waiting_delta, 0.0),
        "computed_to_s": w1,
        "computed_at_s": now_s,
    }
    if sketch is not None:
        values.update(sketch=sketch.to_json(), p50_j=sketch.quantile(0.5), p95_j=sketch.quantile(0.95))
    conn.execute(update(span_stats).where(span_stats.c.job_id == job_id, span_stats.c.kind == kind).values(**values))
    return len(writes)


def _replace_waiting(
    conn: Connection, job_id: str, kind: str, w0: float, w1: float, by_bucket_j: Mapping[float, float]
) -> float:
    """Replace the waiting minutes in ``[w0, w1)``; returns new total - old total."""
    w = span_waiting.c
    in_window = and_(w.job_id == job_id, w.kind == kind, w.bucket_s >= w0, w.bucket_s < w1)
    old = conn.execute(delete(span_waiting).where(in_window).returning(w.energy_j)).scalars().all()
    new = [(b, e) for b, e in sorted(by_bucket_j.items()) if e]
    if new:
        conn.execute(
            span_waiting.insert(), [{"job_id": job_id, "kind": kind, "bucket_s": b, "energy_j": e} for b, e in new]
        )
    return math.fsum([*(e for _, e in new), *(-x for x in old)])
