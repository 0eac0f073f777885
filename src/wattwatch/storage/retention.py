"""Bounded storage: the prune pass that deletes what is past retention, in bounded chunks.

What each table is for, and so what may go (docs/storage.md says it for operators):

- ``raw_batches``, the raw intervals (one row per batch, shares included: ``storage.raw_batches``):
  read by no report (the rollups are made at ingest), kept ``retention_s`` (default 14 days) for audits
  and rebuilds, then deleted. ``energy_intervals``, the row-per-interval record of revisions before 0010,
  is no longer written; its old rows go by the same rule.
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
- Never pruned: ``jobs``, ``job_device_energy``, ``job_hosts``, ``job_query_totals``, ``span_stats``,
  ``unmeasured_spans`` (the rollups reports read), ``idle_energy``, ``device_energy`` (totals), hosts,
  devices, agents and tokens. ``idle_energy`` is compacted instead: hours older than
  ``idle.IDLE_DAILY_AFTER_S`` (2 days) are folded into one row per device and day (at the day's
  midnight), so a 7-day report sums about 50 rows per device rather than 168, and history costs 24 times
  fewer rows. Reports bound idle by whole days that far back (``idle.idle_bounds``), so they read the
  same sums before and after a fold. Energy is moved, never lost: the fold deletes the hour rows
  (``DELETE ... RETURNING``, so a row an ingest updates meanwhile is folded at its latest value or left
  for the next pass) and adds what it deleted to the day.

Each statement deletes at most ``chunk_rows`` rows and commits, so the pass never holds a long lock
(SQLite's single writer) or builds a large transaction; ingest interleaves between chunks. A pass that
runs out of ``budget_s`` stops and reports ``complete=False``; the next pass carries on.

Why not PostgreSQL partitions: a dropped day partition is cheaper than deletes, but with a row per batch
the raw table holds about 300 times fewer rows than it did with a row per interval, so a chunked delete
is cheap, and it is the same code on both backends and bounded per statement. Nothing in the schema
prevents partitioning ``raw_batches`` by ``t_start_s`` later (no foreign key points at it, and nothing
reads it by ``id``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Column, Engine, Integer, Table, cast, delete, func, select, tuple_

from wattwatch.storage.dialect import upsert_rows
from wattwatch.storage.engine import WRITE_TX
from wattwatch.storage.idle import DAY_S as _DAY_S
from wattwatch.storage.idle import IDLE_DAILY_AFTER_S, day_floor_s
from wattwatch.storage.tables import (
    energy_intervals,
    idle_energy,
    ingested_batches,
    job_ticks,
    queries,
    query_counts,
    raw_batches,
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

    raw_s: float  # raw_batches and energy_intervals (t_end_s)
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
        (raw_batches, raw_batches.c.t_end_s, c.raw_s),
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
    folded, done = fold_idle_days(engine, now_s=now_s, deadline=deadline, monotonic=monotonic)
    result.deleted["idle_energy_hours_folded"] = folded
    if not done:
        result.complete = False
        return result
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


def fold_idle_days(
    engine: Engine,
    *,
    now_s: float,
    deadline: float | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> tuple[int, bool]:
    """Fold every idle hour older than ``IDLE_DAILY_AFTER_S`` into its day, a day per transaction, oldest
    first; returns (hour rows folded, whether all are done: False when ``deadline`` passed first)."""
    horizon_s = day_floor_s(now_s - IDLE_DAILY_AFTER_S)
    total = 0
    while (day_s := _oldest_unfolded_day(engine, horizon_s)) is not None:
        if deadline is not None and monotonic() > deadline:
            return total, False
        folded = fold_idle_day(engine, day_s)
        total += folded
        if not folded:
            break  # nothing moved (a row a hair off the hour): never loop on it
    return total, True


def _oldest_unfolded_day(engine: Engine, before_s: float) -> float | None:
    """The first day before ``before_s`` that still has idle rows other than its midnight row."""
    hour = idle_energy.c.hour_s
    # SQLite may lack floor() (math functions are a compile option); its integer cast truncates, and hours
    # are positive. PostgreSQL's cast rounds, so it takes floor().
    days = func.floor(hour / _DAY_S) if engine.dialect.name == "postgresql" else cast(hour / _DAY_S, Integer)
    off_midnight = hour - days * _DAY_S > 0.5
    with engine.connect() as conn:
        first = conn.execute(select(func.min(hour)).where(hour < before_s, off_midnight)).scalar()
    return None if first is None else day_floor_s(float(first))


def fold_idle_day(engine: Engine, day_s: float) -> int:
    """Move every idle hour of the day starting at ``day_s`` (but its midnight hour) into the day's row,
    per device, in one transaction; returns the hour rows folded. Sums per device are unchanged."""
    hour = idle_energy.c.hour_s
    with engine.connect().execution_options(**{WRITE_TX: True}) as conn, conn.begin():
        moved = conn.execute(
            delete(idle_energy)
            .where(hour > day_s, hour < day_s + _DAY_S)
            .returning(idle_energy.c.device_id, idle_energy.c.energy_j)
        ).all()
        per_device: dict[int, float] = {}
        for device_id, energy_j in moved:
            per_device[device_id] = per_device.get(device_id, 0.0) + energy_j
        if per_device:
            rows = [{"device_id": d, "hour_s": day_s, "energy_j": e} for d, e in sorted(per_device.items())]
            stmt, params = upsert_rows(conn, idle_energy, rows)
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=[idle_energy.c.device_id, idle_energy.c.hour_s],
                    set_={"energy_j": idle_energy.c.energy_j + stmt.excluded.energy_j},
                ),
                params,
            )
    return len(moved)
