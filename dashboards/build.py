"""Writes wattwatch's Grafana dashboards (``dashboards/*.json``) from the definitions below.

Run ``python dashboards/build.py`` after editing this file and commit both; ``--check`` only compares
and exits 1 naming the stale files (a test does the same). Plain Python on purpose: the JSON is what
Grafana imports and provisions, and this file is what people review.

Every query uses only the metric families of docs/metrics.md. Panels ``sum`` freely: the collector's
database-derived series come from one replica only (its metrics leader).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
DEFAULT_PRICE_PER_KWH = "0.15"
J_PER_KWH = "3.6e6"
# Cost panels: a plain number with cents, since the currency is whatever $price_per_kwh is in.
MONEY = "money"

# Label filters bound to the template variables (multi-value variables expand to a regex).
HOST = 'host=~"$host"'
JOB = 'job_id=~"$job_id"'
KIND = 'kind=~"$kind"'
# PUE of the collector's emissions; `max` so two replicas exporting it during a failover still give one value.
PUE = "scalar(max(wattwatch_pue))"

Json = dict[str, Any]


# ---------------------------------------------------------------------------------------------- panels


def target(expr: str, legend: str = "", *, ref: str = "A", instant: bool = False, table: bool = False) -> Json:
    """One Prometheus query of a panel."""
    t: Json = {
        "datasource": DATASOURCE,
        "refId": ref,
        "expr": expr,
        "editorMode": "code",
        "range": not instant,
        "instant": instant,
    }
    if legend:
        t["legendFormat"] = legend
    if table:
        t["format"] = "table"
    return t


def _panel(kind: str, title: str, description: str, targets: list[Json], unit: str, w: int, h: int) -> Json:
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"w": w, "h": h},
        "fieldConfig": {
            "defaults": {"unit": "none", "decimals": 2} if unit == MONEY else {"unit": unit},
            "overrides": [],
        },
        "targets": targets,
    }


def timeseries(
    title: str,
    description: str,
    *targets: Json,
    unit: str,
    w: int = 12,
    h: int = 8,
    overrides: list[Json] | None = None,
) -> Json:
    """A time series panel."""
    p = _panel("timeseries", title, description, list(targets), unit, w, h)
    p["fieldConfig"]["overrides"] = overrides or []
    p["fieldConfig"]["defaults"]["custom"] = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 10,
        "showPoints": "never",
        "spanNulls": False,
    }
    p["options"] = {
        "legend": {"showLegend": True, "displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return p


def stat(
    title: str, description: str, *targets: Json, unit: str, w: int = 6, h: int = 4, thresholds: Json | None = None
) -> Json:
    """A single-value panel showing the latest value of each series."""
    p = _panel("stat", title, description, list(targets), unit, w, h)
    p["options"] = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "value" if thresholds else "none",
        "graphMode": "none",
        "textMode": "auto",
        "justifyMode": "auto",
        "orientation": "auto",
    }
    if thresholds:
        p["fieldConfig"]["defaults"]["thresholds"] = thresholds
    return p


def bars(title: str, description: str, *targets: Json, unit: str, w: int = 12, h: int = 8) -> Json:
    """Horizontal bars, one per series, for totals over the dashboard's time range."""
    p = _panel("bargauge", title, description, list(targets), unit, w, h)
    p["options"] = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "orientation": "horizontal",
        "displayMode": "basic",
        "showUnfilled": True,
        "valueMode": "color",
        "namePlacement": "auto",
        "sizing": "auto",
    }
    return p


def table(title: str, description: str, expr: str, hidden: Iterable[str], w: int = 24, h: int = 6) -> Json:
    """The latest value of each series as table rows, one column per label (minus ``hidden``)."""
    p = _panel("table", title, description, [target(expr, instant=True, table=True)], "none", w, h)
    p["options"] = {"showHeader": True, "cellHeight": "sm"}
    excluded = {name: True for name in ["Time", "__name__", "instance", "job", *hidden]}
    p["transformations"] = [{"id": "organize", "options": {"excludeByName": excluded}}]
    return p


