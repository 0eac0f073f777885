"""The report as rows for people: which columns a table and markdown show, their cells, the total row,
and a grouped report's rows. The table (``reporting.text``) and markdown (``reporting.markdown``) share them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from wattwatch.reporting.figures import figure, format_duration, format_energy

# (key, title, drop rank): rank 0 is always shown; to fit a width the highest ranks go first (table_render).
_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("id", "JOB", 0),
    ("name", "NAME", 0),
    ("kind", "KIND", 6),
    ("status", "STATUS", 7),
    ("duration_s", "DURATION", 5),
    ("energy_j", "ENERGY", 0),
    ("gpu_energy_j", "GPU", 20),
    ("cpu_energy_j", "CPU", 19),
    ("setup_energy_j", "SETUP", 12),
    ("after_energy_j", "AFTER", 13),
    ("avg_power_w", "AVG W", 11),
    ("peak_power_w", "PEAK W", 17),
    ("queries", "QUERIES", 10),
    ("energy_per_query_j", "J/QUERY", 8),
    ("energy_per_query_p50_j", "P50 J/Q", 16),
    ("energy_per_query_p95_j", "P95 J/Q", 15),
    ("waiting_energy_j", "WAITING", 14),
    ("energy_per_step_j", "J/STEP", 9),
    ("emissions_g", "CO2e g", 0),
    ("cost", "COST", 4),
    ("sources", "SOURCES", 18),
    ("reason", "NOTE", 0),
)
TEXT_KEYS = frozenset({"id", "name", "kind", "status", "sources", "reason"})
# What a total row sums; the other columns (averages, peaks, per-query figures) stay blank in it.
_SUMMED = frozenset(
    {"duration_s", "energy_j", "gpu_energy_j", "cpu_energy_j", "setup_energy_j", "after_energy_j"}
    | {"queries", "waiting_energy_j", "emissions_g", "cost"}
)
# Columns shown only when at least one job has a value in them.
_OPTIONAL = frozenset(
    {
        "energy_per_query_p50_j",
        "energy_per_query_p95_j",
        "waiting_energy_j",
        "energy_per_step_j",
        "setup_energy_j",
        "after_energy_j",
        "reason",
        "cost",
    }
)


def cell(job: Mapping[str, Any], key: str, notes: Mapping[str, int] | None = None) -> str:
    """One table cell of a job (or a total or group row) for ``key``: a readable figure, ``-`` for none; a
    ``reason`` is its footnote mark from ``notes`` (``note_marks``)."""
    value = job.get(key)
    if key == "reason":
        # A footnote mark: the reason and its fix are printed under the table, where there is room.
        return f"[{notes[job['id']]}]" if notes and job["id"] in notes else ""
    if key == "id":
        # The unique prefix the database computed (``--job`` takes it back); the whole id from a collector
        # too old to say, since a cut of our own could be ambiguous.
        return str(job.get("short_id") or value)
    if key == "status":
        if job.get("ended_at") is None:
            return "running"
        # A job ended for it (its agent went silent, its processes vanished while the agent was down).
        return f"done ({job['ended_by']})" if job.get("ended_by") else "done"
    if key == "duration_s":
        return format_duration(value)
    if key.endswith("_j"):
        return format_energy(value)
    if key.endswith("power_w"):
        return "-" if value is None else f"{value:.0f}"
    if key in ("emissions_g", "cost"):
        return "-" if value is None else figure(float(value))
    if key == "sources":
        return ",".join(value or [])
    return "-" if value is None else str(value)


def note_marks(report: Mapping[str, Any]) -> dict[str, int]:
    """job id -> its footnote number, for the jobs that carry a reason."""
    with_reason = [j["id"] for j in report.get("jobs", []) if j.get("reason")]
    return {job_id: n for n, job_id in enumerate(with_reason, start=1)}


def job_columns(report: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """The job columns a table or markdown shows: (key, title, drop rank), the optional ones when some job
    has a value in them."""
    jobs = report.get("jobs", [])
    shown = [c for c in _COLUMNS if c[0] not in _OPTIONAL or any(j.get(c[0]) is not None for j in jobs)]
    return [(k, cost_title(report) if k == "cost" else t, d) for k, t, d in shown]


def cost_title(report: Mapping[str, Any]) -> str:
    """``COST EUR``: the currency the carbon section states, when it does."""
    currency = (report.get("carbon") or {}).get("currency")
    return f"COST {currency}" if currency else "COST"


def total_cells(report: Mapping[str, Any], keys: Sequence[str]) -> list[str] | None:
    """The total row under the jobs' columns (None without jobs or totals): sums where a sum means
    something, the totals' own figures for energy, emissions and cost, blank elsewhere."""
    jobs, totals = report.get("jobs") or [], report.get("totals")
    if not jobs or not totals:
        return None
    summed: dict[str, Any] = {"id": "TOTAL", "name": jobs_counted(report)}
    for key in _SUMMED:
        values = [j[key] for j in jobs if j.get(key) is not None]
        summed[key] = sum(values) if values else None
    for key in ("energy_j", "emissions_g", "cost", "duration_s"):
        summed[key] = totals.get(key)
    return [str(summed[k]) if k in ("id", "name") else (cell(summed, k) if k in _SUMMED else "") for k in keys]


def jobs_counted(report: Mapping[str, Any]) -> str:
    """``3 jobs``, or ``100 of 4667 jobs`` when other pages hold more that match (the total row sums this page)."""
    shown = len(report.get("jobs") or [])
    matched = report.get("jobs_matched")
    if isinstance(matched, int) and matched > shown:
        return f"{shown} of {matched} jobs"
    return f"{shown} job{'s' if shown != 1 else ''}"


def job_rows(report: Mapping[str, Any], columns: Sequence[tuple[str, str, int]]) -> list[list[str]]:
    """One row of cells per job under ``columns``."""
    notes = note_marks(report)
    return [[cell(job, key, notes) for key, _, _ in columns] for job in report.get("jobs", [])]


_GROUP_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("group", "", 0),
    ("jobs", "JOBS", 0),
    ("duration_s", "DURATION", 3),
    ("energy_j", "ENERGY", 0),
    ("energy_share", "SHARE", 2),
    ("emissions_g", "CO2e g", 0),
    ("cost", "COST", 1),
)


def _group_title(group_by: str) -> str:
    what, _, key = str(group_by).partition(":")
    return f"LABEL {key}" if what == "label" else what.upper()


def _group_cells(group: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    cells = []
    for key in keys:
        value = group.get(key)
        if key == "energy_share":
            cells.append("-" if value is None else f"{value * 100:.1f} %")
        elif key in ("group", "jobs"):
            cells.append(str(value))
        else:
            cells.append(cell(group, key))
    return cells


def group_table(report: Mapping[str, Any]) -> tuple[list[tuple[str, str, int]], list[list[str]]]:
    """A grouped report's columns and rows, ending in the total row when the report has totals."""
    groups = report.get("groups") or []
    priced = any(g.get("cost") is not None for g in groups)
    columns = [
        (
            k,
            _group_title(report.get("group_by") or "") if k == "group" else cost_title(report) if k == "cost" else t,
            d,
        )
        for k, t, d in _GROUP_COLUMNS
        if k != "cost" or priced
    ]
    keys = [k for k, _, _ in columns]
    rows = [_group_cells(g, keys) for g in groups]
    totals = report.get("totals")
    if groups and totals:
        # A job on two hosts is in two host groups; the total counts it once.
        rows.append(
            _group_cells({**totals, "group": "TOTAL", "energy_share": 1.0 if totals["energy_j"] else None}, keys)
        )
    return columns, rows
