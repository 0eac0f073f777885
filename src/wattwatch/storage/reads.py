"""Reads for reports, job lists and one job. They read the rollups only: O(jobs), never the raw intervals.

One report entry per job (``storage.job_entries``), shaped exactly as DESIGN.md's report JSON (plus a few
extra fields); ``build_report``, ``list_jobs`` and ``get_job`` all return these entries, so the CLI, the
HTTP API and the dashboards agree on every number. Reports and job lists hide the phases (setup, after)
of a job and show them with it; ``get_job`` of a phase's own id still answers (with ``phase`` and
``phase_of`` set). Idle energy's window is ``storage.idle``'s; ``/metrics`` reads are ``storage.metrics_reads``.
"""

from __future__ import annotations

import fnmatch
import re
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Engine, Select, and_, func, or_, select
from sqlalchemy.sql.elements import ColumnElement

from wattwatch.carbon.policy import CarbonPolicy
from wattwatch.protocol.limits import CURSOR_PATTERN
from wattwatch.protocol.units import JOB_KINDS, iso_utc
from wattwatch.reporting.group import totals
from wattwatch.storage.idle import idle_bounds, read_idle
from wattwatch.storage.job_entries import Intensities, job_entries, policy_of, snapshot
from wattwatch.storage.job_refs import resolve_job_ref
from wattwatch.storage.tables import hosts, job_hosts, jobs

_CURSOR = re.compile(CURSOR_PATTERN)

DEFAULT_LIST_LIMIT = 100


def _job_where(
    *,
    since_s: float | None,
    job_id: str | None,
    kind: str | None,
    until_s: float | None = None,
    host: str | None = None,
) -> list[ColumnElement[bool]]:
    if kind is not None and kind not in JOB_KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(JOB_KINDS)}")
    # A phase is shown with its job; asked for by its own id, it answers.
    where: list[ColumnElement[bool]] = [] if job_id is not None else [jobs.c.phase_of.is_(None)]
    if since_s is not None:
        # Jobs that ended after `since`, or that still run.
        where.append(or_(jobs.c.ended_at_s.is_(None), jobs.c.ended_at_s >= since_s))
    if until_s is not None:
        # Jobs that started before `until`: with `since`, the jobs active at some point in the window.
        where.append(jobs.c.started_at_s < until_s)
    if job_id is not None:
        where.append(jobs.c.id == job_id)
    if kind is not None:
        where.append(jobs.c.kind == kind)
    if host is not None:
        on_host = (
            select(job_hosts.c.job_id)
            .select_from(job_hosts.join(hosts, job_hosts.c.host_id == hosts.c.id))
            .where(hosts.c.name == host)
        )
        where.append(jobs.c.id.in_(on_host))
    return where


def _matches(
    name: str, labels: Mapping[str, Any] | None, name_glob: str | None, want: Mapping[str, str | None]
) -> bool:
    """A job's name against a shell glob (case-sensitive, as on every database) and its labels against
    ``want`` (each key present; with the value, unless the value wanted is None)."""
    if name_glob is not None and not fnmatch.fnmatchcase(name, name_glob):
        return False
    have = labels or {}
    return all(k in have and (v is None or str(have[k]) == v) for k, v in want.items())


class BadCursor(ValueError):
    """A report ``cursor`` this collector did not write (or a mangled one)."""


def encode_cursor(started_at_s: float, job_id: str) -> str:
    """The ``cursor`` of a report page that ends with this job: its start time, exactly (``float.hex``), and
    its id (``limits.CURSOR_PATTERN``)."""
    return f"{float(started_at_s).hex()}~{job_id}"


def decode_cursor(cursor: str) -> tuple[float, str]:
    """``encode_cursor``'s (start time, job id); BadCursor for a string outside ``limits.CURSOR_PATTERN``."""
    if not _CURSOR.fullmatch(cursor):
        raise BadCursor(f"{cursor[:40]!r} is not a cursor this collector gave; use next_cursor as given")
    time_hex, _, job_id = cursor.partition("~")
    # The pattern's exponent of at most three digits keeps every admitted time finite (below 2**1000).
    return float.fromhex(time_hex), job_id


