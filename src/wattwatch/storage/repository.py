"""Repository functions: everything the collector and the CLI write to or read from the database.

Writes live here; reads (reports, job lists, the /metrics snapshot) live in ``reads`` and are
re-exported. Every write is one transaction, so a batch is either stored whole or not at all.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, String, Text, and_, bindparam, case, cast, or_, select, update

from wattwatch import wire
from wattwatch.accounting.rollup import JobHostTotals
from wattwatch.limits import REASON_ORDER, BoundError
from wattwatch.storage.dialect import append_token, cached_upsert, execute_rows, greatest, least, upsert
from wattwatch.storage.engine import WRITE_TX
from wattwatch.storage.group_ingest import IngestResult, Pending, ingest_many
from wattwatch.storage.idempotency import AgentIdTaken, KeyReused, claim_span_post
from wattwatch.storage.reads import (
    DEFAULT_LIST_LIMIT,
    BadCursor,
    MetricsSnapshot,
    build_report,
    day_floor_s,
    get_job,
    list_jobs,
    metrics_snapshot,
)
from wattwatch.storage.spans import record_spans
from wattwatch.storage.tables import (
    device_energy,
    hosts,
    idle_energy,
    idle_energy_days,
    job_device_energy,
    job_hosts,
    jobs,
)

__all__ = [
    "DEFAULT_LIST_LIMIT",
    "AgentIdTaken",
    "BadCursor",
    "EndsBeforeStart",
    "IngestResult",
    "KeyReused",
    "MetricsSnapshot",
    "UnknownJob",
    "add_queries",
    "build_report",
    "end_job",
    "get_job",
    "ingest_batch",
    "job_host_names",
    "list_jobs",
    "metrics_snapshot",
    "upsert_job",
]

# jobs.ended_by of a job the collector ended because no host running it pushed for too long
# (``storage.silent_hosts``): provisional, the agent's own end replaces it.
ENDED_BY_SILENT_AGENT = "collector-silent-agent"


class UnknownJob(LookupError):
    """No job with this id exists."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r}; start it first (POST /api/v1/jobs or `wattwatch run`)")
        self.job_id = job_id


class EndsBeforeStart(BoundError):
    """An end before the job's start: refused (a 422 naming ``ended_at_s``), since moving the start back
    to it would let one client rewrite when another host's job ran."""

    def __init__(self, job_id: str, ended_at_s: float, started_at_s: float) -> None:
        super().__init__(
            "ended_at_s",
            f"{ended_at_s!r} is before job {job_id!r} started ({started_at_s!r}); a job cannot end before it starts",
            REASON_ORDER,
        )


@contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """One write transaction (on SQLite it takes the write lock at BEGIN; see engine._sqlite_begin)."""
    with engine.connect().execution_options(**{WRITE_TX: True}) as conn, conn.begin():
        yield conn


def ingest_batch(engine: Engine, batch: wire.Batch, *, received_at_s: float) -> IngestResult:
    """Store one agent batch and add its attributed energy to the rollups, in one transaction.

    The ``(agent_id, seq)`` key is inserted first (``storage.idempotency``): if it exists with the same
    content, the batch was stored before and nothing else is written (``duplicate=True``), which makes
    agent retries and collector replicas safe. An agent id another host pushed first raises AgentIdTaken,
    a key stored with other content KeyReused; either way nothing is stored. The collector stores
    concurrent batches together (``storage.group_ingest``); this is the same path for one.
    """
    (outcome,) = ingest_many(engine, [Pending(batch, received_at_s)])
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def upsert_job(engine: Engine, host: str, job: wire.Job, *, now_s: float | None = None) -> None:
    """Record a job as ``host`` sees it (start, or start and end). Merges with what other hosts sent.

    ``now_s`` stands in for an unknown start (``started_at_s`` 0) and for the host's last-seen time.
    """
    seen_s = time.time() if now_s is None else now_s
    with write_transaction(engine) as conn:
        host_id = _upsert_host(conn, host, None, seen_s)
        row = _real_job_row(job, fallback_start_s=seen_s, created_at_s=seen_s)
        upsert_job_rows(conn, [row])
        totals = JobHostTotals(first_s=row["started_at_s"], last_s=job.ended_at_s or row["started_at_s"])
        add_job_hosts(conn, {(job.id, host_id): totals})


