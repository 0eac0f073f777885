"""Idle energy's time grid: whole hours, folded into whole days once older than ``IDLE_DAILY_AFTER_S``,
and the read of a window's idle energy per device that reports show.

Ingest adds idle energy per (device, hour) and per (device, day) (``storage.rollup_writes``), the prune pass
folds old hours into days (``storage.retention``), and reports bound a window so both give the same sums.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Connection, func, select

from wattwatch.accounting.rollup import hour_floor_s
from wattwatch.storage.tables import devices, hosts, idle_energy, idle_energy_days

# Idle hours older than this are folded into days (storage.retention.fold_idle_days); reports bound idle
# by days beyond it (idle_bounds).
IDLE_DAILY_AFTER_S = 2 * 86400.0
DAY_S = 86400.0
HOUR_S = 3600.0


def day_floor_s(t_s: float) -> float:
    """The start (UTC midnight) of the day containing ``t_s``."""
    return math.floor(t_s / DAY_S) * DAY_S


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


def read_idle(
    conn: Connection, *, since_s: float | None, host_names: set[str] | None, until_s: float | None = None
) -> list[dict[str, Any]]:
    """Idle energy per device in ``[since_s, until_s)`` (bounds from ``idle_bounds``), on ``host_names`` only
    (None: every host), in host and device order."""
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
