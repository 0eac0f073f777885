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

The carry. Sharing is local in time, so a span's energy is the sum of its shares in consecutive
windows. A window stores, per kind, the last minute edge ``p`` it reached and the energy every span in
flight at ``p`` got before it (``span_stats.carry``); the next window starts at ``p`` and adds on, so
a span of days costs its windows once each, never a walk from its start per window (quadratic in
its length). The carry holds while no data before ``p`` changed: a mark before ``p``
(late data, a new span reaching back) makes the window look back for spans in flight, as above.
Spans in flight at ``p`` that this walk does not own (they crossed its first window's start, and ended
before the data that changed) are carried too, by id, so the next window shares among them without
looking back; a mark before their end voids the carry.

Cost per call. A window covers at most ``chunk_s`` from its start (not from the mark), so its cost is
that of the data in it, whatever the length of the spans crossing it. ``compute_span_energy`` checks
its budget (and ``stop``) before every window, and what it leaves is the marks the next call resumes
from.

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

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    Table,
    delete,
    exists,
    func,
    select,
    text,
    update,
)

from wattwatch.accounting.quantiles import EnergySketch
from wattwatch.accounting.spans import bucket_floor_s, split_job_energy
from wattwatch.storage.engine import WRITE_TX
from wattwatch.storage.span_writes import replace_waiting, store_energies
from wattwatch.storage.spans import COUNT_KIND, FROM_START_S, mark_dirty, unpack_ticks
from wattwatch.storage.tables import job_ticks, jobs, query_counts, span_dirty, span_stats
from wattwatch.storage.tables import queries as queries_table

DEFAULT_SETTLE_S = 5.0
# One window covers at most this much new data, so a backlog (a job's first pass, a long outage)
# becomes many short transactions instead of one that holds SQLite's write lock for minutes.
DEFAULT_CHUNK_S = 600.0
BUCKET_S = 60.0
# A window ends before the minute holding its kind's 2001st span start, a minute at least: sharing and
# storing a span costs 20 to 50 us, so a minute of a server at 100 requests/s is a window of 0.1 to 0.3 s,
# where ten minutes of it take 1.3 s on SQLite (a pass's budget is checked between windows).
MAX_WINDOW_SPANS = 2000
# A recomputed energy this close to the stored one is the same number (another window cut the same
# ticks at other instants): keep the row as it is rather than rewrite it.
SAME_REL = 1e-12
_LOCK_CLASS = 0x5757  # advisory-lock namespace of this pass ("WW")
# The ``max_tick_s`` of a mark the pass leaves for itself: "resume the walk here", not "data changed here"
# (ingest's marks carry a length, never negative). A carry survives the first, not the second.
RESUME_MARK = -1.0


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
    stop: Callable[[], bool] | None = None,
) -> PassResult:
    """Compute per-span energies and per-job stats for every job with data older than ``now_s - settle_s``.

    Safe to run at any time, as often as wanted, from several processes. ``budget_s`` bounds the
    pass's own running time: it is checked before every window (one window costs at most ``chunk_s``
    of the job's data), and the rest waits for the next pass. ``stop`` returning True ends the pass
    the same way (a collector shutting down).
    """
    horizon_s = now_s - settle_s
    started = monotonic()
    result = PassResult()

    longest_window_s = 0.0

    def out_of_time() -> bool:
        # A window is started only if one as long as the longest so far still fits in the budget.
        late = budget_s is not None and monotonic() - started + longest_window_s > budget_s
        return late or (stop is not None and stop())

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
            if out_of_time():
                result.complete = False
                return result
            window_started = monotonic()
            outcome = _compute_window(engine, job_id, horizon_s, chunk_s, now_s, result)
            longest_window_s = max(longest_window_s, monotonic() - window_started)
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


