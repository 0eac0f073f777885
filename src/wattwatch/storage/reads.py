"""Reads for reports, job lists and /metrics. They read the rollups only: O(jobs), never the raw intervals.

One report entry per job, shaped exactly as DESIGN.md's report JSON (plus a few extra fields);
``build_report``, ``list_jobs`` and ``get_job`` all return these entries, so the CLI, the HTTP API
and the dashboards agree on every number.

Phases (``jobs.phase``, see ``agent.tracker``): the energy a job's process drew before the job opened
(``setup``) or after it ended while it stayed on its GPUs (``after``) is stored as a job of its own, so
every joule is held by exactly one job or is idle. Reports and job lists hide those rows and show them
with their job: ``setup_energy_j``/``setup_duration_s``, ``after_energy_j``/``after_duration_s`` and the
``phases`` they came from. A job's ``energy_j`` stays its own window's energy; jobs' energy plus their
setup and after energy plus idle is what the devices measured. ``get_job`` of a phase's own id still
answers (with ``phase`` and ``phase_of`` set).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import json
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, Select, and_, func, or_, select
from sqlalchemy.sql.elements import ColumnElement

from wattwatch.accounting.rollup import hour_floor_s
from wattwatch.carbon_policy import CarbonPolicy
from wattwatch.grid import GridIntensity
from wattwatch.report_group import totals
from wattwatch.storage.dialect import among
from wattwatch.storage.job_refs import resolve_job_ref, short_ids
from wattwatch.storage.span_reads import SpanFigures, read_span_figures
from wattwatch.storage.tables import (
    device_energy,
    devices,
    hosts,
    idle_energy,
    idle_energy_days,
    job_device_energy,
    job_hosts,
    jobs,
)
from wattwatch.storage.zero_reasons import explain
from wattwatch.units import DEVICE_KINDS, JOB_KINDS, iso_utc, j_to_kwh

DEFAULT_LIST_LIMIT = 100

# Idle hours older than this are folded into days (storage.retention.fold_idle_days); reports bound idle
# by days beyond it (idle_bounds).
IDLE_DAILY_AFTER_S = 2 * 86400.0
DAY_S = 86400.0
HOUR_S = 3600.0


def day_floor_s(t_s: float) -> float:
    """The start (UTC midnight) of the day containing ``t_s``."""
    return math.floor(t_s / DAY_S) * DAY_S


_SOURCE_NOTES = {
    "estimate": "includes estimated energy (no hardware counter: CPU power from TDP x utilisation)",
    "power": "includes energy integrated from power readings (no energy counter)",
    "simulated": "includes simulated devices (demo data, not a measurement)",
}


@contextmanager
def _snapshot(engine: Engine) -> Iterator[Connection]:
    """A connection whose reads all see one snapshot, so a report's numbers agree with each other."""
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
    # On SQLite a read transaction in WAL mode is already a snapshot.
    with conn, conn.begin():
        yield conn


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


