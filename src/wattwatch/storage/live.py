"""What ``wattwatch top`` shows: each device's power now, the running jobs holding it, and each running
job's energy so far, J/query and J/step (``GET /api/v1/live``).

Bounded cost, whatever the history: the running jobs' report entries (``reads``: O(running jobs)), and
per device of the hosts heard from lately one index seek for its latest interval plus the intervals of
the second before it (the ``(device_id, t_start_s)`` index), so O(devices), never a scan of the raw
intervals.

"Now" is as of the latest batch a host pushed: agents push every few seconds (``--push-interval``), so
the figures trail the hardware by up to that much; ``power_at_s`` says when each reading ends.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, and_, func, select

from wattwatch.carbon_policy import CarbonPolicy
from wattwatch.storage.reads import POWER_FRESH_S, _job_entries, _policy, _snapshot
from wattwatch.storage.tables import devices, energy_intervals, hosts, job_device_energy, jobs

# Hosts silent for longer than this are left out (their devices' power is no "now").
HOST_FRESH_S = 600.0
# Power now is the mean over the latest interval and those that started within this much before it: a
# 0.1 s fine tick alone is noisy.
POWER_SPAN_S = 1.0
# Fields of a running job's report entry that the live view carries.
JOB_FIELDS = (
    "id",
    "short_id",
    "name",
    "kind",
    "started_at_s",
    "duration_s",
    "energy_j",
    "avg_power_w",
    "queries",
    "energy_per_query_j",
    "steps",
    "energy_per_step_j",
    "devices",
    "reason",
)


def live_view(
    engine: Engine,
    *,
    now_s: float,
    carbon: CarbonPolicy | None = None,
    host_fresh_s: float = HOST_FRESH_S,
) -> dict[str, Any]:
    """``{"at_s", "hosts": [{"host", "last_seen_s", "devices": [{"device", "kind", "model", "power_w",
    "power_at_s", "jobs"}]}], "jobs": [running job, with "gpu_power_w" now]}``; hosts by name, devices by key,
    jobs by start."""
    ei = energy_intervals
    running = select(jobs.c.id).where(jobs.c.ended_at_s.is_(None), jobs.c.phase_of.is_(None))
    with _snapshot(engine) as conn:
        entries = _job_entries(conn, running, carbon=_policy(carbon, 400.0, 1.0), now_s=now_s)
        host_rows = conn.execute(
            select(hosts.c.id, hosts.c.name, hosts.c.last_seen_s)
            .where(hosts.c.last_seen_s >= now_s - host_fresh_s)
            .order_by(hosts.c.name)
        ).all()
        host_ids = [r.id for r in host_rows]
        device_rows = conn.execute(
            select(devices.c.id, devices.c.host_id, devices.c.key, devices.c.kind, devices.c.model)
            .where(devices.c.host_id.in_(host_ids))
            .order_by(devices.c.host_id, devices.c.kind.desc(), devices.c.index, devices.c.key)
        ).all()
        # Per device: its latest interval's start (an index seek: max over the (device_id, t_start_s) index),
        # then the intervals from POWER_SPAN_S before it.
        last = ei.alias("last")
        latest = (
            select(func.max(last.c.t_start_s))
            .where(last.c.device_id == devices.c.id)
            .correlate(devices)
            .scalar_subquery()
        )
        power_rows = conn.execute(
            select(devices.c.id, func.sum(ei.c.energy_j), func.min(ei.c.t_start_s), func.max(ei.c.t_end_s))
            .select_from(
                devices.join(ei, and_(ei.c.device_id == devices.c.id, ei.c.t_start_s >= latest - POWER_SPAN_S))
            )
            .where(devices.c.host_id.in_(host_ids))
            .group_by(devices.c.id)
        ).all()
        # Which running job holds each device: those with energy on it.
        jde = job_device_energy
        holder_rows = conn.execute(
            select(jde.c.device_id, jde.c.job_id)
            .where(jde.c.job_id.in_(running), jde.c.energy_j > 0)
            .order_by(jde.c.device_id, jde.c.job_id)
        ).all()
    power: dict[int, tuple[float, float]] = {}
    for device_id, energy_j, start_s, end_s in power_rows:
        if energy_j is not None and end_s is not None and end_s > start_s and end_s >= now_s - POWER_FRESH_S:
            power[device_id] = (float(energy_j) / (end_s - start_s), float(end_s))
    holders: dict[int, list[str]] = {}
    for device_id, job_id in holder_rows:
        holders.setdefault(device_id, []).append(job_id)
    by_host: dict[int, list[dict[str, Any]]] = {}
    for d in device_rows:
        watts, at_s = power.get(d.id, (None, None))
        by_host.setdefault(d.host_id, []).append(
            {
                "device": d.key,
                "kind": d.kind,
                "model": d.model,
                "power_w": watts,
                "power_at_s": at_s,
                "jobs": holders.get(d.id, []),
            }
        )
    # A job's GPU power now: the power of each GPU it holds, shared evenly with the other jobs holding it
    # (the collector's per-job split of a shared GPU comes with the next rollup; this is a glance).
    gpu_power: dict[str, float] = {}
    for d in device_rows:
        held = holders.get(d.id, [])
        if d.kind == "gpu" and d.id in power and held:
            for job_id in held:
                gpu_power[job_id] = gpu_power.get(job_id, 0.0) + power[d.id][0] / len(held)
    live_jobs = []
    for entry in sorted(entries.values(), key=lambda e: (e["started_at_s"], e["id"])):
        job = {k: entry.get(k) for k in JOB_FIELDS}
        job["gpu_power_w"] = gpu_power.get(entry["id"])
        live_jobs.append(job)
    return {
        "at_s": now_s,
        "hosts": [
            {"host": r.name, "last_seen_s": float(r.last_seen_s), "devices": by_host.get(r.id, [])} for r in host_rows
        ],
        "jobs": live_jobs,
    }
