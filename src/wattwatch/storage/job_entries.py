"""A job's report entry, built from the rollups: its energy per host, device and kind, peak power, spans,
carbon, phases and why it shows what it shows. ``storage.reads`` (reports, job lists, one job) and
``storage.live`` (``wattwatch top``) return these entries, so every view agrees on every number.

Phases (``jobs.phase``, see ``agent.tracker``): the energy a job's process drew before the job opened
(``setup``) or after it ended while it stayed on its GPUs (``after``) is stored as a job of its own, so
every joule is held by exactly one job or is idle. An entry shows those rows with their job:
``setup_energy_j``/``setup_duration_s``, ``after_energy_j``/``after_duration_s`` and the ``phases`` they
came from. A job's ``energy_j`` stays its own window's energy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Select, func, select

from wattwatch.carbon.grid import GridIntensity
from wattwatch.carbon.policy import CarbonPolicy
from wattwatch.protocol.units import DEVICE_KINDS, iso_utc, j_to_kwh
from wattwatch.storage.dialect import among
from wattwatch.storage.job_refs import short_ids
from wattwatch.storage.span_reads import SpanFigures, read_span_figures
from wattwatch.storage.tables import devices, hosts, job_device_energy, job_hosts, jobs
from wattwatch.storage.unmeasured import unmeasured_s
from wattwatch.storage.zero_reasons import explain

_SOURCE_NOTES = {
    "estimate": "includes estimated energy (no hardware counter: CPU power from TDP x utilisation)",
    "power": "includes energy integrated from power readings (no energy counter)",
    "simulated": "includes simulated devices (demo data, not a measurement)",
}


@contextmanager
def snapshot(engine: Engine) -> Iterator[Connection]:
    """A connection whose reads all see one snapshot, so a report's numbers agree with each other."""
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
    # On SQLite a read transaction in WAL mode is already a snapshot.
    with conn, conn.begin():
        yield conn


def job_entries(
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
    intensity = Intensities(conn, carbon)
    jde = job_device_energy
    energy_rows = conn.execute(
        select(
            jde.c.job_id, hosts.c.name, devices.c.key, devices.c.kind, jde.c.energy_j, jde.c.sources, jde.c.device_id
        )
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
    per_job_device_ids: dict[str, set[int]] = {}
    for job_id, host, key, kind, energy_j, sources, device_id in energy_rows:
        per_job_device_ids.setdefault(job_id, set()).add(device_id)
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
    # Seconds of each job's window in which one of its devices was not measured (storage.unmeasured).
    windows = {str(r.id): (r.started_at_s, r.ended_at_s if r.ended_at_s is not None else now_s) for r in job_rows}
    unmeasured = unmeasured_s(conn, windows, per_job_device_ids)
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
            # Of duration_s, the seconds no reading of one of its devices covers (its energy then is not in
            # energy_j): an agent's full disk or an outage its counters could not bridge.
            "unmeasured_s": unmeasured.get(job.id, 0.0),
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


class Intensities:
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
    carbon: CarbonPolicy, intensity: Intensities, per_host: Mapping[str, Mapping[str, float]], energy_j: float
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


def policy_of(carbon: CarbonPolicy | None, grid_intensity_g_per_kwh: float, pue: float) -> CarbonPolicy:
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