def _job_entries(
    conn: Connection,
    job_ids: Select[Any] | list[str],
    *,
    carbon: CarbonPolicy,
    now_s: float,
) -> dict[str, dict[str, Any]]:
    """Report entries for the jobs ``job_ids`` selects or lists, keyed by job id (caller orders them)."""
    job_rows = conn.execute(select(jobs).where(among(conn, jobs.c.id, job_ids))).all()
    if not job_rows:
        return {}
    # The ids themselves from here on, not the select again: a list of ids is probed on each table's
    # primary key, where a subquery let PostgreSQL hash-join whole rollup tables (8 ms of a report's
    # job_hosts read at 20,000 jobs).
    ids = [str(r.id) for r in job_rows]
    intensity = _Intensities(conn, carbon)
    jde = job_device_energy
    energy_rows = conn.execute(
        select(jde.c.job_id, hosts.c.name, devices.c.key, devices.c.kind, jde.c.energy_j, jde.c.sources)
        .select_from(jde.join(devices, jde.c.device_id == devices.c.id).join(hosts, devices.c.host_id == hosts.c.id))
        .where(among(conn, jde.c.job_id, ids))
    ).all()
    host_rows = conn.execute(
        select(job_hosts.c.job_id, hosts.c.name, job_hosts.c.peak_power_w)
        .select_from(job_hosts.join(hosts, job_hosts.c.host_id == hosts.c.id))
        .where(among(conn, job_hosts.c.job_id, ids))
    ).all()
    figures = read_span_figures(conn, ids)
    phases = _phases_of(conn, ids, now_s=now_s)
    shorts = short_ids(conn, [r.id for r in job_rows if r.phase_of is None])

    per_job_host: dict[str, dict[str, dict[str, float]]] = {}
    per_job_kind: dict[str, dict[str, float]] = {}
    per_job_devices: dict[str, set[str]] = {}
    per_job_sources: dict[str, set[str]] = {}
    per_job_device: dict[str, list[dict[str, Any]]] = {}
    held_gpu: set[str] = set()
    for job_id, host, key, kind, energy_j, sources in energy_rows:
        if kind == "gpu":
            held_gpu.add(job_id)
        per_job_device.setdefault(job_id, []).append(
            {
                "host": host,
                "device": key,
                "kind": kind,
                "energy_j": energy_j,
                "sources": sorted(set(sources.split(",")) - {""}),
            }
        )
        h = per_job_host.setdefault(job_id, {}).setdefault(host, {"energy_j": 0.0, "peak_power_w": 0.0})
        h["energy_j"] += energy_j
        by_kind = per_job_kind.setdefault(job_id, dict.fromkeys(DEVICE_KINDS, 0.0))
        by_kind[kind] = by_kind.get(kind, 0.0) + energy_j
        # A device the job held no energy of (a CPU package while it only waited on the GPU) is not
        # one of its devices, and its source (often "estimate") is not one of the job's sources.
        if energy_j > 0.0:
            per_job_devices.setdefault(job_id, set()).add(f"{host}/{key}")
            per_job_sources.setdefault(job_id, set()).update(s for s in sources.split(",") if s)
    for job_id, host, peak_power_w in host_rows:
        h = per_job_host.setdefault(job_id, {}).setdefault(host, {"energy_j": 0.0, "peak_power_w": 0.0})
        h["peak_power_w"] = peak_power_w

    on_host = devices.join(hosts, devices.c.host_id == hosts.c.id)
    gpu_hosts = set(
        conn.execute(select(hosts.c.name).distinct().select_from(on_host).where(devices.c.kind == "gpu")).scalars()
    )
    entries: dict[str, dict[str, Any]] = {}
    for job in job_rows:
        by_kind = per_job_kind.get(job.id, dict.fromkeys(DEVICE_KINDS, 0.0))
        energy_j = math.fsum(by_kind.values())
        end_s = job.ended_at_s if job.ended_at_s is not None else now_s
        duration_s = max(end_s - job.started_at_s, 0.0)
        spans = figures.get(job.id, SpanFigures()).report_fields()
        per_host = per_job_host.get(job.id, {})
        sources = sorted(per_job_sources.get(job.id, set()))
        notes = [_SOURCE_NOTES[s] for s in sources if s in _SOURCE_NOTES]
        avg_power_w = energy_j / duration_s if duration_s > 0 else None
        entries[job.id] = {
            "id": job.id,
            # The id prefix tables show: unique in this database, so `--job` takes it back.
            "short_id": shorts.get(job.id, job.id),
            "name": job.name,
            "kind": job.kind,
            "started_at": iso_utc(job.started_at_s),
            "ended_at": iso_utc(job.ended_at_s),
            "duration_s": duration_s,
            "hosts": sorted(per_host),
            "devices": sorted(per_job_devices.get(job.id, set())),
            "energy_j": energy_j,
            "gpu_energy_j": by_kind["gpu"],
            "cpu_energy_j": by_kind["cpu"],
            "dram_energy_j": by_kind["dram"],
            "avg_power_w": avg_power_w,
            # Sum of each host's peak: exact on one host, an upper bound when hosts peak at different times.
            # A job shorter than a peak window has no peak of its own: its average is the best figure.
            "peak_power_w": max(math.fsum(h["peak_power_w"] for h in per_host.values()), avg_power_w or 0.0),
            # queries, tokens, energy_per_query_j, energy_per_token_j, and the per-query/per-step extras.
            **spans,
            # Each host's energy at its own grid's intensity (carbon_policy); the figures used beside them.
            **_carbon_fields(carbon, intensity, per_host, energy_j),
            "sources": sources,
            # Extras (DESIGN: "more fields are welcome").
            "labels": dict(job.labels or {}),
            "running": job.ended_at_s is None,
            # Null when the job's own process or client ended it; else who did (see tables.jobs).
            "ended_by": job.ended_by,
            "started_at_s": job.started_at_s,
            "ended_at_s": job.ended_at_s,
            "per_host": [
                {
                    "host": name,
                    "energy_j": h["energy_j"],
                    "peak_power_w": h["peak_power_w"],
                    "grid_intensity_g_per_kwh": intensity(name).g_per_kwh,
                    "emissions_g": carbon.emissions_g(h["energy_j"], intensity(name)),
                }
                for name, h in sorted(per_host.items())
            ],
            # Each device the job held a share of (0 J included: a GPU it held while it drew nothing), by host
            # and key; peak power is known per host only (job_hosts).
            "per_device": sorted(per_job_device.get(job.id, []), key=lambda d: (d["host"], d["device"])),
            "source_note": "; ".join(notes) or None,
            **_phase_fields(phases.get(job.id, [])),
            "phase": job.phase,
            "phase_of": job.phase_of,
        }
        entry = entries[job.id]
        # Why it shows 0 J or no GPU, and what to do (None when its figures need no explaining).
        entry["reason"], entry["fix"] = explain(entry, gpu_hosts, held_gpu=job.id in held_gpu)
    return entries


