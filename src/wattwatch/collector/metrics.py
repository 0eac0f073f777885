"""The collector's /metrics: ingest self-metrics plus job, idle and host energy read from the rollups.

Everything lives in a registry per app (never prometheus_client's global one), so several apps in one
process (tests, ``wattwatch up``) never share counters. Job metrics are computed once per scrape from one
database snapshot by ``JobMetricsCollector``, and only on the replica that leads (``collector.leader``), so
summing over replicas never double counts. docs/metrics.md lists every family.

Job series are labelled ``job_id``, ``job_name`` and ``kind`` (never ``job``: Prometheus' own scrape
label), plus the job labels an operator names (``--metric-labels team,namespace``). Series that would
always read zero (queries of a training job) are not exported. A phase of a job's process (its setup
before the job opened, or what it drew after the job ended: ``agent.tracker``) is no job series of its
own: its energy is ``wattwatch_job_phase_energy_joules`` with its job's labels, so job + phase + idle
energy is what the hosts measured.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from wattwatch.carbon import policy as carbon_policy
from wattwatch.collector.leader import MetricsLeader
from wattwatch.config import Settings
from wattwatch.errors import ConfigError
from wattwatch.storage.metrics_reads import MetricsSnapshot, metrics_snapshot
from wattwatch.storage.span_reads import SpanFigures

log = logging.getLogger(__name__)

JOB_LABELS = ("job_id", "job_name", "kind")
# Names a user label may not take: ours, and those Prometheus or its exposition format give a meaning.
_RESERVED = {*JOB_LABELS, "host", "device", "device_kind", "quantile", "le", "job", "instance"}
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class IngestMetrics:
    """Counters the ingest route increments."""

    batches: Counter
    intervals: Counter
    errors: Counter
    duplicates: Counter


def metric_label_names(spec: str) -> tuple[tuple[str, str], ...]:
    """``"team,app.kubernetes.io/name"`` -> ``(("team", "team"), ("app.kubernetes.io/name",
    "app_kubernetes_io_name"))``: job label keys and the metric label each becomes; ConfigError on a clash."""
    pairs: list[tuple[str, str]] = []
    for raw in spec.split(","):
        key = raw.strip()
        if not key:
            continue
        name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
        if name[0].isdigit():
            name = f"_{name}"
        if name in _RESERVED or name.startswith("__") or not _LABEL_NAME.fullmatch(name):
            raise ConfigError(
                f"--metric-labels: job label {key!r} would become metric label {name!r}, which wattwatch or "
                f"Prometheus already uses; pick other labels (reserved: {', '.join(sorted(_RESERVED))})"
            )
        if name in (n for _, n in pairs):
            raise ConfigError(f"--metric-labels: two job labels both become metric label {name!r}; keep one")
        pairs.append((key, name))
    return tuple(pairs)


def build_registry(
    engine: Engine, settings: Settings, clock: Callable[[], float], leader: MetricsLeader | None = None
) -> tuple[CollectorRegistry, IngestMetrics]:
    """A fresh registry holding the ingest counters and the job collector."""
    registry = CollectorRegistry()
    ingest = IngestMetrics(
        batches=Counter("wattwatch_ingest_batches", "Agent batches stored (duplicates excluded).", registry=registry),
        intervals=Counter("wattwatch_ingest_intervals", "Device intervals stored.", registry=registry),
        errors=Counter("wattwatch_ingest_errors", "Batches rejected as malformed.", registry=registry),
        duplicates=Counter(
            "wattwatch_ingest_duplicates", "Batches received again and ignored (agent retries).", registry=registry
        ),
    )
    registry.register(JobMetricsCollector(engine, settings, clock, leader or MetricsLeader(engine)))
    return registry, ingest


class JobMetricsCollector(Collector):
    """Job, idle and host energy from the rollup tables, read at scrape time on the leading replica."""

    def __init__(self, engine: Engine, settings: Settings, clock: Callable[[], float], leader: MetricsLeader) -> None:
        self._engine = engine
        self._settings = settings
        self._carbon = carbon_policy.from_settings(settings)
        self._clock = clock
        self._leader = leader
        self._user_labels = metric_label_names(settings.metric_labels)

    def describe(self) -> Iterable[Metric]:
        """The families without samples, so registering never touches the database."""
        return [_leader_family(), _up_family(), *self._families(None, 0.0)]

    def collect(self) -> Iterable[Metric]:
        """One snapshot of the rollups, presented as every job metric (on the leader only)."""
        now_s = self._clock()
        leads = self._leader.is_leader()
        leader = _leader_family()
        leader.add_metric([], 1.0 if leads else 0.0)
        up = _up_family()
        try:
            snapshot = metrics_snapshot(
                self._engine, now_s=now_s, retention_s=self._settings.metrics_retention_s, totals=leads
            )
        except SQLAlchemyError as exc:
            # A scrape that fails outright hides the ingest counters too; report the outage as a value.
            log.warning("metrics scrape could not read the database: %s", exc)
            up.add_metric([], 0.0)
            return [leader, up]
        up.add_metric([], 1.0)
        if not leads:
            return [leader, up]
        return [leader, up, *self._families(snapshot, now_s)]

    def _job_labels(self) -> list[str]:
        return [*JOB_LABELS, *(name for _, name in self._user_labels)]

    def _families(self, snap: MetricsSnapshot | None, now_s: float) -> list[Metric]:
        jl = self._job_labels()
        f = _JobFamilies(jl)
        idle = CounterMetricFamily(
            "wattwatch_idle_energy_joules", "Device energy no job held (J).", labels=["host", "device", "device_kind"]
        )
        host = CounterMetricFamily(
            "wattwatch_host_energy_joules",
            "All energy measured on a device, jobs and idle (J).",
            labels=["host", "device", "device_kind"],
        )
        seen = GaugeMetricFamily(
            "wattwatch_host_last_seen_timestamp_seconds",
            "When the collector last stored a batch from the host (Unix time).",
            labels=["host"],
        )
        s = self._settings
        intensity = GaugeMetricFamily(
            "wattwatch_grid_intensity_grams_per_kwh", "Grid carbon intensity the emissions use (gCO2e/kWh)."
        )
        pue = GaugeMetricFamily("wattwatch_pue", "Power usage effectiveness the emissions use.")
        host_intensity = GaugeMetricFamily(
            "wattwatch_host_grid_intensity_grams_per_kwh",
            "Grid carbon intensity each host's energy is charged at (gCO2e/kWh); region empty: the configured one.",
            labels=["host", "region"],
        )
        families: list[Metric] = [*f.all(), idle, host, seen, intensity, pue, host_intensity]
        if snap is None:
            return families
        intensity.add_metric([], s.grid_intensity_g_per_kwh)
        pue.add_metric([], s.pue)
        # Each host's energy at its own grid's intensity (carbon_policy), as reports charge it.
        grid_of = {name: self._carbon.intensity(name, region) for name, region in snap.host_region.items()}
        for name, g in sorted(grid_of.items()):
            host_intensity.add_metric([name, g.region or ""], g.g_per_kwh)
        grams: dict[str, float] = {}
        for job_id, host_name, _kind, energy_j in snap.job_energy:
            g = grid_of.get(host_name) or self._carbon.intensity(host_name)
            grams[job_id] = grams.get(job_id, 0.0) + self._carbon.emissions_g(energy_j, g)
        labels_of: dict[str, list[str]] = {}
        phases: dict[str, tuple[list[str], str]] = {}  # phase job id -> (its job's labels, "setup" | "after")
        for job_id, job in snap.jobs.items():
            labels = [job_id, job.name, job.kind, *(job.labels.get(key, "") for key, _ in self._user_labels)]
            labels_of[job_id] = labels
            if job.phase is not None and job.phase_of is not None:
                phases[job_id] = (labels, job.phase)
                continue
            f.running.add_metric(labels, 1.0 if job.running else 0.0)
            if job.queries:
                f.queries.add_metric(labels, float(job.queries))
            if job.tokens:
                f.tokens.add_metric(labels, float(job.tokens))
            figures = snap.spans.get(job_id)
            if figures is not None:
                f.add_span_figures(labels, figures)
            f.emissions.add_metric(labels, grams.get(job_id, 0.0))
        for phase_id, (_own, phase) in phases.items():
            owner = snap.jobs[phase_id].phase_of
            if owner in labels_of and owner not in phases:
                phases[phase_id] = (labels_of[owner], phase)  # shown as its job's, once that job is visible
        phase_j: dict[tuple[str, ...], float] = {}
        for job_id, host_name, device_kind, energy_j in snap.job_energy:
            if job_id in phases:
                labels, phase = phases[job_id]
                phase_key = (*labels, phase, host_name, device_kind)
                phase_j[phase_key] = phase_j.get(phase_key, 0.0) + energy_j
            else:
                f.energy.add_metric([*labels_of[job_id], host_name, device_kind], energy_j)
        for phase_key, energy_j in phase_j.items():
            f.phase_energy.add_metric(list(phase_key), energy_j)
        for job_id, host_name, power_w in snap.job_power:
            if job_id not in phases:
                f.power.add_metric([*labels_of[job_id], host_name], power_w)
        for host_name, key, device_kind, energy_j in snap.idle:
            idle.add_metric([host_name, key, device_kind], energy_j)
        for host_name, key, device_kind, energy_j in snap.host:
            host.add_metric([host_name, key, device_kind], energy_j)
        for host_name, seen_s in snap.host_seen:
            seen.add_metric([host_name], seen_s)
        return families


def _leader_family() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "wattwatch_collector_metrics_leader", "1 on the replica that exports the database-derived series."
    )


def _up_family() -> GaugeMetricFamily:
    return GaugeMetricFamily("wattwatch_collector_database_up", "1 if the last scrape could read the database.")


class _JobFamilies:
    """The per-job families of one scrape."""

    def __init__(self, jl: Sequence[str]) -> None:
        jl = list(jl)
        self.labels = jl
        self.energy = CounterMetricFamily(
            "wattwatch_job_energy_joules",
            "Energy attributed to a job, per host and device kind (J).",
            labels=[*jl, "host", "device_kind"],
        )
        self.phase_energy = CounterMetricFamily(
            "wattwatch_job_phase_energy_joules",
            "Energy a job's processes drew outside its window: before it opened (setup: model load, warm-up) or "
            "after it ended (after) (J).",
            labels=[*jl, "phase", "host", "device_kind"],
        )
        self.power = GaugeMetricFamily(
            "wattwatch_job_power_watts",
            "A running job's power on a host over the host's latest pushed ticks (W).",
            labels=[*jl, "host"],
        )
        self.running = GaugeMetricFamily("wattwatch_job_running", "1 while the job runs, 0 once ended.", labels=jl)
        self.queries = CounterMetricFamily("wattwatch_job_queries", "Inference queries a job served.", labels=jl)
        self.tokens = CounterMetricFamily("wattwatch_job_tokens", "Tokens (in + out) a job processed.", labels=jl)
        self.per_query = GaugeMetricFamily(
            "wattwatch_job_energy_per_query_joules",
            "Mean energy per settled query, waiting energy excluded (J).",
            labels=jl,
        )
        self.per_token = GaugeMetricFamily(
            "wattwatch_job_energy_per_token_joules", "Energy per token, tokens in + out (J).", labels=jl
        )
        # Per-query energies as a summary: quantiles (within the sketch's 0.2 %), _sum and _count of the
        # settled queries. _count only grows; _sum may move slightly when late data recomputes a window.
        self.query_energy = Metric(
            "wattwatch_job_query_energy_joules", "Energy of each settled query, from request spans (J).", "summary"
        )
        self.waiting = GaugeMetricFamily(
            "wattwatch_job_waiting_energy_joules",
            "Energy of a serving job while no request was in flight (J).",
            labels=jl,
        )
        self.steps = CounterMetricFamily("wattwatch_job_steps", "Training steps a job marked.", labels=jl)
        self.per_step = GaugeMetricFamily(
            "wattwatch_job_energy_per_step_joules", "Mean energy per settled training step (J).", labels=jl
        )
        self.emissions = CounterMetricFamily(
            "wattwatch_job_emissions_grams", "Job emissions: kWh x PUE x grid intensity (gCO2e).", labels=jl
        )

    def all(self) -> list[Metric]:
        """Every family, in exposition order."""
        return [
            self.energy,
            self.phase_energy,
            self.power,
            self.running,
            self.queries,
            self.tokens,
            self.per_query,
            self.per_token,
            self.query_energy,
            self.waiting,
            self.steps,
            self.per_step,
            self.emissions,
        ]

    def add_span_figures(self, labels: list[str], figures: SpanFigures) -> None:
        """One job's per-query and per-step samples; a figure not known yet (None) has no sample."""
        if figures.energy_per_query_j is not None:
            self.per_query.add_metric(labels, figures.energy_per_query_j)
        if figures.energy_per_token_j is not None and math.isfinite(figures.energy_per_token_j):
            self.per_token.add_metric(labels, figures.energy_per_token_j)
        if figures.query_method == "spans" and figures.energy_per_query_p50_j is not None:
            named = dict(zip(self.labels, labels, strict=True))
            name = self.query_energy.name
            self.query_energy.add_sample(name, {**named, "quantile": "0.5"}, figures.energy_per_query_p50_j)
            p95_j = figures.energy_per_query_p95_j or 0.0
            self.query_energy.add_sample(name, {**named, "quantile": "0.95"}, p95_j)
            total_j = (figures.energy_per_query_j or 0.0) * figures.queries_settled
            self.query_energy.add_sample(f"{name}_sum", named, total_j)
            self.query_energy.add_sample(f"{name}_count", named, float(figures.queries_settled))
        if figures.waiting_energy_j is not None:
            self.waiting.add_metric(labels, figures.waiting_energy_j)
        if figures.steps:
            self.steps.add_metric(labels, float(figures.steps))
        if figures.energy_per_step_j is not None:
            self.per_step.add_metric(labels, figures.energy_per_step_j)
