"""The report for programs: CSV, one row per job (or per group and a total row), every column."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

_CSV_FIELDS = (
    "id",
    "name",
    "kind",
    "started_at",
    "ended_at",
    "duration_s",
    "hosts",
    "devices",
    "energy_j",
    "gpu_energy_j",
    "cpu_energy_j",
    "dram_energy_j",
    "avg_power_w",
    "peak_power_w",
    "queries",
    "tokens",
    "energy_per_query_j",
    "energy_per_token_j",
    "emissions_g",
    "sources",
    # After the original columns, so scripts reading them by position keep working.
    "query_method",
    "energy_per_query_p50_j",
    "energy_per_query_p95_j",
    "waiting_energy_j",
    "steps",
    "energy_per_step_j",
    "energy_per_step_p50_j",
    "energy_per_step_p95_j",
    "ended_by",
    "setup_energy_j",
    "setup_duration_s",
    "after_energy_j",
    "after_duration_s",
    # Why a job shows 0 J or no GPU, and what to do.
    "reason",
    "fix",
    # What the emissions rest on: each job's intensity (energy-weighted over its hosts), its
    # source, the PUE, and the cost (kWh x PUE x price; empty with no price set).
    "grid_intensity_g_per_kwh",
    "intensity_source",
    "pue",
    "cost",
    # Of duration_s, the seconds no reading of one of the job's devices covers (storage.unmeasured).
    "unmeasured_s",
)


# A report's CSV stays one row per job, as scripts summing its rows expect; its totals come with
# ``--group-by``: one row per group, then the total row (``row``: ``group`` / ``total``), which also carries
# the idle energy and its share (blank on group rows).
_TOTAL_FIELDS = ("row", "idle_energy_j", "idle_share")
_GROUP_CSV_FIELDS = ("group_by", "group", "jobs", "duration_s", "energy_j", "energy_share", "emissions_g", "cost")


def _csv_value(value: Any) -> Any:
    return ";".join(map(str, value)) if isinstance(value, list) else ("" if value is None else value)


def _total_row(report: Mapping[str, Any], fields: Sequence[str], extra: Mapping[str, Any]) -> list[Any] | None:
    totals = report.get("totals")
    if not totals or not report.get("jobs"):
        return None
    values = {**totals, **extra, "row": "total"}
    return [_csv_value(values.get(k)) for k in fields]


def _csv(report: Mapping[str, Any]) -> str:
    out = io.StringIO()
    import csv  # only for CSV output

    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(_CSV_FIELDS)
    for job in report.get("jobs", []):
        writer.writerow([_csv_value(job.get(k)) for k in _CSV_FIELDS])
    return out.getvalue().rstrip("\n")


def _group_csv(report: Mapping[str, Any]) -> str:
    out = io.StringIO()
    import csv  # only for CSV output

    writer = csv.writer(out, lineterminator="\n")
    fields = (*_GROUP_CSV_FIELDS, *_TOTAL_FIELDS, "job_ids")
    writer.writerow(fields)
    for group in report.get("groups") or []:
        values = {**group, "group_by": report.get("group_by"), "row": "group"}
        writer.writerow([_csv_value(values.get(k)) for k in fields])
    total = _total_row(report, fields, {"group_by": report.get("group_by"), "group": "TOTAL", "energy_share": 1.0})
    if total is not None:
        writer.writerow(total)
    return out.getvalue().rstrip("\n")


def csv_text(report: Mapping[str, Any]) -> str:
    """The report as CSV: one row per job, or with ``groups`` one per group and the total row."""
    return _group_csv(report) if report.get("groups") is not None else _csv(report)