class _Intensities:
    """host name -> its GridIntensity under ``carbon``, each host resolved once per read."""

    def __init__(self, conn: Connection, carbon: CarbonPolicy) -> None:
        self.carbon = carbon
        self.sent: dict[str, str | None] = {
            r.name: r.grid_region for r in conn.execute(select(hosts.c.name, hosts.c.grid_region))
        }
        self._cache: dict[str, GridIntensity] = {}

    def __call__(self, host: str) -> GridIntensity:
        if host not in self._cache:
            self._cache[host] = self.carbon.intensity(host, self.sent.get(host))
        return self._cache[host]


def _carbon_fields(
    carbon: CarbonPolicy, intensity: _Intensities, per_host: Mapping[str, Mapping[str, float]], energy_j: float
) -> dict[str, Any]:
    """A job's emissions and cost, and the intensity (energy-weighted over its hosts), source and PUE used."""
    used = {name: intensity(name) for name in per_host} or {"": intensity("")}  # no host: the default's
    grams = math.fsum(carbon.emissions_g(h["energy_j"], used[name]) for name, h in per_host.items())
    kwh = j_to_kwh(energy_j) * carbon.pue
    # Energy-weighted over its hosts; a job without energy shows its hosts' plain mean.
    g_per_kwh = grams / kwh if kwh > 0 else sum(i.g_per_kwh for i in used.values()) / len(used)
    return {
        "emissions_g": grams,
        "cost": carbon.cost(energy_j),
        "grid_intensity_g_per_kwh": g_per_kwh,
        "intensity_source": "; ".join(sorted({i.source for i in used.values()})),
        "pue": carbon.pue,
    }


def _policy(carbon: CarbonPolicy | None, grid_intensity_g_per_kwh: float, pue: float) -> CarbonPolicy:
    """``carbon``, or (callers from before per-host intensities) a policy of one intensity and PUE."""
    return carbon if carbon is not None else CarbonPolicy(default_g_per_kwh=grid_intensity_g_per_kwh, pue=pue)


