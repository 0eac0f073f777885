"""Repository functions: the writes the collector and the CLI make, each one transaction, so a batch or
a job record is either stored whole or not at all.

The rows they are made of are ``storage.job_writes`` and ``storage.rollup_writes``; many batches at once
are ``storage.group_ingest``. Reads (reports, job lists, the /metrics snapshot) live in ``reads`` and
``metrics_reads`` and are re-exported here.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, case, or_, select, update

from wattwatch.accounting.rollup import JobHostTotals
from wattwatch.protocol import wire
from wattwatch.protocol.limits import REASON_ORDER, BoundError
from wattwatch.storage.dialect import greatest, upsert
from wattwatch.storage.engine import write_transaction
from wattwatch.storage.group_ingest import IngestResult, Pending, ingest_many
from wattwatch.storage.idempotency import AgentIdTaken, KeyReused, claim_span_post
from wattwatch.storage.job_writes import ENDED_BY_SILENT_AGENT, real_job_row, upsert_job_rows
from wattwatch.storage.metrics_reads import MetricsSnapshot, metrics_snapshot
from wattwatch.storage.reads import DEFAULT_LIST_LIMIT, BadCursor, build_report, get_job, list_jobs
from wattwatch.storage.rollup_writes import add_job_hosts
from wattwatch.storage.spans import record_spans
from wattwatch.storage.tables import hosts, job_hosts, jobs

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
        row = real_job_row(job, fallback_start_s=seen_s, created_at_s=seen_s)
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


def _upsert_host(conn: Connection, name: str, agent_id: str | None, seen_s: float) -> int:
    stmt = upsert(conn, hosts).values(name=name, agent_id=agent_id, first_seen_s=seen_s, last_seen_s=seen_s)
    set_: dict[str, Any] = {"last_seen_s": greatest(conn, hosts.c.last_seen_s, stmt.excluded.last_seen_s)}
    if agent_id is not None:
        set_["agent_id"] = stmt.excluded.agent_id
    conn.execute(stmt.on_conflict_do_update(index_elements=[hosts.c.name], set_=set_))
    host_id = conn.execute(select(hosts.c.id).where(hosts.c.name == name)).scalar_one()
    return int(host_id)
