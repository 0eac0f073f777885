"""Ingest-side writes for per-span energy: spans, count windows, job ticks, and the queue of work.

Spans and the ticks they share arrive in different batches, from different hosts, in any order. So
ingest computes nothing here: it appends the rows and one ``span_dirty`` mark per job saying "data
from ``t_s`` on changed", and ``storage.span_energy`` (run periodically by the collector) shares the
energy out later. Marks are appended, never updated, so the many hosts of one job never queue
behind each other on a shared row; only the rare growth of a job's longest tick or span updates one.

Everything here runs inside the caller's write transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, update

from wattwatch import wire
from wattwatch.storage.dialect import append_rows, upsert
from wattwatch.storage.tables import job_query_totals, job_ticks, jobs, query_counts, span_dirty, span_stats
from wattwatch.storage.tables import queries as queries_table

# The kind under which count windows are computed (next to the span kinds query, step, epoch).
COUNT_KIND = "count"
# A mark at this time means "from the job's first data on" (its first stats row of a kind was made).
FROM_START_S = 0.0

_QUERY_COLUMNS = ("job_id", "host_id", "t_start_s", "t_end_s", "tokens_in", "tokens_out", "kind")
_COUNT_COLUMNS = ("job_id", "host_id", "t_start_s", "t_end_s", "queries", "tokens_in", "tokens_out")
_TICK_COLUMNS = ("job_id", "host_id", "t_start_s", "t_end_s", "energy_j")


def record_ticks(conn: Connection, host_id: int, ticks_j: Mapping[tuple[str, float, float], float]) -> None:
    """Append each job's energy per tick on this host and mark those jobs for recomputation."""
    rows = [(job_id, host_id, t0, t1, e) for (job_id, t0, t1), e in sorted(ticks_j.items()) if e > 0.0]
    if not rows:
        return
    append_rows(conn, job_ticks, _TICK_COLUMNS, rows)
    first_s: dict[str, float] = {}
    longest_s: dict[str, float] = {}
    for job_id, _, t0, t1, _ in rows:
        first_s[job_id] = min(first_s.get(job_id, t0), t0)
        longest_s[job_id] = max(longest_s.get(job_id, 0.0), t1 - t0)
    # Only raises the value, and locks the jobs row only when it does: ticks have the same length almost always.
    conn.execute(
        update(jobs)
        .where(jobs.c.id == bindparam("b_job"), jobs.c.max_tick_s < bindparam("b_len"))
        .values(max_tick_s=bindparam("b_len")),
        [{"b_job": j, "b_len": s} for j, s in sorted(longest_s.items())],
    )
    mark_dirty(conn, first_s)


def record_spans(
    conn: Connection,
    host_id: int | None,
    spans: Sequence[wire.Query],
    counts: Sequence[wire.QueryCount] = (),
) -> None:
    """Append spans (queries, steps, epochs) and count windows; update per-job totals; mark the jobs."""
    if not spans and not counts:
        return
    append_rows(
        conn,
        queries_table,
        _QUERY_COLUMNS,
        [(q.job, host_id, q.t_start_s, q.t_end_s, q.tokens_in, q.tokens_out, q.kind) for q in spans],
    )
    append_rows(
        conn,
        query_counts,
        _COUNT_COLUMNS,
        [(c.job, host_id, c.t_start_s, c.t_end_s, c.queries, c.tokens_in, c.tokens_out) for c in counts],
    )
    totals: dict[str, dict[str, int]] = {}
    longest_s: dict[tuple[str, str], float] = {}
    first_s: dict[str, float] = {}
    for q in spans:
        t = totals.setdefault(q.job, dict.fromkeys(_TOTAL_COLUMNS, 0))
        if q.kind == "query":
            t["queries"] += 1
            t["tokens_in"] += q.tokens_in
            t["tokens_out"] += q.tokens_out
        else:
            t["steps" if q.kind == "step" else "epochs"] += 1
        key: tuple[str, str] = (q.job, q.kind)
        longest_s[key] = max(longest_s.get(key, 0.0), q.t_end_s - q.t_start_s)
        first_s[q.job] = min(first_s.get(q.job, q.t_start_s), q.t_start_s)
    for c in counts:
        t = totals.setdefault(c.job, dict.fromkeys(_TOTAL_COLUMNS, 0))
        t["counted_queries"] += c.queries
        t["counted_tokens_in"] += c.tokens_in
        t["counted_tokens_out"] += c.tokens_out
        key = (c.job, COUNT_KIND)
        longest_s[key] = max(longest_s.get(key, 0.0), c.t_end_s - c.t_start_s)
        first_s[c.job] = min(first_s.get(c.job, c.t_start_s), c.t_start_s)
    _add_totals(conn, totals)
    for job_id, _kind in _ensure_stats_rows(conn, longest_s):
        # A kind this job never had before: its spans must be shared over everything the job measured,
        # including ticks that arrived (and were marked, and consumed) before any of its spans existed.
        first_s[job_id] = FROM_START_S
    mark_dirty(conn, first_s)


def mark_dirty(conn: Connection, first_s: Mapping[str, float]) -> None:
    """Queue jobs for recomputation from ``first_s[job]`` on (append-only; see the module docstring)."""
    append_rows(conn, span_dirty, ("job_id", "t_s"), sorted(first_s.items()))


_TOTAL_COLUMNS = (
    "queries",
    "tokens_in",
    "tokens_out",
    "steps",
    "epochs",
    "counted_queries",
    "counted_tokens_in",
    "counted_tokens_out",
)


def _add_totals(conn: Connection, totals: Mapping[str, Mapping[str, int]]) -> None:
    if not totals:
        return
    stmt = upsert(conn, job_query_totals)
    tot = job_query_totals.c
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[tot.job_id],
            set_={name: tot[name] + stmt.excluded[name] for name in _TOTAL_COLUMNS},
        ),
        [{"job_id": job_id, **t} for job_id, t in sorted(totals.items())],
    )


def _ensure_stats_rows(conn: Connection, longest_s: Mapping[tuple[str, str], float]) -> list[tuple[str, str]]:
    """Create missing ``span_stats`` rows; raise ``max_span_s`` where a span is longer. Returns the new rows."""
    if not longest_s:
        return []
    created: list[tuple[str, str]] = []
    stmt = upsert(conn, span_stats).on_conflict_do_nothing().returning(span_stats.c.job_id, span_stats.c.kind)
    for (job_id, kind), length_s in sorted(longest_s.items()):
        row: dict[str, Any] = {
            "job_id": job_id,
            "kind": kind,
            "max_span_s": length_s,
            "settled_spans": 0,
            "settled_queries": 0,
            "settled_tokens": 0,
            "settled_energy_j": 0.0,
            "waiting_energy_j": 0.0,
        }
        if conn.execute(stmt, row).first() is not None:
            created.append((job_id, kind))
    # As for ticks: only a longer span than ever before takes the row's lock.
    conn.execute(
        update(span_stats)
        .where(
            span_stats.c.job_id == bindparam("b_job"),
            span_stats.c.kind == bindparam("b_kind"),
            span_stats.c.max_span_s < bindparam("b_len"),
        )
        .values(max_span_s=bindparam("b_len")),
        [{"b_job": j, "b_kind": k, "b_len": s} for (j, k), s in sorted(longest_s.items())],
    )
    return created
