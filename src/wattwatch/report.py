"""Renders the report dict (``storage.repository.build_report`` / ``GET /api/v1/report``) for people.

Formats: ``table`` (terminal), ``json`` (the contract of DESIGN.md), ``csv`` and ``markdown``.
Estimated energy is marked as such: a source column shows where each job's joules came from.
The table and markdown add p50/p95 J/query, waiting energy, J/step, setup and after columns only when
some job has them, so a report of training runs stays as narrow as before; CSV always has every column.
SETUP is what the job's process drew before the job opened (model load, warm-up), AFTER what it drew
after the job ended while it stayed on the GPU: not part of the job's ENERGY, and held by no other job.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any

FORMATS = ("table", "json", "csv", "markdown")

_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "JOB"),
    ("name", "NAME"),
    ("kind", "KIND"),
    ("status", "STATUS"),
    ("duration_s", "DURATION"),
    ("energy_j", "ENERGY"),
    ("gpu_energy_j", "GPU"),
    ("cpu_energy_j", "CPU"),
    ("setup_energy_j", "SETUP"),
    ("after_energy_j", "AFTER"),
    ("avg_power_w", "AVG W"),
    ("peak_power_w", "PEAK W"),
    ("queries", "QUERIES"),
    ("energy_per_query_j", "J/QUERY"),
    ("energy_per_query_p50_j", "P50 J/Q"),
    ("energy_per_query_p95_j", "P95 J/Q"),
    ("waiting_energy_j", "WAITING"),
    ("energy_per_step_j", "J/STEP"),
    ("emissions_g", "CO2e g"),
    ("cost", "COST"),
    ("sources", "SOURCES"),
    ("reason", "NOTE"),
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
    # Why a job shows 0 J or no GPU, and what to do (issue 11).
    "reason",
    "fix",
    # What the emissions rest on (issue 11): each job's intensity (energy-weighted over its hosts), its
    # source, the PUE, and the cost (kWh x PUE x price; empty with no price set).
    "grid_intensity_g_per_kwh",
    "intensity_source",
    "pue",
    "cost",
)


def render(report: Mapping[str, Any], fmt: str = "table") -> str:
    """Render ``report`` in one of ``FORMATS``."""
    if fmt == "json":
        return json.dumps(report, indent=2, sort_keys=False)
    if fmt == "csv":
        return _csv(report)
    if fmt == "markdown":
        return _markdown(report)
    if fmt == "table":
        return _table(report)
    raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def window_note(report: Mapping[str, Any]) -> str:
    """What the report covers and how to see more: its window and, when there is a next page, the cursor."""
    lines = []
    window = report.get("window") or {}
    if window.get("default"):
        lines.append(f"Jobs active in the last {window.get('since')} (the default; --since to change).")
    elif window.get("since_at"):
        lines.append(f"Jobs active since {window['since_at']} (--since {window.get('since')}).")
    if report.get("next_cursor"):
        lines.append(f"more jobs: --cursor {report['next_cursor']}")
    return "\n".join(lines)


def format_energy(energy_j: float | None) -> str:
    """Joules in a readable unit: ``812 J``, ``45.2 kJ``, ``3.41 kWh``."""
    if energy_j is None:
        return "-"
    if energy_j >= 3.6e6:
        return f"{energy_j / 3.6e6:.3g} kWh"
    if energy_j >= 1e4:
        return f"{energy_j / 1e3:.3g} kJ"
    if energy_j >= 10:
        return f"{energy_j:.0f} J"
    return f"{energy_j:.3g} J"


def format_grams(grams: float) -> str:
    """CO2e in a readable unit: ``140 g``, ``1.06 kg``, ``3.2 t``."""
    if grams >= 1e6:
        return f"{grams / 1e6:.3g} t"
    if grams >= 1e3:
        return f"{grams / 1e3:.3g} kg"
    return f"{grams:.3g} g"


def format_duration(duration_s: float | None) -> str:
    """Seconds as ``42.0s``, ``12m03s``, ``5h07m``."""
    if duration_s is None:
        return "-"
    if duration_s < 60:
        return f"{duration_s:.1f}s"
    if duration_s < 3600:
        return f"{int(duration_s // 60)}m{int(duration_s % 60):02d}s"
    return f"{int(duration_s // 3600)}h{int(duration_s % 3600 // 60):02d}m"


def _cell(job: Mapping[str, Any], key: str, notes: Mapping[str, int] | None = None) -> str:
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
        return "-" if value is None else f"{value:.3g}"
    if key == "sources":
        return ",".join(value or [])
    return "-" if value is None else str(value)


def _notes(report: Mapping[str, Any]) -> dict[str, int]:
    """job id -> its footnote number, for the jobs that carry a reason."""
    with_reason = [j["id"] for j in report.get("jobs", []) if j.get("reason")]
    return {job_id: n for n, job_id in enumerate(with_reason, start=1)}


def _footnotes(report: Mapping[str, Any]) -> list[str]:
    """``[n] JOB: reason. Fix: fix`` for each job with a reason."""
    notes = _notes(report)
    lines = []
    for job in report.get("jobs", []):
        if job["id"] in notes:
            fix = f" Fix: {job['fix']}." if job.get("fix") else ""
            lines.append(f"[{notes[job['id']]}] {_cell(job, 'id')}: {job['reason']}.{fix}")
    return lines


def _rows(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    jobs = report.get("jobs", [])
    columns = [(k, t) for k, t in _COLUMNS if k not in _OPTIONAL or any(j.get(k) is not None for j in jobs)]
    header = [title for _, title in columns]
    notes = _notes(report)
    rows = [[_cell(job, key, notes) for key, _ in columns] for job in jobs]
    return header, rows


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _idle_rows(report: Mapping[str, Any]) -> list[list[str]]:
    return [[str(i["host"]), str(i["device"]), format_energy(i["energy_j"])] for i in report.get("idle", [])]


def empty_message(report: Mapping[str, Any]) -> str:
    """Why a report has no jobs: its filters match none (named), or the database holds none yet."""
    filters = report.get("filters") or {}
    window = report.get("window") or {}
    if window.get("default") and report.get("jobs_recorded", True) and set(filters) <= {"since"}:
        return (
            f"No jobs in the last {window.get('since')} (the default window); --since 30d or a date looks further back."
        )
    if filters and report.get("jobs_recorded", True):
        given = ", ".join(f"{k} {','.join(v) if isinstance(v, list) else v}" for k, v in filters.items())
        return f"No jobs match these filters: {given}. Widen or drop them; `wattwatch report` alone lists every job."
    return "No jobs recorded yet. Tag one with `wattwatch run` or wattwatch.job()."


def _idle_title(report: Mapping[str, Any]) -> str:
    start, end = report.get("idle_from"), report.get("idle_until")
    if not start and not end:
        return "Idle energy (held by no job)"
    window = f"from {start or 'the start'} to {end or 'now'}"
    return f"Idle energy (held by no job), whole hours {window}"


def carbon_lines(report: Mapping[str, Any]) -> list[str]:
    """What the emissions rest on: PUE, price, each host's grid intensity and its source; totals per kind.
    Empty for a report without a ``carbon`` section (a collector older than it)."""
    carbon = report.get("carbon")
    if not carbon:
        return []
    currency = carbon.get("currency") or ""
    price = f"; price {carbon['price_per_kwh']:g} {currency}/kWh" if carbon.get("price_per_kwh") else ""
    lines = [f"Carbon: gCO2e = kWh x PUE {carbon['pue']:g} x grid intensity{price}"]
    hosts = carbon.get("hosts") or []
    if not hosts:
        lines.append(f"  grid intensity {carbon['default_g_per_kwh']:g} g/kWh (config default)")
    for h in hosts:
        lines.append(f"  {h['host']}: {h['g_per_kwh']:.4g} g/kWh ({h['source']})")
    kinds = carbon.get("by_kind") or []
    if kinds:

        def money(value: float | None) -> str:
            return f", {value:.3g} {currency}" if value is not None else ""

        parts = [f"{k['kind']} {format_grams(k['emissions_g'])}{money(k.get('cost'))}" for k in kinds]
        total = f"total {format_grams(carbon['emissions_g'])}{money(carbon.get('cost'))}"
        lines.append(f"  by kind: {'; '.join(parts)}; {total}")
    return lines


def _table(report: Mapping[str, Any]) -> str:
    header, rows = _rows(report)
    parts = [_grid(header, rows) if rows else empty_message(report)]
    footnotes = _footnotes(report)
    if footnotes:
        parts += ["", *footnotes]
    idle = _idle_rows(report)
    if idle:
        parts += ["", f"{_idle_title(report)}:", _grid(["HOST", "DEVICE", "ENERGY"], idle)]
    if any("estimate" in (j.get("sources") or []) for j in report.get("jobs", [])):
        parts += ["", "Note: 'estimate' energy comes from a TDP model (no RAPL counter here), not a measurement."]
    note = window_note(report)
    if note:
        parts += ["", note]
    carbon = carbon_lines(report)
    if carbon:
        parts += ["", *carbon]
    return "\n".join(parts)


def _markdown(report: Mapping[str, Any]) -> str:
    header, rows = _rows(report)

    def md(h: Sequence[str], rs: Sequence[Sequence[str]]) -> list[str]:
        return ["| " + " | ".join(h) + " |", "|" + "---|" * len(h)] + ["| " + " | ".join(r) + " |" for r in rs]

    lines = md(header, rows)
    if not rows:
        lines += ["", f"*{empty_message(report)}*"]
    footnotes = _footnotes(report)
    if footnotes:
        lines += ["", *(f"- {line}" for line in footnotes)]
    idle = _idle_rows(report)
    if idle:
        lines += ["", f"**{_idle_title(report)}**", "", *md(["HOST", "DEVICE", "ENERGY"], idle)]
    note = window_note(report)
    if note:
        lines += ["", note]
    carbon = carbon_lines(report)
    if carbon:
        lines += ["", f"**{carbon[0]}**", "", *(f"- {line.strip()}" for line in carbon[1:])]
    return "\n".join(lines)


def _csv(report: Mapping[str, Any]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(_CSV_FIELDS)
    for job in report.get("jobs", []):
        row = []
        for key in _CSV_FIELDS:
            value = job.get(key)
            row.append(";".join(map(str, value)) if isinstance(value, list) else ("" if value is None else value))
        writer.writerow(row)
    return out.getvalue().rstrip("\n")