def end_job(engine: Engine, job_id: str, ended_at_s: float) -> None:
    """Mark a job ended at ``ended_at_s`` (the latest end any host reported wins, and replaces an end the
    collector gave a silent agent's job). Raises UnknownJob, and EndsBeforeStart (nothing stored) for an
    end before the job's start."""
    silent = jobs.c.ended_by == ENDED_BY_SILENT_AGENT
    with write_transaction(engine) as conn:
        started_at_s = conn.execute(select(jobs.c.started_at_s).where(jobs.c.id == job_id)).scalar()
        if started_at_s is not None and ended_at_s < started_at_s:
            raise EndsBeforeStart(job_id, ended_at_s, started_at_s)
        result = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id)
            .values(
                ended_at_s=case(
                    (or_(jobs.c.ended_at_s.is_(None), silent), ended_at_s),
                    else_=greatest(conn, jobs.c.ended_at_s, ended_at_s),
                ),
                ended_by=case((silent, None), else_=jobs.c.ended_by),
            )
            .returning(jobs.c.id)
        )
        if result.first() is None:
            raise UnknownJob(job_id)


def add_queries(
    engine: Engine,
    job_id: str,
    queries: Sequence[wire.Query],
    *,
    host: str | None = None,
    idempotency_key: str | None = None,
    now_s: float | None = None,
) -> int:
    """Record completed spans (queries, steps, epochs) of ``job_id``; returns how many (0 for a retried
    ``idempotency_key``: those spans were stored before). Raises UnknownJob, and KeyReused for a key used
    before with other spans.

    Every span's ``job`` must be ``job_id`` (ValueError otherwise): the caller addressed one job.
    Their energies follow from the next span-energy pass, exactly as for spans in agent batches.
    """
    for i, q in enumerate(queries):
        if q.job != job_id:
            raise ValueError(f"queries[{i}].job is {q.job!r}, but the queries were posted to job {job_id!r}")
    with write_transaction(engine) as conn:
        if conn.execute(select(jobs.c.id).where(jobs.c.id == job_id)).first() is None:
            raise UnknownJob(job_id)
        if idempotency_key is not None:
            body_sha256 = hashlib.sha256(wire.encode(list(queries))).hexdigest()
            seen_s = time.time() if now_s is None else now_s
            if not claim_span_post(conn, job_id, host, idempotency_key, body_sha256, len(queries), seen_s):
                return 0
        host_id = None
        if host:
            host_id = conn.execute(select(hosts.c.id).where(hosts.c.name == host)).scalar()
        record_spans(conn, host_id, queries)
    return len(queries)


def job_host_names(engine: Engine, job_id: str) -> set[str] | None:
    """The hosts that reported ``job_id`` (None when there is no such job): who may end it or add spans."""
    with engine.connect() as conn:
        if conn.execute(select(jobs.c.id).where(jobs.c.id == job_id)).first() is None:
            return None
        rows = conn.execute(
            select(hosts.c.name).select_from(job_hosts.join(hosts)).where(job_hosts.c.job_id == job_id)
        ).scalars()
        return set(rows)


# --- pieces of a write transaction -------------------------------------------------------------------


def _upsert_host(conn: Connection, name: str, agent_id: str | None, seen_s: float) -> int:
    stmt = upsert(conn, hosts).values(name=name, agent_id=agent_id, first_seen_s=seen_s, last_seen_s=seen_s)
    set_: dict[str, Any] = {"last_seen_s": greatest(conn, hosts.c.last_seen_s, stmt.excluded.last_seen_s)}
    if agent_id is not None:
        set_["agent_id"] = stmt.excluded.agent_id
    conn.execute(stmt.on_conflict_do_update(index_elements=[hosts.c.name], set_=set_))
    host_id = conn.execute(select(hosts.c.id).where(hosts.c.name == name)).scalar_one()
    return int(host_id)