@dataclass
class _Carry:
    """Where a job's walk stands for one kind (``span_stats.carry``; the module docstring says why).

    ``to_s`` is a minute edge; ``partial_j`` the energy each span this walk owns got before ``to_s``,
    for every such span in flight there; ``foreign`` the ids of the other spans in flight there, and
    ``foreign_until_s`` the latest end among them.
    """

    to_s: float
    partial_j: dict[int, float]
    foreign: list[int]
    foreign_until_s: float

    @classmethod
    def load(cls, value: Any) -> _Carry | None:
        """The carry stored as ``value`` (None: there is none)."""
        if not value:
            return None
        return cls(
            float(value["to_s"]),
            {int(k): float(v) for k, v in value["partial_j"].items()},
            [int(i) for i in value["foreign"]],
            -math.inf if value["foreign_until_s"] is None else float(value["foreign_until_s"]),
        )

    def dump(self) -> dict[str, Any]:
        """The JSON value stored in ``span_stats.carry``."""
        return {
            "to_s": self.to_s,
            "partial_j": {str(k): v for k, v in sorted(self.partial_j.items())},
            "foreign": sorted(self.foreign),
            # JSON has no infinity: None when there is no foreign span.
            "foreign_until_s": self.foreign_until_s if self.foreign else None,
        }

    def holds_for_change_at(self, changed_s: float) -> bool:
        """Whether the carry is still true with data changed from ``changed_s`` on: the energies it holds
        were shared from data before ``to_s``, and its foreign spans' from data before their ends."""
        return self.to_s <= changed_s and self.foreign_until_s <= changed_s


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
        # Where data changed (ingest's marks), as against where the walk resumes (its own marks).
        changed_s = min((m.t_s for m in marks if m.max_tick_s != RESUME_MARK), default=math.inf)
        stats = {r.kind: r for r in conn.execute(select(span_stats).where(span_stats.c.job_id == job_id))}
        if not stats:
            return "idle"
        fresh = a_s <= FROM_START_S
        max_tick_s = _max_tick_s(conn, job_id, max(m.max_tick_s for m in marks), from_start=fresh)
        if fresh:
            first_s = _first_data_s(conn, job_id, stats)
            if first_s is None:
                return "idle"
            a_s = max(a_s, first_s)
        if a_s >= horizon_s:
            # Not settled yet: keep the marks (as few, of the same meaning) for a later pass.
            if changed_s < math.inf:
                mark_dirty(conn, {job_id: max(changed_s, a_s)})
            if changed_s > a_s:
                _mark_resume(conn, job_id, a_s)
            return "idle"
        starts: dict[str, float] = {}
        carries: dict[str, _Carry | None] = {}
        a_floor_s = bucket_floor_s(a_s, BUCKET_S)
        for kind, r in stats.items():
            carry = None if fresh else _Carry.load(r.carry)
            if not fresh and r.computed_to_s is not None and a_floor_s > r.computed_to_s:
                # The walk passed its last window with nothing in flight (a span crossing that window's end
                # would have left a mark there), and nothing marked since starts before a_s: no span of
                # the kind is in flight at the minute of a_s, so start there without looking back.
                starts[kind], carries[kind] = a_floor_s, _Carry(a_floor_s, {}, [], -math.inf)
            elif carry is not None and carry.to_s <= a_s and carry.holds_for_change_at(changed_s):
                starts[kind], carries[kind] = carry.to_s, carry
            else:
                starts[kind] = bucket_floor_s(_in_flight_from_s(conn, job_id, kind, r.max_span_s, a_s), BUCKET_S)
                carries[kind] = None
        w0_all = min(starts.values())
        # From the window's start, not only from the mark: a window pushed back to a long span's start
        # covers chunk_s (a minute at least, so that the carry's minute moves on), never the span.
        w1 = min(horizon_s, a_s + chunk_s, w0_all + max(chunk_s, BUCKET_S))
        for kind in stats:
            w1 = min(w1, _crowded_end_s(conn, job_id, kind, starts[kind]))
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
        crossing = False
        for kind, row in sorted(stats.items()):
            if starts[kind] >= w1:
                crossing = True  # this kind waits for a later window: keep the walk going
                continue
            settled, crosses = _settle_kind(conn, job_id, row, ticks, starts[kind], w1, now_s, carries[kind])
            out.settled += settled
            crossing = crossing or crosses
        out.windows += 1
        next_s = w1 if crossing else _next_data_s(conn, job_id, stats, max_tick_s, w1)
        if next_s is not None:
            _mark_resume(conn, job_id, next_s)
            return "more" if next_s < horizon_s else "done"
        return "done"


