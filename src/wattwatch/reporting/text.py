"""The report as a terminal table (``render(report, "table")``): rows fitted to a width, then the notes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from wattwatch.cli.render import table as table_render
from wattwatch.reporting.notes import (
    carbon_lines,
    empty_message,
    footnotes,
    grouped_notes,
    idle_share_line,
    idle_title,
    idle_view,
    unmeasured_notes,
    window_note,
)
from wattwatch.reporting.rows import TEXT_KEYS, group_table, job_columns, job_rows, total_cells


def _columns(columns: Sequence[tuple[str, str, int]]) -> list[table_render.Column]:
    out = []
    for key, title, drop in columns:
        if key == "name":
            out.append(table_render.Column(title, drop=drop, cap=24, minimum=10))
        elif key == "sources":
            out.append(table_render.Column(title, drop=drop, cap=12))
        else:
            out.append(table_render.Column(title, right=key not in TEXT_KEYS and key != "group", drop=drop))
    return out


def _hidden_note(hidden: Sequence[str], width: int | None) -> str:
    if not hidden:
        return ""
    text = f"Hidden to fit {width} columns: {', '.join(hidden)} (--width 0 shows them; CSV and JSON have all)."
    return table_render.wrap(text, max(width or 100, 40))


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return table_render.render([table_render.Column(h) for h in header], rows).text


def table(report: Mapping[str, Any], *, width: int | None = None, color: bool = False) -> str:
    """The report as a table fitted to ``width`` (None: as wide as it is), bold where ``color``, then its notes."""
    grouped = report.get("groups") is not None
    if grouped:
        columns, rows = group_table(report)
        has_rows = bool(report.get("groups"))
    else:
        columns = job_columns(report)
        rows = job_rows(report, columns)
        has_rows = bool(rows)
        total = total_cells(report, [k for k, _, _ in columns])
        if total is not None:
            rows.append(total)
    parts: list[str] = []
    if has_rows:
        fitted = table_render.render(
            _columns(columns),
            rows,
            width=width,
            color=color,
            strong_rows=[len(rows) - 1] if report.get("totals") else [],
        )
        parts.append(fitted.text)
        hidden = _hidden_note(fitted.hidden, width)
        if hidden:
            parts.append(table_render.dim(hidden, color))
    else:
        parts.append(empty_message(report))
    notes = footnotes(report) + unmeasured_notes(report) if not grouped else grouped_notes(report)
    if notes:
        parts += ["", *notes]
    share = idle_share_line(report)
    if share and has_rows:
        parts += ["", share]
    header, idle = idle_view(report)
    if idle:
        parts += ["", f"{idle_title(report, header)}:", _grid(header, idle)]
    if any("estimate" in (j.get("sources") or []) for j in report.get("jobs", [])):
        parts += ["", "Note: 'estimate' energy comes from a TDP model (no RAPL counter here), not a measurement."]
    note = window_note(report)
    if note:
        parts += ["", note]
    carbon = carbon_lines(report)
    if carbon:
        parts += ["", *carbon]
    return "\n".join(parts)