def _real_job_row(job: wire.Job, *, fallback_start_s: float, created_at_s: float) -> dict[str, Any]:
    phase, phase_of = job.labels.get(wire.PHASE_LABEL), job.labels.get(wire.PHASE_OF_LABEL)
    is_phase = phase in wire.PHASES and bool(phase_of)
    return {
        "id": job.id,
        "name": job.name,
        "kind": job.kind,
        "labels": dict(job.labels),
        # 0 is the wire default for "start unknown"; no job started in 1970.
        "started_at_s": job.started_at_s or fallback_start_s,
        "ended_at_s": job.ended_at_s,
        "ended_by": job.ended_by if job.ended_at_s is not None else None,
        "created_at_s": created_at_s,
        "placeholder": False,
        "phase": phase if is_phase else None,
        "phase_of": phase_of[:200] if is_phase and phase_of else None,
    }


def job_rows(
    batch: wire.Batch, received_at_s: float, intervals_first_s: Mapping[str, float] | None = None
) -> list[dict[str, Any]]:
    """Job rows for the batch's job records, plus placeholders for ids only intervals, spans or counts name.

    ``intervals_first_s``: each job's earliest interval start, when the caller has it already (the rollup's
    ``first_s`` per job: ingest saves a pass over every interval).
    """
    if intervals_first_s is not None:
        first_seen_s = dict(intervals_first_s)
    else:
        first_seen_s = {}
        for iv in batch.intervals:
            for job_id in iv.shares:
                first_seen_s[job_id] = min(first_seen_s.get(job_id, iv.t_start_s), iv.t_start_s)
    spans: list[wire.Query | wire.QueryCount] = [*batch.queries, *batch.query_counts]
    for span in spans:
        first_seen_s[span.job] = min(first_seen_s.get(span.job, span.t_start_s), span.t_start_s)
    rows: dict[str, dict[str, Any]] = {}
    for job in batch.jobs:  # a later record of the same job in one batch wins, as across batches
        fallback_s = first_seen_s.get(job.id, received_at_s)
        row = _real_job_row(job, fallback_start_s=fallback_s, created_at_s=received_at_s)
        if job.id in rows:
            row["started_at_s"] = min(row["started_at_s"], rows[job.id]["started_at_s"])
            ends = [(r["ended_at_s"], r["ended_by"]) for r in (row, rows[job.id]) if r["ended_at_s"] is not None]
            row["ended_at_s"], row["ended_by"] = max(ends, key=lambda e: e[0]) if ends else (None, None)
        rows[job.id] = row
    for job_id, start_s in first_seen_s.items():
        if job_id not in rows:
            rows[job_id] = {
                "id": job_id,
                "name": job_id,
                "kind": "other",
                "labels": {},
                "started_at_s": start_s,
                "ended_at_s": None,
                "ended_by": None,
                "created_at_s": received_at_s,
                "placeholder": True,
            }
    return [rows[k] for k in sorted(rows)]  # one lock order for every writer (PostgreSQL deadlocks)