def _crowded_end_s(conn: Connection, job_id: str, kind: str, w0: float) -> float:
    """Where a window from ``w0`` must end to hold at most ``MAX_WINDOW_SPANS`` span starts of ``kind``
    (the minute of the next one; a minute at least, however many it holds); infinity if it may go on."""
    table = _spans_table(kind)
    c = table.c
    nth_s = conn.execute(
        select(c.t_start_s)
        .where(*_kind_filter(table, job_id, kind), c.t_start_s >= w0)
        .order_by(c.t_start_s)
        .offset(MAX_WINDOW_SPANS)
        .limit(1)
    ).scalar()
    return math.inf if nth_s is None else max(bucket_floor_s(float(nth_s), BUCKET_S), w0 + BUCKET_S)


def _mark_resume(conn: Connection, job_id: str, t_s: float) -> None:
    """Leave the mark the walk resumes from (``RESUME_MARK``: no data changed there)."""
    conn.execute(span_dirty.insert().values(job_id=job_id, t_s=t_s, max_tick_s=RESUME_MARK))


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
    """Where the next window must start, no span crossing ``w1``; None when nothing is left.

    ``w1`` when a tick row crosses it. Otherwise the stretch up to the next tick or span start holds no
    energy and no span, so the walk jumps over it: the pass costs windows with data in them, never the
    empty time between a stray early span (a client's 1970) and the job's own ticks. (Spans crossing
    ``w1`` are among the window's own rows: ``_settle_kind`` tells.)
    """
    t = job_ticks.c
    crossing_tick = conn.execute(
        select(func.min(t.t_start_s)).where(t.job_id == job_id, t.t_start_s >= w1 - max_tick_s, t.t_end_s > w1)
    ).scalar()
    if crossing_tick is not None and crossing_tick < w1:
        return w1
    starts = [crossing_tick]
    for kind in stats:
        table = _spans_table(kind)
        c = table.c
        starts.append(
            conn.execute(
                select(func.min(c.t_start_s)).where(*_kind_filter(table, job_id, kind), c.t_start_s >= w1)
            ).scalar()
        )
    starts.append(conn.execute(select(func.min(t.t_start_s)).where(t.job_id == job_id, t.t_start_s >= w1)).scalar())
    known = [float(x) for x in starts if x is not None]
    return min(known) if known else None


# Ids per IN list: well under SQLite's bound parameters, and one short statement on PostgreSQL.
_IDS_PER_QUERY = 500


def _window_rows(
    conn: Connection, job_id: str, stat: Row[Any], w0: float, w1: float, carry: _Carry | None
) -> list[Row[Any]]:
    """The spans of one kind in flight somewhere in ``[w0, w1)``.

    With a carry at ``w0`` those are the spans it names and the spans starting in the window (index
    lookups, whatever the kind's longest span); without one, every span starting up to the kind's
    longest span before ``w0`` that ends after it (the look-back a carry saves).
    """
    kind = stat.kind
    table = _spans_table(kind)
    c = table.c
    columns = [c.id, c.t_start_s, c.t_end_s, c.tokens_in, c.tokens_out, c.energy_j]
    if table is query_counts:
        columns.append(c.queries)
    where = _kind_filter(table, job_id, kind)
    if carry is None:
        return list(
            conn.execute(
                select(*columns).where(*where, c.t_start_s >= w0 - stat.max_span_s, c.t_start_s < w1, c.t_end_s >= w0)
            )
        )
    rows = list(conn.execute(select(*columns).where(*where, c.t_start_s >= w0, c.t_start_s < w1)))
    ids = sorted({*carry.partial_j, *carry.foreign})
    for i in range(0, len(ids), _IDS_PER_QUERY):
        # By id alone: with the job's filter beside it PostgreSQL scans the job's spans for the ids.
        rows.extend(conn.execute(select(*columns).where(c.id.in_(ids[i : i + _IDS_PER_QUERY]))))
    return rows