def _phases_of(conn: Connection, job_ids: Select[Any] | list[str], *, now_s: float) -> dict[str, list[dict[str, Any]]]:
    """job id -> the phases (setup, after) of the jobs ``job_ids`` selects, in start order, with their energy."""
    phase = jobs.alias("phase")  # not correlated with the ``jobs`` that ``job_ids`` reads
    rows = conn.execute(
        select(phase.c.id, phase.c.phase, phase.c.phase_of, phase.c.started_at_s, phase.c.ended_at_s).where(
            among(conn, phase.c.phase_of, job_ids)
        )
    ).all()
    if not rows:
        return {}
    jde = job_device_energy
    energy_j = dict(
        conn.execute(
            select(jde.c.job_id, func.sum(jde.c.energy_j))
            .where(among(conn, jde.c.job_id, [r.id for r in rows]))
            .group_by(jde.c.job_id)
        ).all()
    )
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: (r.started_at_s, r.id)):
        out.setdefault(r.phase_of, []).append(
            {
                "id": r.id,
                "phase": r.phase,
                "energy_j": float(energy_j.get(r.id) or 0.0),
                "started_at_s": r.started_at_s,
                "ended_at_s": r.ended_at_s,
                "duration_s": max((r.ended_at_s if r.ended_at_s is not None else now_s) - r.started_at_s, 0.0),
            }
        )
    return out


