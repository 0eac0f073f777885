"""Additions onto the energy rollups: per (job, device), per (job, host), idle per (device, hour and day)
and each device's running totals. Each is one upsert that adds to what is stored, so batches of one
group, or of several collectors, add up in any order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, String, and_, bindparam, case, or_, update

from wattwatch.accounting.rollup import JobHostTotals
from wattwatch.storage.dialect import append_token, cached_upsert, execute_rows, greatest, least
from wattwatch.storage.idle import day_floor_s
from wattwatch.storage.tables import device_energy, idle_energy, idle_energy_days, job_device_energy, job_hosts


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
