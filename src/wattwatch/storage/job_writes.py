"""The jobs rows that ingest and job records write: a record's row, placeholders for job ids that only
intervals or spans name, the merge of rows several hosts send, and reopening a job ended for silence.

``storage.group_ingest`` (agent batches) and ``storage.repository`` (one job record over the API) both
write jobs through these, so a job merges the same however it arrives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, Text, case, cast, or_, update

from wattwatch.protocol import wire
from wattwatch.storage.dialect import cached_upsert, execute_rows, greatest, least, upsert
from wattwatch.storage.tables import jobs

# jobs.ended_by of a job the collector ended because no host running it pushed for too long
# (``storage.silent_hosts``): provisional, the agent's own end replaces it.
ENDED_BY_SILENT_AGENT = "collector-silent-agent"


def real_job_row(job: wire.Job, *, fallback_start_s: float, created_at_s: float) -> dict[str, Any]:
    """The jobs row of one job record: its phase from its labels, an unknown start as ``fallback_start_s``."""
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
        row = real_job_row(job, fallback_start_s=fallback_s, created_at_s=received_at_s)
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