def thresholds_steps(*steps: tuple[str, float | None]) -> Json:
    """Absolute thresholds: ``("green", None), ("red", 300)`` is green below 300, red from 300."""
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for color, value in steps]}


def row(title: str) -> Json:
    """A row header; the panels after it, up to the next row, belong to it."""
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def right_axis_watts(ref: str) -> Json:
    """An override putting query ``ref`` on a right-hand axis in watts."""
    return {
        "matcher": {"id": "byFrameRefID", "options": ref},
        "properties": [{"id": "unit", "value": "watt"}, {"id": "custom.axisPlacement", "value": "right"}],
    }


def layout(panels: list[Json]) -> list[Json]:
    """Give panels ids and positions: left to right on the 24-column grid, wrapping, rows full width."""
    x = y = row_h = 0
    placed = []
    for i, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if p["type"] == "row" or x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p = {"id": i, **p, "gridPos": {"h": h, "w": w, "x": x, "y": y}}
        placed.append(p)
        x, row_h = x + w, max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return placed


# ------------------------------------------------------------------------------------------- variables


def datasource_variable() -> Json:
    """The Prometheus data source to query, picked in the dashboard (no data source uid is hard-coded)."""
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
    }


def query_variable(name: str, label: str, query: str) -> Json:
    """A multi-value label variable with "All" matching any value."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "definition": query,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "options": [],
        "refresh": 2,  # on time range change: jobs come and go
        "regex": "",
        "sort": 1,
    }


def price_variable() -> Json:
    """The electricity price per kWh used in cost panels; a text box, so each viewer can set theirs."""
    return {
        "name": "price_per_kwh",
        "label": "Price per kWh",
        "description": "Electricity price per kWh, in your currency; cost panels multiply kWh x PUE by it.",
        "type": "textbox",
        "query": DEFAULT_PRICE_PER_KWH,
        "current": {"selected": False, "text": DEFAULT_PRICE_PER_KWH, "value": DEFAULT_PRICE_PER_KWH},
        "options": [{"selected": True, "text": DEFAULT_PRICE_PER_KWH, "value": DEFAULT_PRICE_PER_KWH}],
        "hide": 0,
    }


HOST_VARIABLE = query_variable("host", "Host", "label_values(wattwatch_host_energy_joules_total, host)")
KIND_VARIABLE = query_variable("kind", "Kind", "label_values(wattwatch_job_running, kind)")


def job_variable(kind_filter: str) -> Json:
    """Job ids of the given kinds that ran on the selected hosts."""
    return query_variable(
        "job_id", "Job", f"label_values(wattwatch_job_energy_joules_total{{{kind_filter}, {HOST}}}, job_id)"
    )


def dashboard(uid: str, title: str, description: str, variables: list[Json], panels: list[Json]) -> Json:
    """A complete dashboard: data source variable first, links to the other wattwatch dashboards."""
    return {
        "uid": uid,
        "title": title,
        "description": f"{description} Generated by dashboards/build.py in the wattwatch repository.",
        "tags": ["wattwatch"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "type": "dashboards",
                "title": "wattwatch",
                "tags": ["wattwatch"],
                "asDropdown": False,
                "includeVars": False,
                "keepTime": True,
            }
        ],
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": layout(panels),
    }


# ------------------------------------------------------------------------------------------ dashboards


def fleet() -> Json:
    """Power and energy per host and GPU, idle share and cost, agent and collector health."""
    gpu = f'{HOST}, device_kind="gpu"'
    idle_range = f"increase(wattwatch_idle_energy_joules_total{{{HOST}}}[$__range])"
    panels = [
        row("Power now"),
        stat(
            "Fleet power now",
            "Sum of every device's power over its last closed interval, as the agents measure it.",
            target(f"sum(wattwatch_device_power_watts{{{HOST}}})", instant=True),
            unit="watt",
        ),
        stat(
            "GPUs held by a job",
            "GPUs that some job holds now, out of all GPUs the agents report.",
            target(f"count(count by (host, device) (wattwatch_device_job_info{{{gpu}}}))", "held", instant=True),
            target(f"count(wattwatch_device_power_watts{{{gpu}}})", "GPUs", ref="B", instant=True),
            unit="none",
        ),
        stat(
            "Jobs running",
            "Jobs the agents track now, all hosts selected.",
            target(f"sum(wattwatch_agent_jobs{{{HOST}}})", instant=True),
            unit="none",
        ),
        stat(
            "Idle cost in range",
            "Energy no job held, over the dashboard's time range: kWh x PUE x $price_per_kwh.",
            target(f"sum({idle_range}) / {J_PER_KWH} * {PUE} * $price_per_kwh", instant=True),
            unit=MONEY,
        ),
        timeseries(
            "Power per host",
            "Every device's power (GPU, CPU package, DRAM), summed per host.",
            target(f"sum by (host) (wattwatch_device_power_watts{{{HOST}}})", "{{host}}"),
            unit="watt",
        ),
        timeseries(
            "Power per GPU",
            "Each GPU's power over its last closed interval.",
            target(f"sum by (host, device, modelName) (wattwatch_device_power_watts{{{gpu}}})", "{{host}} {{device}}"),
            unit="watt",
        ),
        row("Energy"),
        timeseries(
            "Energy per day, per host (rolling 24 h)",
            "All energy measured on each host over the 24 hours before each point, from the collector.",
            target(
                f"sum by (host) (increase(wattwatch_host_energy_joules_total{{{HOST}}}[1d])) / {J_PER_KWH}", "{{host}}"
            ),
            unit="kwatth",
        ),
        timeseries(
            "Idle power per host",
            "Power of devices while no job held them (a CPU's idle is what no job's processes used).",
            target(f"sum by (host) (rate(wattwatch_idle_energy_joules_total{{{HOST}}}[$__rate_interval]))", "{{host}}"),
            unit="watt",
        ),
        bars(
            "Idle share of GPU energy, per host",
            "Over the dashboard's time range: GPU energy no job held / all GPU energy.",
            target(
                f"sum by (host) (increase(wattwatch_idle_energy_joules_total{{{gpu}}}[$__range]))"
                f" / sum by (host) (increase(wattwatch_host_energy_joules_total{{{gpu}}}[$__range]))",
                "{{host}}",
                instant=True,
            ),
            unit="percentunit",
        ),
        bars(
            "Idle cost by device kind",
            "Energy no job held over the dashboard's time range, as cost: kWh x PUE x $price_per_kwh.",
            target(
                f"sum by (device_kind) ({idle_range}) / {J_PER_KWH} * {PUE} * $price_per_kwh",
                "{{device_kind}}",
                instant=True,
            ),
            unit=MONEY,
        ),
        row("GPUs"),
        timeseries(
            "GPU utilisation vs power",
            "NVML utilisation (left axis) against power (right axis), per GPU: power high with utilisation "
            "low is a GPU busy with memory traffic or waiting, low on both is an idle GPU.",
            target(f"max by (host, device) (wattwatch_gpu_utilization_ratio{{{HOST}}})", "{{host}} {{device}} util"),
            target(f"sum by (host, device) (wattwatch_device_power_watts{{{gpu}}})", "{{host}} {{device}} W", ref="B"),
            unit="percentunit",
            w=24,
            overrides=[right_axis_watts("B")],
        ),
        table(
            "Who holds each GPU",
            "One row per device and the job holding it now.",
            f"wattwatch_device_job_info{{{HOST}}}",
            hidden=["Value"],
        ),
        row("Agents"),
        timeseries(
            "Last accepted push, age",
            "Seconds since each agent's last batch the collector accepted (decades: none yet).",
            target(f"time() - max by (host) (wattwatch_agent_last_push_timestamp_seconds{{{HOST}}})", "{{host}}"),
            unit="s",
            w=8,
        ),
        timeseries(
            "Collector last stored a batch, age",
            "Seconds since the collector last stored a batch from each host; the alert fires past 5 minutes.",
            target(f"time() - max by (host) (wattwatch_host_last_seen_timestamp_seconds{{{HOST}}})", "{{host}}"),
            unit="s",
            w=8,
        ),
        timeseries(
            "Spool depth",
            "Batches waiting on each agent (grows while the collector is away), and batches refused for good.",
            target(f"max by (host) (wattwatch_agent_spool_batches{{{HOST}}})", "{{host}} waiting"),
            target(f"max by (host) (wattwatch_agent_spool_dead_batches{{{HOST}}})", "{{host}} dead", ref="B"),
            unit="none",
            w=8,
        ),
        timeseries(
            "Pushes per second",
            "Batches the collector accepted, and push attempts that failed.",
            target(
                f"sum by (host) (rate(wattwatch_agent_batches_pushed_total{{{HOST}}}[$__rate_interval]))",
                "{{host}} accepted",
            ),
            target(
                f"sum by (host) (rate(wattwatch_agent_push_failures_total{{{HOST}}}[$__rate_interval]))",
                "{{host}} failed",
                ref="B",
            ),
            unit="reqps",
            w=8,
        ),
        timeseries(
            "Sensor read time, p95",
            "Time to read every sensor once; it bounds how short an interval can be.",
            target(
                "histogram_quantile(0.95, sum by (host, le) "
                f"(rate(wattwatch_agent_sample_duration_seconds_bucket{{{HOST}}}[$__rate_interval])))",
                "{{host}}",
            ),
            unit="s",
            w=8,
        ),
        timeseries(
            "Sensor errors per second",
            "Failed sensor reads per host (zero where none failed).",
            target(
                f"sum by (host) (rate(wattwatch_agent_sensor_errors_total{{{HOST}}}[$__rate_interval]))"
                f" or sum by (host) (0 * wattwatch_agent_info{{{HOST}}})",
                "{{host}}",
            ),
            unit="none",
            w=8,
        ),
        table(
            "Agents",
            "One row per agent: host, agent id and version.",
            f"wattwatch_agent_info{{{HOST}}}",
            hidden=["Value"],
        ),
        row("Collector"),
        stat(
            "Database up",
            "1 if the collector's last scrape could read its database (lowest over replicas).",
            target("min(wattwatch_collector_database_up)", instant=True),
            unit="none",
            thresholds=thresholds_steps(("red", None), ("green", 1)),
        ),
        stat(
            "Metrics leaders",
            "Replicas exporting the database-derived series: 1 is right.",
            target("sum(wattwatch_collector_metrics_leader)", instant=True),
            unit="none",
            thresholds=thresholds_steps(("red", None), ("green", 1), ("red", 2)),
        ),
        timeseries(
            "Ingest per second",
            "Agent batches stored, batches received again (retries), batches refused as malformed.",
            target("sum(rate(wattwatch_ingest_batches_total[$__rate_interval]))", "stored"),
            target("sum(rate(wattwatch_ingest_duplicates_total[$__rate_interval]))", "duplicate", ref="B"),
            target("sum(rate(wattwatch_ingest_errors_total[$__rate_interval]))", "refused", ref="C"),
            unit="reqps",
        ),
        timeseries(
            "Device intervals stored per second",
            "Measured intervals the collector stores, all agents.",
            target("sum(rate(wattwatch_ingest_intervals_total[$__rate_interval]))", "intervals"),
            unit="none",
            w=24,
        ),
    ]
    return dashboard(
        "wattwatch-fleet",
        "wattwatch / Fleet",
        "Power and energy per host and GPU, idle share and cost, agent and collector health.",
        [HOST_VARIABLE, price_variable()],
        panels,
    )


def training() -> Json:
    """Energy per run and per host, power over time, J/step."""
    jobs = f'kind="training", {JOB}'
    on_hosts = f"and on (job_id) wattwatch_job_energy_joules_total{{{HOST}}}"
    by_run = "sum by (job_id, job_name)"
    panels = [
        row("Runs"),
        stat(
            "Runs running",
            "Training runs running now.",
            target(f"sum(wattwatch_job_running{{{jobs}}} {on_hosts})", instant=True),
            unit="none",
        ),
        stat(
            "Training power now",
            "All selected runs' power over their hosts' latest pushed ticks.",
            target(f"sum(wattwatch_job_power_watts{{{jobs}, {HOST}}})", instant=True),
            unit="watt",
        ),
        stat(
            "Training energy in range",
            "Energy of the selected runs over the dashboard's time range.",
            target(
                f"sum(increase(wattwatch_job_energy_joules_total{{{jobs}, {HOST}}}[$__range])) / {J_PER_KWH}",
                instant=True,
            ),
            unit="kwatth",
        ),
        stat(
            "Steps per second",
            "Training steps marked with wattwatch.step(), all selected runs.",
            target(f"sum(rate(wattwatch_job_steps_total{{{jobs}}}[$__rate_interval]) {on_hosts})", instant=True),
            unit="none",
        ),
        bars(
            "Energy per run",
            "Each run's energy so far (runs seen in the time range), all its hosts and devices.",
            target(
                f"{by_run} (max_over_time(wattwatch_job_energy_joules_total{{{jobs}, {HOST}}}[$__range]))"
                f" / {J_PER_KWH}",
                "{{job_name}} ({{job_id}})",
                instant=True,
            ),
            unit="kwatth",
        ),
        bars(
            "Energy per run and host",
            "Each run's energy so far on each host: a slow or straggling host stands out.",
            target(
                "sum by (job_id, job_name, host) "
                f"(max_over_time(wattwatch_job_energy_joules_total{{{jobs}, {HOST}}}[$__range])) / {J_PER_KWH}",
                "{{job_name}} @ {{host}}",
                instant=True,
            ),
            unit="kwatth",
        ),
        row("Power"),
        timeseries(
            "Power per run",
            "Each running run's power over its hosts' latest pushed ticks.",
            target(f"{by_run} (wattwatch_job_power_watts{{{jobs}, {HOST}}})", "{{job_name}}"),
            unit="watt",
        ),
        timeseries(
            "Power per run and host",
            "Each running run's power on each host.",
            target(
                f"sum by (job_id, job_name, host) (wattwatch_job_power_watts{{{jobs}, {HOST}}})",
                "{{job_name}} @ {{host}}",
            ),
            unit="watt",
        ),
        timeseries(
            "Power by device kind",
            "The selected runs' power from their energy counters, split into GPU, CPU and DRAM.",
            target(
                f"sum by (device_kind) (rate(wattwatch_job_energy_joules_total{{{jobs}, {HOST}}}[$__rate_interval]))",
                "{{device_kind}}",
            ),
            unit="watt",
            w=24,
        ),
        row("Steps"),
        timeseries(
            "Energy per step",
            "Mean energy per settled training step (steps marked with wattwatch.step()).",
            target(
                f"max by (job_id, job_name) (wattwatch_job_energy_per_step_joules{{{jobs}}} {on_hosts})", "{{job_name}}"
            ),
            unit="joule",
        ),
        timeseries(
            "Steps per second, per run",
            "Training throughput; with energy per step it tells a slow run from a wasteful one.",
            target(
                f"{by_run} (rate(wattwatch_job_steps_total{{{jobs}}}[$__rate_interval]) {on_hosts})", "{{job_name}}"
            ),
            unit="none",
        ),
    ]
    return dashboard(
        "wattwatch-training",
        "wattwatch / Training runs",
        "Energy per training run and per host, power over time, energy per step.",
        [HOST_VARIABLE, job_variable('kind="training"')],
        panels,
    )


def inference() -> Json:
    """J/query quantiles, J/token, queries/s, waiting energy."""
    jobs = f'kind="inference", {JOB}'
    on_hosts = f"and on (job_id) wattwatch_job_energy_joules_total{{{HOST}}}"
    per_job = "max by (job_id, job_name)"
    waiting = f"{per_job} (wattwatch_job_waiting_energy_joules{{{jobs}}})"
    panels = [
        row("Energy per query"),
        timeseries(
            "Energy per query, p50",
            "Median energy of a settled query, from request spans; waiting energy excluded.",
            target(
                f'{per_job} (wattwatch_job_query_energy_joules{{{jobs}, quantile="0.5"}}) {on_hosts}', "{{job_name}}"
            ),
            unit="joule",
        ),
        timeseries(
            "Energy per query, p95",
            "95th percentile energy of a settled query, from request spans.",
            target(
                f'{per_job} (wattwatch_job_query_energy_joules{{{jobs}, quantile="0.95"}}) {on_hosts}', "{{job_name}}"
            ),
            unit="joule",
        ),
        timeseries(
            "Energy per query, mean",
            "Mean energy per settled query (also where only request counts are known), waiting energy excluded.",
            target(f"{per_job} (wattwatch_job_energy_per_query_joules{{{jobs}}}) {on_hosts}", "{{job_name}}"),
            unit="joule",
        ),
        timeseries(
            "Energy per token",
            "Energy per token in + out.",
            target(f"{per_job} (wattwatch_job_energy_per_token_joules{{{jobs}}}) {on_hosts}", "{{job_name}}"),
            unit="joule",
        ),
        row("Traffic"),
        timeseries(
            "Queries per second",
            "Inference queries served per second, per job.",
            target(
                f"sum by (job_id, job_name) (rate(wattwatch_job_queries_total{{{jobs}}}[$__rate_interval]) {on_hosts})",
                "{{job_name}}",
            ),
            unit="reqps",
        ),
        timeseries(
            "Tokens per second",
            "Tokens in + out per second, per job.",
            target(
                f"sum by (job_id, job_name) (rate(wattwatch_job_tokens_total{{{jobs}}}[$__rate_interval]) {on_hosts})",
                "{{job_name}}",
            ),
            unit="none",
        ),
        timeseries(
            "Power per serving job",
            "Each serving job's power over its hosts' latest pushed ticks.",
            target(f"sum by (job_id, job_name) (wattwatch_job_power_watts{{{jobs}, {HOST}}})", "{{job_name}}"),
            unit="watt",
            w=24,
        ),
        row("Waiting"),
        timeseries(
            "Waiting energy",
            "Energy a serving job drew while no request was in flight (its GPU held, nothing served).",
            target(f"{waiting} {on_hosts}", "{{job_name}}"),
            unit="joule",
        ),
        bars(
            "Waiting share of settled energy",
            "Waiting energy / (waiting energy + energy of the settled queries): the part of a server's energy "
            "no request used. High: too many replicas for the traffic.",
            target(
                f"{waiting} / ({waiting} + {per_job} (wattwatch_job_query_energy_joules_sum{{{jobs}}})) {on_hosts}",
                "{{job_name}}",
                instant=True,
            ),
            unit="percentunit",
        ),
        bars(
            "Energy per serving job",
            "Each serving job's energy so far (jobs seen in the time range).",
            target(
                "sum by (job_id, job_name) "
                f"(max_over_time(wattwatch_job_energy_joules_total{{{jobs}, {HOST}}}[$__range])) / {J_PER_KWH}",
                "{{job_name}}",
                instant=True,
            ),
            unit="kwatth",
            w=24,
        ),
    ]
    return dashboard(
        "wattwatch-inference",
        "wattwatch / Inference",
        "Energy per query (p50, p95, mean) and per token, queries per second, waiting energy.",
        [HOST_VARIABLE, job_variable('kind="inference"')],
        panels,
    )


def carbon() -> Json:
    """Emissions and energy cost per job and kind, idle cost, the grid intensity and PUE in use."""
    jobs = f"{KIND}, {JOB}"
    on_hosts = f"and on (job_id) wattwatch_job_energy_joules_total{{{HOST}}}"
    cost = f"/ {J_PER_KWH} * {PUE} * $price_per_kwh"
    job_energy = f"wattwatch_job_energy_joules_total{{{jobs}, {HOST}}}"
    emissions = f"wattwatch_job_emissions_grams_total{{{jobs}}}"
    panels = [
        row("In use"),
        stat(
            "Grid intensity per host",
            "The grid carbon intensity each host's energy is charged at: codecarbon's figure for its region "
            "(agent --grid-region, or the collector's grid_region / grid_regions), else the configured "
            "WATTWATCH_GRID_INTENSITY (region empty).",
            target(
                f"max by (host, region) (wattwatch_host_grid_intensity_grams_per_kwh{{{HOST}}})",
                "{{host}} {{region}}",
                instant=True,
            ),
            unit="suffix: gCO2e/kWh",
        ),
        stat(
            "PUE",
            "The power usage effectiveness the collector's emissions and these costs use (WATTWATCH_PUE).",
            target("max(wattwatch_pue)", instant=True),
            unit="none",
        ),
        stat(
            "Job energy cost in range",
            "Energy of the selected jobs over the time range: kWh x PUE x $price_per_kwh.",
            target(f"sum(increase({job_energy}[$__range])) {cost}", instant=True),
            unit=MONEY,
        ),
        stat(
            "Idle energy cost in range",
            "Energy no job held on the selected hosts over the time range: kWh x PUE x $price_per_kwh.",
            target(f"sum(increase(wattwatch_idle_energy_joules_total{{{HOST}}}[$__range])) {cost}", instant=True),
            unit=MONEY,
        ),
        row("Emissions"),
        bars(
            "Emissions per job",
            "Each job's emissions so far (jobs seen in the time range): kWh x PUE x grid intensity.",
            target(
                f"sum by (job_id, job_name, kind) (max_over_time({emissions}[$__range])) {on_hosts}",
                "{{job_name}} ({{kind}})",
                instant=True,
            ),
            unit="massg",
        ),
        bars(
            "Emissions per kind",
            "Emissions so far of the jobs seen in the time range, per kind.",
            target(f"sum by (kind) (max_over_time({emissions}[$__range]) {on_hosts})", "{{kind}}", instant=True),
            unit="massg",
        ),
        timeseries(
            "Emission rate per kind",
            "Grams of CO2e per hour, per kind of job.",
            target(f"sum by (kind) (rate({emissions}[$__rate_interval]) {on_hosts}) * 3600", "{{kind}}"),
            unit="suffix: g/h",
            w=24,
        ),
        row("Cost"),
        bars(
            "Energy cost per job",
            "Each job's energy so far on the selected hosts (jobs seen in the time range): kWh x PUE x $price_per_kwh.",
            target(
                f"sum by (job_id, job_name, kind) (max_over_time({job_energy}[$__range])) {cost}",
                "{{job_name}} ({{kind}})",
                instant=True,
            ),
            unit=MONEY,
        ),
        bars(
            "Idle cost per host",
            "Energy no job held over the time range, per host: kWh x PUE x $price_per_kwh.",
            target(
                f"sum by (host) (increase(wattwatch_idle_energy_joules_total{{{HOST}}}[$__range])) {cost}",
                "{{host}}",
                instant=True,
            ),
            unit=MONEY,
        ),
        timeseries(
            "Cost rate: jobs vs idle",
            "Cost per hour of job energy and of idle energy on the selected hosts.",
            target(f"sum(rate({job_energy}[$__rate_interval])) * 3600 {cost}", "jobs"),
            target(
                f"sum(rate(wattwatch_idle_energy_joules_total{{{HOST}}}[$__rate_interval])) * 3600 {cost}",
                "idle",
                ref="B",
            ),
            unit=MONEY,
            w=24,
        ),
    ]
    return dashboard(
        "wattwatch-carbon",
        "wattwatch / Carbon and cost",
        "Emissions and energy cost per job and kind, idle cost, and the grid intensity and PUE in use.",
        [HOST_VARIABLE, KIND_VARIABLE, job_variable(KIND), price_variable()],
        panels,
    )


DASHBOARDS = {
    "wattwatch-fleet.json": fleet,
    "wattwatch-training.json": training,
    "wattwatch-inference.json": inference,
    "wattwatch-carbon.json": carbon,
}


def render() -> dict[str, str]:
    """File name (in dashboards/) -> the JSON text it must hold."""
    return {name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str]) -> int:
    """Write the dashboards, or with ``--check`` list the stale ones and exit 1."""
    check = "--check" in argv
    stale = []
    for name, text in render().items():
        path = HERE / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not check:
            path.write_text(text)
    if check and stale:
        print(f"stale, run python dashboards/build.py: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
