"""The collector's /metrics: ingest self-metrics plus job, idle and host energy read from the rollups.

Everything lives in a registry per app (never prometheus_client's global one), so several apps in one
process (tests, ``wattwatch up``) never share counters. Job metrics are computed once per scrape
from one database snapshot by ``JobMetricsCollector``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from wattwatch.accounting.carbon import emissions_g
from wattwatch.config import Settings
from wattwatch.storage.reads import MetricsSnapshot, metrics_snapshot
from wattwatch.storage.span_reads import SpanFigures

log = logging.getLogger(__name__)

JOB_LABELS = ["job", "job_name", "kind"]


@dataclass(frozen=True)
class IngestMetrics:
    """Counters the ingest route increments."""

    batches: Counter
    intervals: Counter
    errors: Counter
    duplicates: Counter


def build_registry(
    engine: Engine, settings: Settings, clock: Callable[[], float]
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
    registry.register(JobMetricsCollector(engine, settings, clock))
    return registry, ingest


class JobMetricsCollector(Collector):
    """Job, idle and host energy from the rollup tables, read at scrape time."""

    def __init__(self, engine: Engine, settings: Settings, clock: Callable[[], float]) -> None:
        self._engine = engine
        self._settings = settings
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        """The families without samples, so registering never touches the database."""
        return self._families(None, 0.0)

    def collect(self) -> Iterable[Metric]:
        """One snapshot of the rollups, presented as every job metric."""
        now_s = self._clock()
        up = GaugeMetricFamily("wattwatch_collector_database_up", "1 if the last scrape could read the database.")
        try:
            snapshot = metrics_snapshot(self._engine, now_s=now_s, retention_s=self._settings.metrics_retention_s)
        except SQLAlchemyError as exc:
            # A scrape that fails outright hides the ingest counters too; report the outage as a value.
            log.warning("metrics scrape could not read the database: %s", exc)
            up.add_metric([], 0.0)
            return [up]
        up.add_metric([], 1.0)
        return [up, *self._families(snapshot, now_s)]

    def _families(self, snap: MetricsSnapshot | None, now_s: float) -> list[Metric]:
        energy = CounterMetricFamily(
            "wattwatch_job_energy_joules",
            "Energy attributed to a job, per host and device kind (J).",
            labels=[*JOB_LABELS, "host", "device_kind"],
        )
        power = GaugeMetricFamily(
            "wattwatch_job_power_watts", "Average power of a running job since its start (W).", labels=JOB_LABELS
        )
        n_queries = CounterMetricFamily("wattwatch_job_queries", "Inference queries a job served.", labels=JOB_LABELS)
        tokens = CounterMetricFamily("wattwatch_job_tokens", "Tokens (in + out) a job processed.", labels=JOB_LABELS)
        per_query = GaugeMetricFamily(
            "wattwatch_job_energy_per_query_joules",
            "Mean energy per settled query, waiting energy excluded (J).",
            labels=JOB_LABELS,
        )
        # Per-query energies as a summary: quantiles (within the sketch's 0.2 %), _sum and _count of the
        # settled queries. _count only grows; _sum may move slightly when late data recomputes a window.
        query_energy = Metric(
            "wattwatch_job_query_energy_joules", "Energy of each settled query, from request spans (J).", "summary"
        )
        waiting = GaugeMetricFamily(
            "wattwatch_job_waiting_energy_joules",
            "Energy of a serving job while no request was in flight (J).",
            labels=JOB_LABELS,
        )
        n_steps = CounterMetricFamily("wattwatch_job_steps", "Training steps a job marked.", labels=JOB_LABELS)
        per_step = GaugeMetricFamily(
            "wattwatch_job_energy_per_step_joules", "Mean energy per settled training step (J).", labels=JOB_LABELS
        )
        idle = CounterMetricFamily(
            "wattwatch_idle_energy_joules", "Device energy no job held (J).", labels=["host", "device_kind"]
        )
        host = CounterMetricFamily(
            "wattwatch_host_energy_joules", "All device energy measured on a host (J).", labels=["host", "device_kind"]
        )
        carbon = CounterMetricFamily(
            "wattwatch_emissions_grams", "Job emissions: kWh x PUE x grid intensity (gCO2e).", labels=JOB_LABELS
        )
        families: list[Metric] = [
            energy,
            power,
            n_queries,
            tokens,
            per_query,
            query_energy,
            waiting,
            n_steps,
            per_step,
            idle,
            host,
            carbon,
        ]
        if snap is None:
            return families
        for job_id, name, kind, host_name, device_kind, energy_j in snap.job_energy:
            energy.add_metric([job_id, name, kind, host_name, device_kind], energy_j)
        s = self._settings
        for job_id, (name, kind, running, started_at_s, energy_j, queries, n_tokens) in snap.jobs.items():
            labels = [job_id, name, kind]
            if running:
                duration_s = now_s - started_at_s
                power.add_metric(labels, energy_j / duration_s if duration_s > 0 else 0.0)
            n_queries.add_metric(labels, float(queries))
            tokens.add_metric(labels, float(n_tokens))
            figures = snap.spans.get(job_id)
            if figures is not None:
                _add_span_figures(labels, figures, per_query, query_energy, waiting, n_steps, per_step)
            carbon.add_metric(labels, emissions_g(energy_j, s.grid_intensity_g_per_kwh, s.pue))
        for host_name, device_kind, energy_j in snap.idle:
            idle.add_metric([host_name, device_kind], energy_j)
        for host_name, device_kind, energy_j in snap.host:
            host.add_metric([host_name, device_kind], energy_j)
        return families


def _add_span_figures(
    labels: list[str],
    figures: SpanFigures,
    per_query: GaugeMetricFamily,
    query_energy: Metric,
    waiting: GaugeMetricFamily,
    n_steps: CounterMetricFamily,
    per_step: GaugeMetricFamily,
) -> None:
    """One job's per-query and per-step samples; a figure not known yet (None) has no sample."""
    if figures.energy_per_query_j is not None:
        per_query.add_metric(labels, figures.energy_per_query_j)
    if figures.query_method == "spans" and figures.energy_per_query_p50_j is not None:
        named = dict(zip(JOB_LABELS, labels, strict=True))
        name = query_energy.name
        query_energy.add_sample(name, {**named, "quantile": "0.5"}, figures.energy_per_query_p50_j)
        query_energy.add_sample(name, {**named, "quantile": "0.95"}, figures.energy_per_query_p95_j or 0.0)
        query_energy.add_sample(f"{name}_sum", named, (figures.energy_per_query_j or 0.0) * figures.queries_settled)
        query_energy.add_sample(f"{name}_count", named, float(figures.queries_settled))
    if figures.waiting_energy_j is not None:
        waiting.add_metric(labels, figures.waiting_energy_j)
    if figures.steps:
        n_steps.add_metric(labels, float(figures.steps))
    if figures.energy_per_step_j is not None:
        per_step.add_metric(labels, figures.energy_per_step_j)
