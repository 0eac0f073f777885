"""What ``wattwatch top`` shows: each device's power now, the running jobs holding it, and each running
job's energy so far, J/query and J/step (``GET /api/v1/live``).

Bounded cost, whatever the history: the running jobs' report entries (``reads``: O(running jobs)), and per
host heard from lately one index seek for its latest raw batch (``raw_batches``' ``(host_id, t_start_s)``
index) plus the few batches of the seconds before it, decoded: O(hosts x devices), never a scan. The
devices' latest intervals give both the power now and who holds each device now (their shares).

"Now" is as of the latest batch a host pushed: agents push every few seconds (``--push-interval``), so
the figures trail the hardware by up to that much; ``power_at_s`` says when each reading ends.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Engine, and_, func, select

from wattwatch.carbon.policy import CarbonPolicy
from wattwatch.protocol import wire
from wattwatch.storage.job_entries import job_entries, policy_of, snapshot
from wattwatch.storage.metrics_reads import POWER_FRESH_S
from wattwatch.storage.raw_batches import decode_intervals
from wattwatch.storage.tables import devices, hosts, jobs, raw_batches

# Hosts silent for longer than this are left out (their devices' power is no "now").
HOST_FRESH_S = 600.0
# Power now is the mean over the latest interval and those that started within this much before it: a
# 0.1 s fine tick alone is noisy.
POWER_SPAN_S = 1.0
# The batches read per host: its latest and those ending up to this long before it starts (a batch sealed
# at a job's start or end may hold only a sliver of a second; the push before it holds the rest), among the
# batches that started within the lookback (a batch spans one push interval, or a restart's gap).
BATCHES_SPAN_S = 5.0
BATCHES_LOOKBACK_S = 300.0
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
    rb = raw_batches
    running = select(jobs.c.id).where(jobs.c.ended_at_s.is_(None), jobs.c.phase_of.is_(None))
    with snapshot(engine) as conn:
        entries = job_entries(conn, running, carbon=policy_of(carbon, 400.0, 1.0), now_s=now_s)
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
        # Each host's latest batches: an index seek for its latest batch start on (host_id, t_start_s), then
        # the batches that end up to BATCHES_SPAN_S before it, looked for among those of the last
        # BATCHES_LOOKBACK_S (an index range): a few per host, whatever the history.
        last = rb.alias("last")
        latest = (
            select(func.max(last.c.t_start_s)).where(last.c.host_id == hosts.c.id).correlate(hosts).scalar_subquery()
        )
        batch_rows = conn.execute(
            select(rb.c.host_id, rb.c.format, rb.c.body)
            .select_from(
                hosts.join(
                    rb,
                    and_(
                        rb.c.host_id == hosts.c.id,
                        rb.c.t_start_s >= latest - BATCHES_LOOKBACK_S,
                        rb.c.t_end_s >= latest - BATCHES_SPAN_S,
                    ),
                )
            )
            .where(hosts.c.id.in_(host_ids))
        ).all()
    # Per device: its latest interval, and those that started within POWER_SPAN_S before it.
    recent: dict[tuple[int, str], list[wire.Interval]] = {}
    for host_id, fmt, body in batch_rows:
        try:
            intervals = decode_intervals(bytes(body), int(fmt))
        except ValueError:
            continue  # a format of a newer version: no power from it
        for iv in intervals:
            recent.setdefault((host_id, iv.device), []).append(iv)
    power: dict[int, tuple[float, float]] = {}
    holders: dict[int, list[str]] = {}
    for d in device_rows:
        ivs = recent.get((d.host_id, d.key))
        if not ivs:
            continue
        newest = max(ivs, key=lambda iv: iv.t_start_s)
        window = [iv for iv in ivs if iv.t_start_s >= newest.t_start_s - POWER_SPAN_S]
        start_s, end_s = min(iv.t_start_s for iv in window), max(iv.t_end_s for iv in window)
        if end_s > start_s and end_s >= now_s - POWER_FRESH_S:
            power[d.id] = (math.fsum(iv.energy_j for iv in window) / (end_s - start_s), end_s)
            # Who holds it now: the running jobs sharing its latest interval.
            holders[d.id] = sorted(j for j, w in newest.shares.items() if w > 0 and j in entries)
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
