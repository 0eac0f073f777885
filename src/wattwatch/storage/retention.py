"""Bounded storage: the prune pass that deletes what is past retention, in bounded chunks.

What each table is for, and so what may go (docs/retention-readme.md says it for operators):

- ``energy_intervals``, the raw intervals: written on every batch and read by nothing (the rollups are
  made at ingest, and a raw row holds no job shares, so rollups could not be rebuilt from it anyway).
  Kept ``retention_s`` (default 14 days) for audits and ad-hoc SQL, then deleted.
- ``job_ticks``, ``queries``, ``query_counts`` and ``span_waiting``: the inputs of the span-energy pass.
  A span window is recomputed when late data reaches it, and late data is accepted as far back as the
  collector's time window (``time_window_past_s``, default 30 days). So these go only once older than
  both the retention and that window (the *late-data horizon*): a window they belonged to can no longer
  change. Their results (``span_stats``: settled totals, quantile sketches, waiting energy) stay.
- ``ingested_batches`` and ``span_posts``, idempotency keys: an agent resends a batch until the
  collector acknowledges it. A resend whose key is gone would be stored twice, unless the collector
  refuses it anyway: it refuses (422) any batch holding a time older than ``time_window_past_s``, and a
  batch's times are at most ``time_window_future_s`` after it was received. So a key received at ``r``
  is needed until ``r + past + future`` and no later: keys go once received before
  ``now - max(retention_s, past + future)``. (Rule: keep keys at least the whole time window, past plus
  future, since a batch is received.)
- Never pruned: ``jobs``, ``job_device_energy``, ``job_hosts``, ``job_query_totals``, ``span_stats``
  (the rollups reports read), ``idle_energy`` (idle per device and hour), ``device_energy`` (totals),
  hosts, devices, agents and tokens.

Each statement deletes at most ``chunk_rows`` rows and commits, so the pass never holds a long lock
(SQLite's single writer) or builds a large transaction; ingest interleaves between chunks. A pass that
runs out of ``budget_s`` stops and reports ``complete=False``; the next pass carries on.

Why not PostgreSQL partitions: a dropped day partition is cheaper than deletes, but ``energy_intervals``
is COPYed into by the ingest path and its primary key would have to include the partition column; the
chunked delete is the same code on both backends and bounded per statement. Nothing in the schema
prevents partitioning ``energy_intervals`` by ``t_start_s`` later (no foreign key points at it since
revision 0007, and nothing reads it by ``id``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Column, Engine, Table, delete, select, tuple_

from wattwatch.storage.engine import WRITE_TX
from wattwatch.storage.tables import (
    energy_intervals,
    ingested_batches,
    job_ticks,
    queries,
    query_counts,
    span_posts,
    span_waiting,
)

DAY_S = 86400.0
DEFAULT_RETENTION_DAYS = 14.0
DEFAULT_CHUNK_ROWS = 5000
# How often the collector prunes: storage bounded to retention plus about this much.
DEFAULT_INTERVAL_S = 600.0


@dataclass(frozen=True)
class Cutoffs:
    """Rows whose time is before these (epoch seconds) are past retention."""

    raw_s: float  # energy_intervals (t_end_s)
    late_s: float  # span inputs: job_ticks, queries, query_counts (t_end_s), span_waiting (bucket_s)
    keys_s: float  # ingested_batches, span_posts (received_at_s)


def cutoffs(*, now_s: float, retention_s: float, past_s: float, future_s: float) -> Cutoffs:
    """Where each kind of row ends its life (module docstring says why each is where it is)."""
    return Cutoffs(
        raw_s=now_s - retention_s,
        late_s=now_s - max(retention_s, past_s),
        keys_s=now_s - max(retention_s, past_s + future_s),
    )


@dataclass
class PruneResult:
    """What one ``prune`` pass deleted, per table, and whether it got through everything due."""

    deleted: dict[str, int] = field(default_factory=dict)
    complete: bool = True

    @property
    def total(self) -> int:
        """Rows deleted over all tables."""
        return sum(self.deleted.values())


def _targets(c: Cutoffs) -> list[tuple[Table, Column[float], float]]:
    # Raw first: the largest by far, and the one the retention is about.
    return [
        (energy_intervals, energy_intervals.c.t_end_s, c.raw_s),
        (job_ticks, job_ticks.c.t_end_s, c.late_s),
        (queries, queries.c.t_end_s, c.late_s),
        (query_counts, query_counts.c.t_end_s, c.late_s),
        (span_waiting, span_waiting.c.bucket_s, c.late_s),
        (ingested_batches, ingested_batches.c.received_at_s, c.keys_s),
        (span_posts, span_posts.c.received_at_s, c.keys_s),
    ]


def prune(
    engine: Engine,
    *,
    now_s: float,
    retention_s: float,
    past_s: float,
    future_s: float,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    budget_s: float | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> PruneResult:
    """Delete every row past retention (see the module docstring), ``chunk_rows`` per transaction.

    ``retention_s`` 0 keeps everything (nothing is deleted). Stops early, ``complete=False``, once
    ``budget_s`` has passed.
    """
    if retention_s < 0 or chunk_rows < 1:
        raise ValueError(f"retention must be 0 (keep) or positive seconds and chunks positive, got {retention_s!r}")
    result = PruneResult()
    if retention_s == 0:
        return result
    deadline = None if budget_s is None else monotonic() + budget_s
    c = cutoffs(now_s=now_s, retention_s=retention_s, past_s=past_s, future_s=future_s)
    for table, when, before_s in _targets(c):
        result.deleted[table.name] = 0
        while True:
            if deadline is not None and monotonic() > deadline:
                result.complete = False
                return result
            n = _delete_chunk(engine, table, when, before_s, chunk_rows)
            result.deleted[table.name] += n
            if n < chunk_rows:
                break
    return result


def _delete_chunk(engine: Engine, table: Table, when: Column[float], before_s: float, chunk_rows: int) -> int:
    """Delete up to ``chunk_rows`` rows of ``table`` with ``when < before_s``, in one transaction."""
    key = list(table.primary_key.columns)
    # Chunked by primary key: DELETE ... LIMIT exists on neither backend by default. Rows are chosen by a
    # scan that stops at chunk_rows matches (old rows sit early in insertion order).
    chosen = select(*key).where(when < before_s).limit(chunk_rows)
    match = key[0] if len(key) == 1 else tuple_(*key)
    stmt = delete(table).where(match.in_(chosen))
    with engine.connect().execution_options(**{WRITE_TX: True}) as conn, conn.begin():
        return int(conn.execute(stmt).rowcount or 0)
