"""What ``/metrics`` shows, read once per scrape: per-job energy and power now, per-device totals, spans,
and when each host last pushed. Bounded: finished jobs drop out after the retention cut, and device totals
come from ``device_energy``'s one row per device, never the raw intervals."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sqlalchemy import Engine, func, or_, select

from wattwatch.storage.job_entries import snapshot
from wattwatch.storage.span_reads import SpanFigures, read_span_figures
from wattwatch.storage.tables import device_energy, devices, hosts, job_device_energy, job_hosts, jobs

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
        with snapshot(engine) as conn:
            conn.execute(select(1))
        return MetricsSnapshot()
    jde = job_device_energy
    device_host = jde.join(devices, jde.c.device_id == devices.c.id).join(hosts, devices.c.host_id == hosts.c.id)
    visible = or_(jobs.c.ended_at_s.is_(None), jobs.c.ended_at_s >= now_s - retention_s)
    snap = MetricsSnapshot()
    with snapshot(engine) as conn:
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