def upsert_job_rows(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert or merge job rows (``job_rows``): placeholders only have to exist; real records merge."""
    placeholders = [r for r in rows if r["placeholder"]]
    real = [r for r in rows if not r["placeholder"]]
    if placeholders:
        # A placeholder only has to exist. DO NOTHING takes no lock on an existing row, so the many hosts
        # of one training run do not queue behind each other on its jobs row at every batch.
        stmt, params = cached_upsert(
            conn,
            "job_placeholders",
            jobs,
            placeholders,
            lambda base: base.on_conflict_do_nothing(index_elements=[jobs.c.id]),
        )
        execute_rows(conn, stmt, params)
    if not real:
        return
    stmt = upsert(conn, jobs)
    new = stmt.excluded
    # The collector's end of a silent agent's job is provisional: the agent's own end replaces it.
    provisional = or_(jobs.c.ended_at_s.is_(None), jobs.c.ended_by == ENDED_BY_SILENT_AGENT)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[jobs.c.id],
            set_={
                # The latest real record names the job, replacing a placeholder's id-as-name.
                "name": new.name,
                "kind": new.kind,
                # An end record or another host often sends no labels; that must not erase them.
                "labels": case((cast(new.labels, Text) == "{}", jobs.c.labels), else_=new.labels),
                # The phase comes from the labels, so it changes only with them (after -> setup of the next job).
                "phase": case((cast(new.labels, Text) == "{}", jobs.c.phase), else_=new.phase),
                "phase_of": case((cast(new.labels, Text) == "{}", jobs.c.phase_of), else_=new.phase_of),
                "placeholder": False,
                "started_at_s": least(conn, jobs.c.started_at_s, new.started_at_s),
                "ended_at_s": case(
                    (new.ended_at_s.is_(None), jobs.c.ended_at_s),
                    (provisional, new.ended_at_s),
                    else_=greatest(conn, jobs.c.ended_at_s, new.ended_at_s),
                ),
                # Whoever set the end that stands names it.
                "ended_by": case(
                    (new.ended_at_s.is_(None), jobs.c.ended_by),
                    (or_(provisional, new.ended_at_s > jobs.c.ended_at_s), new.ended_by),
                    else_=jobs.c.ended_by,
                ),
            },
        ),
        real,
    )


def reopen_jobs(conn: Connection, job_ids: list[str], sent_at_s: float) -> None:
    """Open again the jobs the collector ended for a silent agent that this batch says still run.

    Only a record sealed after that end counts (an agent re-announces the jobs it re-adopted after a
    restart): a batch that waited in a spool since before the silence carries old start records, and a
    job whose end anyone else reported stays ended.
    """
    if not job_ids or sent_at_s <= 0:
        return
    conn.execute(
        update(jobs)
        .where(
            jobs.c.id.in_(job_ids),
            jobs.c.ended_by == ENDED_BY_SILENT_AGENT,
            jobs.c.ended_at_s < sent_at_s,
        )
        .values(ended_at_s=None, ended_by=None)
    )


def add_job_device_energy(conn: Connection, rows: Iterable[tuple[str, int, float, float, list[str]]]) -> None:
    """Add energy per (job, device) onto the rollup: ``(job_id, device_id, energy_j, max_power_w, sources)``."""
    rows = sorted(rows)
    if not rows:
        return
    stmt, params = cached_upsert(
        conn,
        "add_job_device_energy",
        job_device_energy,
        [{"job_id": j, "device_id": d, "energy_j": e, "max_power_w": p, "sources": s[0]} for j, d, e, p, s in rows],
        lambda base: base.on_conflict_do_update(
            index_elements=[job_device_energy.c.job_id, job_device_energy.c.device_id],
            set_={
                "energy_j": job_device_energy.c.energy_j + base.excluded.energy_j,
                "max_power_w": greatest(conn, job_device_energy.c.max_power_w, base.excluded.max_power_w),
                "sources": append_token(job_device_energy.c.sources, base.excluded.sources),
            },
        ),
    )
    execute_rows(conn, stmt, params)
    # Rare: one device changed source within a batch (a counter reset bridged from power readings).
    extra = [{"j": j, "d": d, "s": src} for j, d, _, _, s in rows for src in s[1:]]
    if extra:
        jde = job_device_energy
        conn.execute(
            update(jde)
            .where(jde.c.job_id == bindparam("j"), jde.c.device_id == bindparam("d"))
            .values(sources=append_token(jde.c.sources, bindparam("s", type_=String()))),
            extra,
        )


def add_job_hosts(conn: Connection, totals: dict[tuple[str, int], JobHostTotals]) -> None:
    """Merge per (job, host) totals into ``job_hosts``: peak, first and last seen, and power now."""
    if not totals:
        return
    stmt, params = cached_upsert(
        conn,
        "add_job_hosts",
        job_hosts,
        [
            {
                "job_id": job_id,
                "host_id": host_id,
                "peak_power_w": t.peak_power_w,
                "first_s": t.first_s,
                "last_s": max(t.last_s, t.first_s),
                "power_w": t.recent_power_w,
                "power_at_s": t.recent_at_s,
            }
            for (job_id, host_id), t in sorted(totals.items())
        ],
        lambda base: _merge_job_hosts(conn, base),
    )
    execute_rows(conn, stmt, params)


def _merge_job_hosts(conn: Connection, stmt: Any) -> Any:
    """The ON CONFLICT of ``add_job_hosts``."""
    new = stmt.excluded
    newer_power = and_(
        new.power_at_s.is_not(None),
        or_(job_hosts.c.power_at_s.is_(None), new.power_at_s >= job_hosts.c.power_at_s),
    )
    return stmt.on_conflict_do_update(
        index_elements=[job_hosts.c.job_id, job_hosts.c.host_id],
        set_={
            "peak_power_w": greatest(conn, job_hosts.c.peak_power_w, new.peak_power_w),
            "first_s": least(conn, job_hosts.c.first_s, new.first_s),
            "last_s": greatest(conn, job_hosts.c.last_s, new.last_s),
            # Batches can arrive out of order (retries): power now moves forward in time only.
            "power_w": case((newer_power, new.power_w), else_=job_hosts.c.power_w),
            "power_at_s": case((newer_power, new.power_at_s), else_=job_hosts.c.power_at_s),
        },
    )


def add_idle(conn: Connection, rows: list[tuple[int, float, float]]) -> None:
    """Add idle energy per (device, hour) onto ``idle_energy``, and per (device, day) onto ``idle_energy_days``."""
    if not rows:
        return
    stmt, params = cached_upsert(
        conn,
        "add_idle",
        idle_energy,
        [{"device_id": d, "hour_s": h, "energy_j": e} for d, h, e in sorted(rows)],
        lambda base: base.on_conflict_do_update(
            index_elements=[idle_energy.c.device_id, idle_energy.c.hour_s],
            set_={"energy_j": idle_energy.c.energy_j + base.excluded.energy_j},
        ),
    )
    execute_rows(conn, stmt, params)
    per_day: dict[tuple[int, float], float] = {}
    for d, h, e in rows:
        key = (d, day_floor_s(h))
        per_day[key] = per_day.get(key, 0.0) + e
    stmt, params = cached_upsert(
        conn,
        "add_idle_days",
        idle_energy_days,
        [{"device_id": d, "day_s": day_s, "energy_j": e} for (d, day_s), e in sorted(per_day.items())],
        lambda base: base.on_conflict_do_update(
            index_elements=[idle_energy_days.c.device_id, idle_energy_days.c.day_s],
            set_={"energy_j": idle_energy_days.c.energy_j + base.excluded.energy_j},
        ),
    )
    execute_rows(conn, stmt, params)


def add_device_energy(conn: Connection, rows: dict[int, tuple[float, float]]) -> None:
    """Add (job joules, idle joules) per device onto ``device_energy``: each device's running totals, so
    /metrics reads one row per device instead of summing every job and idle hour ever stored."""
    if not rows:
        return
    stmt, params = cached_upsert(
        conn,
        "add_device_energy",
        device_energy,
        [{"device_id": d, "job_energy_j": j, "idle_energy_j": i} for d, (j, i) in sorted(rows.items())],
        lambda base: base.on_conflict_do_update(
            index_elements=[device_energy.c.device_id],
            set_={
                "job_energy_j": device_energy.c.job_energy_j + base.excluded.job_energy_j,
                "idle_energy_j": device_energy.c.idle_energy_j + base.excluded.idle_energy_j,
            },
        ),
    )
    execute_rows(conn, stmt, params)