def _settle_kind(
    conn: Connection,
    job_id: str,
    stat: Row[Any],
    ticks: Sequence[tuple[float, float, float]],
    w0: float,
    w1: float,
    now_s: float,
    carry: _Carry | None,
) -> tuple[int, bool]:
    """Share ``[w0, w1)`` among the spans of one kind; store settled spans, waiting minutes, stats and the
    carry at the window's last minute edge. Returns (rows written, whether a span crosses ``w1``)."""
    kind = stat.kind
    table = _spans_table(kind)
    c = table.c
    count_col = c.queries if table is query_counts else None
    rows = _window_rows(conn, job_id, stat, w0, w1, carry)
    spans = [(r.t_start_s, r.t_end_s) for r in rows]
    # Split at the last minute edge p of the window: what each span got before p is the carry the next
    # window (which starts at p: waiting energy is kept per whole minute) adds on to.
    p = max(w0, bucket_floor_s(w1, BUCKET_S))
    before = split_job_energy(ticks, spans, window_start_s=w0, window_end_s=p, bucket_s=BUCKET_S)
    after = split_job_energy(ticks, spans, window_start_s=p, window_end_s=w1, bucket_s=BUCKET_S)
    base_j = carry.partial_j if carry is not None else {}
    sketch = None if kind == COUNT_KIND else EnergySketch.from_json(stat.sketch)
    settled_spans, queries, tokens = stat.settled_spans, stat.settled_queries, stat.settled_tokens
    energy_delta: list[float] = []
    writes: list[dict[str, Any]] = []
    next_carry = _Carry(p, {}, [], -math.inf)
    crossing = False
    for r, before_j, after_j in zip(rows, before.span_energy_j, after.span_energy_j, strict=True):
        # Owned: it starts in this window, or the carry brought its energy so far. Any other span crossing
        # w0 ended before the data that changed: its energy stands, and it only shares the window.
        owned = r.t_start_s >= w0 or r.id in base_j
        crossing = crossing or r.t_start_s < w1 < r.t_end_s
        if r.t_start_s < p < r.t_end_s:
            if owned:
                next_carry.partial_j[r.id] = base_j.get(r.id, 0.0) + before_j
            else:
                next_carry.foreign.append(r.id)
                next_carry.foreign_until_s = max(next_carry.foreign_until_s, r.t_end_s)
        if not owned or r.t_end_s > w1:
            continue  # not this window's to settle
        energy_j = base_j.get(r.id, 0.0) + before_j + after_j
        old_j = r.energy_j
        if old_j is None:
            settled_spans += 1
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
    store_energies(conn, table, writes)
    waiting_by_bucket_j = dict(before.waiting_by_bucket_j)
    for bucket_s, energy_j in after.waiting_by_bucket_j.items():
        waiting_by_bucket_j[bucket_s] = waiting_by_bucket_j.get(bucket_s, 0.0) + energy_j
    waiting_delta = replace_waiting(conn, job_id, kind, w0, w1, waiting_by_bucket_j)
    values: dict[str, Any] = {
        "settled_spans": settled_spans,
        "settled_queries": queries,
        "settled_tokens": tokens,
        "settled_energy_j": math.fsum([stat.settled_energy_j, *energy_delta]),
        # A window may only move waiting energy around by rounding: never let that show as -1e-13 J.
        "waiting_energy_j": max(stat.waiting_energy_j + waiting_delta, 0.0),
        "computed_to_s": w1,
        "computed_at_s": now_s,
        "carry": next_carry.dump(),
    }
    if sketch is not None:
        values.update(sketch=sketch.to_json(), p50_j=sketch.quantile(0.5), p95_j=sketch.quantile(0.95))
    conn.execute(update(span_stats).where(span_stats.c.job_id == job_id, span_stats.c.kind == kind).values(**values))
    return len(writes), crossing