def resolve_job(engine: Engine, ref: str) -> str | None:
    """The id of the job ``ref`` names: its id, a unique id prefix or its name (``job_refs``); None when
    no job matches. Raises ``job_refs.AmbiguousJob`` when several do."""
    with snapshot(engine) as conn:
        return resolve_job_ref(conn, ref)


def build_report(
    engine: Engine,
    *,
    since_s: float | None = None,
    job_id: str | None = None,
    kind: str | None = None,
    grid_intensity_g_per_kwh: float = 400.0,
    pue: float = 1.0,
    now_s: float | None = None,
    until_s: float | None = None,
    host: str | None = None,
    name: str | None = None,
    labels: Mapping[str, str | None] | None = None,
    limit: int | None = None,
    cursor: str | None = None,
    carbon: CarbonPolicy | None = None,
) -> dict[str, Any]:
    """The report of DESIGN.md: ``{"jobs": [...], "idle": [{"host", "device", "energy_j"}]}``, plus
    ``filters`` (those given, times as ISO), ``jobs_recorded`` (whether the database holds any job at
    all, so "nothing matches" and "nothing yet" read differently), ``next_cursor`` (paging) and
    ``jobs_matched`` (jobs matching the filters on all pages, so a page can say "100 of 4,667").

    ``since_s`` keeps jobs that ended at or after it (or still run), ``until_s`` those that started before
    it; idle energy follows the same window in whole hours (the hour containing ``since_s`` on, hours
    starting before ``until_s``: ``idle_from`` / ``idle_until``) and the ``host`` filter. ``job_id``
    narrows to one job, and idle to that job's hosts. ``name`` is a shell glob on job names; ``labels``
    must all be on the job (a None value: any value). Jobs are in start order. ``now_s`` (default: the
    clock) is where a running job's duration ends. ``carbon`` (default: one intensity and PUE for every
    host, the two arguments) prices each host's energy; the report's ``carbon`` section states what it used.

    Paging: ``limit`` jobs at most per page (None: all); ``next_cursor`` is None on the last page, else
    what to pass as ``cursor`` for the next one (keyset paging on start time and id, so a job starting
    meanwhile never shifts a page). Idle energy is on the first page only, so pages add up.
    """
    now_s = time.time() if now_s is None else now_s
    policy = policy_of(carbon, grid_intensity_g_per_kwh, pue)
    want = dict(labels or {})
    matching = _job_where(since_s=since_s, job_id=job_id, kind=kind, until_s=until_s, host=host)
    where = list(matching)
    after: tuple[float, str] | None = None if cursor is None else decode_cursor(cursor)
    # Ids order as bytes on both backends (SQLite's BINARY; "C" on PostgreSQL, whose database collation
    # may put "a-c" after "ab"), as Python orders them when it cuts a page and writes its cursor: else a
    # page on such a database could skip or repeat jobs that started at the same instant.
    id_bytes = jobs.c.id.collate("C") if engine.dialect.name == "postgresql" else jobs.c.id
    if after is not None:
        where.append(or_(jobs.c.started_at_s > after[0], and_(jobs.c.started_at_s == after[0], id_bytes > after[1])))
    in_order = (jobs.c.started_at_s, id_bytes)
    with snapshot(engine) as conn:
        kept: list[str] | None = None
        matched: int | None = None
        if name is not None or want:
            # Globs and JSON labels are matched here, the same on SQLite and PostgreSQL (LIKE differs in
            # case, JSON operators in syntax); only the window's rows are read, every page's (for the count).
            rows = conn.execute(
                select(jobs.c.id, jobs.c.name, jobs.c.labels, jobs.c.started_at_s).where(*matching).order_by(*in_order)
            ).all()
            hits = [r for r in rows if _matches(r.name, r.labels, name, want)]
            matched = len(hits)
            kept = [r.id for r in hits if after is None or (r.started_at_s, r.id) > after]
        elif limit is not None:
            # Only the page's ids are read, in order; entries (the joins) are built for those alone.
            kept = list(conn.execute(select(jobs.c.id).where(*where).order_by(*in_order).limit(limit + 1)).scalars())
        more = kept is not None and limit is not None and len(kept) > limit
        if kept is not None and limit is not None:
            kept = kept[:limit]
        if matched is None and (more or after is not None):
            # Other pages hold jobs too: count them all (one indexed count), so "100 of 4,667" can be said.
            matched = conn.execute(select(func.count()).select_from(jobs).where(*matching)).scalar_one()
        job_ids: Select[Any] | list[str] = select(jobs.c.id).where(*where) if kept is None else kept
        entries = job_entries(conn, job_ids, carbon=policy, now_s=now_s)
        ordered = sorted(entries.values(), key=lambda e: (e["started_at_s"], e["id"]))
        idle_host_names = {h for e in ordered for h in e["hosts"]} if job_id is not None else None
        if host is not None:
            idle_host_names = {host} if idle_host_names is None else idle_host_names & {host}
        idle_from_s, idle_until_s = idle_bounds(since_s, until_s, now_s=now_s)
        idle = (
            []
            if cursor is not None
            else read_idle(conn, since_s=idle_from_s, until_s=idle_until_s, host_names=idle_host_names)
        )
        intensity = Intensities(conn, policy)
        shown = {h for e in ordered for h in e["hosts"]} | {r["host"] for r in idle}
        carbon_summary = policy.summary([(h, intensity.sent.get(h)) for h in shown], ordered)
        recorded = bool(ordered) or conn.execute(select(jobs.c.id).limit(1)).first() is not None
    filters = {
        "since": iso_utc(since_s),
        "until": iso_utc(until_s),
        "job": job_id,
        "kind": kind,
        "host": host,
        "name": name,
        "labels": [k if v is None else f"{k}={v}" for k, v in want.items()] or None,
    }
    last = ordered[-1] if ordered and more else None
    return {
        "jobs": ordered,
        "idle": idle,
        "filters": {k: v for k, v in filters.items() if v is not None},
        "jobs_recorded": recorded,
        "idle_from": iso_utc(idle_from_s),
        "idle_until": iso_utc(idle_until_s),
        "next_cursor": encode_cursor(last["started_at_s"], last["id"]) if last is not None else None,
        # Jobs matching the filters on every page (this one's count when it is the only page).
        "jobs_matched": len(ordered) if matched is None else matched,
        "carbon": carbon_summary,
        # This page's sums and the idle share (report_group.totals: the CLI's footer is the same figures).
        "totals": totals(ordered, idle),
    }