def _phase_fields(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """A job's setup and after figures from its phases: energy summed, time the span they cover (a job's
    processes' phases overlap in time); None when it has no such phase."""
    fields: dict[str, Any] = {}
    for name in ("setup", "after"):
        mine = [p for p in phases if p["phase"] == name]
        if not mine:
            fields[f"{name}_energy_j"] = fields[f"{name}_duration_s"] = None
            continue
        start_s = min(p["started_at_s"] for p in mine)
        end_s = max(p["started_at_s"] + p["duration_s"] for p in mine)
        fields[f"{name}_energy_j"] = math.fsum(p["energy_j"] for p in mine)
        fields[f"{name}_duration_s"] = end_s - start_s
    fields["phases"] = phases
    return fields


class BadCursor(ValueError):
    """A report ``cursor`` this collector did not write (or a mangled one)."""


def encode_cursor(started_at_s: float, job_id: str) -> str:
    """The opaque ``cursor`` of a report page that ends with this job (start time and id, base64url)."""
    raw = json.dumps([started_at_s, job_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """``encode_cursor``'s (start time, job id); BadCursor for anything it did not write."""
    try:
        value = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        started_at_s, job_id = value
        if not isinstance(job_id, str) or isinstance(started_at_s, bool):
            raise TypeError
        started_at_s = float(started_at_s)
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise BadCursor(f"{cursor[:40]!r} is not a cursor this collector gave; use next_cursor as given") from None
    if not math.isfinite(started_at_s):
        raise BadCursor("the cursor's start time is not a number; use next_cursor as given")
    return started_at_s, job_id


def resolve_job(engine: Engine, ref: str) -> str | None:
    """The id of the job ``ref`` names: its id, a unique id prefix or its name (``job_refs``); None when
    no job matches. Raises ``job_refs.AmbiguousJob`` when several do."""
    with _snapshot(engine) as conn:
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
    policy = _policy(carbon, grid_intensity_g_per_kwh, pue)
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
    with _snapshot(engine) as conn:
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
        entries = _job_entries(conn, job_ids, carbon=policy, now_s=now_s)
        ordered = sorted(entries.values(), key=lambda e: (e["started_at_s"], e["id"]))
        idle_host_names = {h for e in ordered for h in e["hosts"]} if job_id is not None else None
        if host is not None:
            idle_host_names = {host} if idle_host_names is None else idle_host_names & {host}
        idle_from_s, idle_until_s = idle_bounds(since_s, until_s, now_s=now_s)
        idle = (
            []
            if cursor is not None
            else _idle(conn, since_s=idle_from_s, until_s=idle_until_s, host_names=idle_host_names)
        )
        intensity = _Intensities(conn, policy)
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


def idle_bounds(since_s: float | None, until_s: float | None, *, now_s: float) -> tuple[float | None, float | None]:
    """The whole hours, or whole days, a report's idle energy covers: ``[from, until)``.

    Idle hours older than ``IDLE_DAILY_AFTER_S`` are folded into one row per device and day by the prune
    pass (``storage.retention``). A bound older than that is taken to the day (the day containing
    ``since``, days starting before ``until``), so a report reads the same sum whether the pass has folded
    those hours yet or not; newer bounds stay whole hours (the hour containing ``since``, hours starting
    before ``until``)."""
    old_s = now_s - IDLE_DAILY_AFTER_S

    def floor(t_s: float) -> float:
        return day_floor_s(t_s) if t_s < old_s else hour_floor_s(t_s)

    def ceil(t_s: float) -> float:
        step_s = DAY_S if t_s < old_s else HOUR_S
        return math.ceil(t_s / step_s) * step_s

    return (None if since_s is None else floor(since_s), None if until_s is None else ceil(until_s))


def _idle(
    conn: Connection, *, since_s: float | None, host_names: set[str] | None, until_s: float | None = None
) -> list[dict[str, Any]]:
    # Summed per device first (the window's rows through their time index), then named: the join and the
    # grouping by names run over one row per device rather than one per device and hour. The bounds are
    # idle_bounds', already whole hours or days; whole days are read from the days table, which holds the
    # same sums in a 24th of the rows.
    whole_days = all(t is None or t % DAY_S == 0.0 for t in (since_s, until_s))
    table, when = (idle_energy_days, idle_energy_days.c.day_s) if whole_days else (idle_energy, idle_energy.c.hour_s)
    per_device = select(table.c.device_id, func.sum(table.c.energy_j).label("energy_j"))
    if since_s is not None:
        per_device = per_device.where(when >= since_s)
    if until_s is not None:
        per_device = per_device.where(when < until_s)
    if host_names is not None:
        on_hosts = select(devices.c.id).join(hosts, devices.c.host_id == hosts.c.id)
        per_device = per_device.where(table.c.device_id.in_(on_hosts.where(hosts.c.name.in_(sorted(host_names)))))
    sums = per_device.group_by(table.c.device_id).subquery()
    stmt = (
        select(hosts.c.name, devices.c.key, devices.c.kind, sums.c.energy_j)
        .select_from(sums.join(devices, sums.c.device_id == devices.c.id).join(hosts, devices.c.host_id == hosts.c.id))
        .order_by(hosts.c.name, devices.c.key)
    )
    return [
        {"host": host, "device": key, "energy_j": float(energy_j), "device_kind": kind}
        for host, key, kind, energy_j in conn.execute(stmt)
    ]


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
    with _snapshot(engine) as conn:
        newest = (
            conn.execute(select(jobs.c.id).where(*where).order_by(jobs.c.started_at_s.desc(), jobs.c.id).limit(limit))
            .scalars()
            .all()
        )
        if not newest:
            return []
        entries = _job_entries(
            conn,
            select(jobs.c.id).where(jobs.c.id.in_(newest)),
            carbon=_policy(carbon, grid_intensity_g_per_kwh, pue),
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
    with _snapshot(engine) as conn:
        entries = _job_entries(
            conn,
            select(jobs.c.id).where(jobs.c.id == job_id),
            carbon=_policy(carbon, grid_intensity_g_per_kwh, pue),
            now_s=now_s,
        )
    return entries.get(job_id)


# /metrics shows a job's power now only while its host pushed within this long (an agent that went quiet
# must not leave a job looking busy).
POWER_FRESH_S = 60.0


@dataclass
class MetricsJob:
    """One job as /metrics shows it."""

    name: str
    kind: str
    running: bool
    labels: dict[str, str]
    energy_j: float = 0.0
    queries: int = 0
    tokens: int = 0
    # Set on a phase (setup / after) of another job's process: /metrics shows it with that job.
    phase: str | None = None
    phase_of: str | None = None


@dataclass
class MetricsSnapshot:
    """Everything /metrics shows, read once per scrape. Jobs finished before the retention cut are gone."""

    # (job id, host, device kind, joules)
    job_energy: list[tuple[str, str, str, float]] = field(default_factory=list)
    jobs: dict[str, MetricsJob] = field(default_factory=dict)
    # (job id, host, watts): running jobs whose host pushed ticks within POWER_FRESH_S
    job_power: list[tuple[str, str, float]] = field(default_factory=list)
    # job id -> per-query and per-step figures (jobs with spans or counts only)
    spans: dict[str, SpanFigures] = field(default_factory=dict)
    # (host, device key, device kind, joules)
    idle: list[tuple[str, str, str, float]] = field(default_factory=list)
    host: list[tuple[str, str, str, float]] = field(default_factory=list)
    # (host, last batch stored, epoch seconds)
    host_seen: list[tuple[str, float]] = field(default_factory=list)
    # host -> the grid region its agent sent (None: none), for its emissions (carbon_policy)
    host_region: dict[str, str | None] = field(default_factory=dict)


def metrics_snapshot(engine: Engine, *, now_s: float, retention_s: float, totals: bool = True) -> MetricsSnapshot:
    """Totals for /metrics. A finished job stays ``retention_s`` after its end, so label sets stay bounded.

    ``totals=False`` (a replica that does not lead) only proves the database answers: an empty snapshot.
    """
    if not totals:
        with _snapshot(engine) as conn:
            conn.execute(select(1))
        return MetricsSnapshot()
    jde = job_device_energy
    device_host = jde.join(devices, jde.c.device_id == devices.c.id).join(hosts, devices.c.host_id == hosts.c.id)
    visible = or_(jobs.c.ended_at_s.is_(None), jobs.c.ended_at_s >= now_s - retention_s)
    snap = MetricsSnapshot()
    with _snapshot(engine) as conn:
        for r in conn.execute(
            select(
                jobs.c.id, jobs.c.name, jobs.c.kind, jobs.c.ended_at_s, jobs.c.labels, jobs.c.phase, jobs.c.phase_of
            ).where(visible)
        ):
            labels = {str(k): str(v) for k, v in (r.labels or {}).items()}
            snap.jobs[r.id] = MetricsJob(
                r.name, r.kind, r.ended_at_s is None, labels, phase=r.phase, phase_of=r.phase_of
            )
        for job_id, host, device_kind, energy_j in conn.execute(
            select(jde.c.job_id, hosts.c.name, devices.c.kind, func.sum(jde.c.energy_j))
            .select_from(device_host.join(jobs, jobs.c.id == jde.c.job_id))
            .where(visible)
            .group_by(jde.c.job_id, hosts.c.name, devices.c.kind)
        ):
            if job_id in snap.jobs:
                snap.job_energy.append((job_id, host, device_kind, float(energy_j)))
                snap.jobs[job_id].energy_j += float(energy_j)
        for job_id, host, power_w in conn.execute(
            select(job_hosts.c.job_id, hosts.c.name, job_hosts.c.power_w)
            .select_from(job_hosts.join(hosts, job_hosts.c.host_id == hosts.c.id).join(jobs))
            .where(jobs.c.ended_at_s.is_(None), job_hosts.c.power_at_s >= now_s - POWER_FRESH_S)
        ):
            if job_id in snap.jobs and power_w is not None and math.isfinite(power_w):
                snap.job_power.append((job_id, host, float(power_w)))
        snap.spans = read_span_figures(conn, select(jobs.c.id).where(visible))
        for job_id, figures in snap.spans.items():
            if job_id in snap.jobs:
                snap.jobs[job_id].queries = figures.queries
                snap.jobs[job_id].tokens = figures.tokens_in + figures.tokens_out
        # One row per device (device_energy: running totals ingest keeps), not every idle hour and job ever.
        device_rows = conn.execute(
            select(
                hosts.c.name, devices.c.key, devices.c.kind, device_energy.c.job_energy_j, device_energy.c.idle_energy_j
            )
            .select_from(
                device_energy.join(devices, device_energy.c.device_id == devices.c.id).join(
                    hosts, devices.c.host_id == hosts.c.id
                )
            )
            .order_by(hosts.c.name, devices.c.key)
        ).all()
        for name, seen_s, region in conn.execute(select(hosts.c.name, hosts.c.last_seen_s, hosts.c.grid_region)):
            snap.host_seen.append((name, float(seen_s)))
            snap.host_region[name] = region
    host_totals: dict[tuple[str, str, str], float] = {}
    for host, key, device_kind, job_j, idle_j in device_rows:
        if idle_j:
            # A device that never idled (always some job's) has no idle series, as before device_energy.
            snap.idle.append((host, key, device_kind, float(idle_j)))
        # A host's energy counter never goes down: every job ever counts, not only those /metrics still shows.
        host_totals[(host, key, device_kind)] = float(job_j) + float(idle_j)
    snap.host = [(h, k, dk, e) for (h, k, dk), e in sorted(host_totals.items())]
    return snap
