"""Ingest-side writes for per-span energy: spans, count windows, job ticks, and the queue of work.

Spans and the ticks they share arrive in different batches, from different hosts, in any order. So
ingest computes nothing here: it appends the rows and one ``span_dirty`` mark per job saying "data
from ``t_s`` on changed", and ``storage.span_energy`` (run periodically by the collector) shares the
energy out later. Marks are appended, never updated, so the many hosts of one job never queue
behind each other on a shared row; only the rare growth of a job's longest span updates one.

Everything here runs inside the caller's write transaction.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, update

from wattwatch.protocol import wire
from wattwatch.storage.dialect import append_rows, upsert
from wattwatch.storage.tables import job_query_totals, job_ticks, query_counts, span_dirty, span_stats
from wattwatch.storage.tables import queries as queries_table

# The kind under which count windows are computed (next to the span kinds query, step, epoch).
COUNT_KIND = "count"
# A mark at this time means "from the job's first data on" (its first stats row of a kind was made).
FROM_START_S = 0.0

_QUERY_COLUMNS = ("job_id", "host_id", "t_start_s", "t_end_s", "tokens_in", "tokens_out", "kind")
_COUNT_COLUMNS = ("job_id", "host_id", "t_start_s", "t_end_s", "queries", "tokens_in", "tokens_out")
_TICK_COLUMNS = ("job_id", "host_id", "t_start_s", "t_end_s", "ticks")
# A job_ticks row holds ticks starting within this many seconds of its first.
PACKED_SPAN_S = 60.0


def record_ticks(conn: Connection, host_id: int, ticks_j: Mapping[tuple[str, float, float], float]) -> None:
    """Append each job's energy per tick on this host (packed) and mark those jobs for recomputation."""
    record_ticks_many(conn, [(host_id, ticks_j)])


def record_ticks_many(
    conn: Connection, per_host: Sequence[tuple[int, Mapping[tuple[str, float, float], float]]]
) -> None:
    """``record_ticks`` for several hosts at once: one append of ticks and one of marks (group commit)."""
    rows: list[tuple[str, int, float, float, bytes]] = []
    marks: list[tuple[str, float, float]] = []
    for host_id, ticks_j in per_host:
        host_rows = _tick_rows(host_id, ticks_j)
        rows.extend(host_rows)
        first_s: dict[str, float] = {}
        longest_s: dict[str, float] = {}
        for job_id, _, t0, t1, _ in host_rows:
            first_s[job_id] = min(first_s.get(job_id, t0), t0)
            longest_s[job_id] = max(longest_s.get(job_id, 0.0), t1 - t0)
        marks.extend((job_id, t_s, longest_s[job_id]) for job_id, t_s in sorted(first_s.items()))
    append_rows(conn, job_ticks, _TICK_COLUMNS, rows)
    append_rows(conn, span_dirty, ("job_id", "t_s", "max_tick_s"), marks)


def _tick_rows(
    host_id: int, ticks_j: Mapping[tuple[str, float, float], float]
) -> list[tuple[str, int, float, float, bytes]]:
    """One host's ticks as ``job_ticks`` rows, each packing the ticks starting within PACKED_SPAN_S."""
    per_job: dict[str, list[tuple[float, float, float]]] = {}
    for (job_id, t0, t1), energy_j in ticks_j.items():
        if energy_j > 0.0:
            per_job.setdefault(job_id, []).append((t0, t1, energy_j))
    rows: list[tuple[str, int, float, float, bytes]] = []
    for job_id, ticks in sorted(per_job.items()):
        ticks.sort()
        start = 0
        for i in range(1, len(ticks) + 1):
            # Bounded rows keep a window's look-back short: it reads rows starting up to the longest row before it.
            if i == len(ticks) or ticks[i][0] - ticks[start][0] >= PACKED_SPAN_S:
                chunk = ticks[start:i]
                rows.append((job_id, host_id, chunk[0][0], max(t1 for _, t1, _ in chunk), pack_ticks(chunk)))
                start = i
    return rows


def pack_ticks(ticks: Sequence[tuple[float, float, float]]) -> bytes:
    """``(t_start_s, t_end_s, energy_j)`` triples as little-endian float64s (a ``job_ticks.ticks`` value)."""
    return struct.pack(f"<{3 * len(ticks)}d", *(x for tick in ticks for x in tick))


def unpack_ticks(data: bytes) -> list[tuple[float, float, float]]:
    """The triples ``pack_ticks`` packed."""
    values = struct.unpack(f"<{len(data) // 8}d", data)
    return list(zip(values[0::3], values[1::3], values[2::3], strict=True))


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


def mark_dirty(conn: Connection, first_s: Mapping[str, float], max_tick_s: Mapping[str, float] | None = None) -> None:
    """Queue jobs for recomputation from ``first_s[job]`` on (append-only; see the module docstring).

    ``max_tick_s[job]`` is the longest ``job_ticks`` row just written for it, for the pass to keep.
    """
    longest = max_tick_s or {}
    append_rows(
        conn,
        span_dirty,
        ("job_id", "t_s", "max_tick_s"),
        [(job_id, t_s, longest.get(job_id, 0.0)) for job_id, t_s in sorted(first_s.items())],
    )


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