def list_jobs(
    engine: Engine,
    *,
    since_s: float | None = None,
    kind: str | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
    grid_intensity_g_per_kwh: float = 400.0,
    pue: float = 1.0,
    now_s: float | None = None,
    carbon: CarbonPolicy | None = None,
) -> list[dict[str, Any]]:
    """The newest ``limit`` jobs (by start) as report entries; same filters as ``build_report``."""
    now_s = time.time() if now_s is None else now_s
    where = _job_where(since_s=since_s, job_id=None, kind=kind)
    with snapshot(engine) as conn:
        newest = (
            conn.execute(select(jobs.c.id).where(*where).order_by(jobs.c.started_at_s.desc(), jobs.c.id).limit(limit))
            .scalars()
            .all()
        )
        if not newest:
            return []
        entries = job_entries(
            conn,
            select(jobs.c.id).where(jobs.c.id.in_(newest)),
            carbon=policy_of(carbon, grid_intensity_g_per_kwh, pue),
            now_s=now_s,
        )
    return [entries[job_id] for job_id in newest if job_id in entries]


def get_job(
    engine: Engine,
    job_id: str,
    *,
    grid_intensity_g_per_kwh: float = 400.0,
    pue: float = 1.0,
    now_s: float | None = None,
    carbon: CarbonPolicy | None = None,
) -> dict[str, Any] | None:
    """One job's report entry, or None if no such job."""
    now_s = time.time() if now_s is None else now_s
    with snapshot(engine) as conn:
        entries = job_entries(
            conn,
            select(jobs.c.id).where(jobs.c.id == job_id),
            carbon=policy_of(carbon, grid_intensity_g_per_kwh, pue),
            now_s=now_s,
        )
    return entries.get(job_id)
