"""The report as markdown (``render(report, "markdown")``): the table's rows and notes, for a review or a wiki."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
from wattwatch.reporting.rows import group_table, job_columns, job_rows, total_cells


def markdown(report: Mapping[str, Any]) -> str:
    """The report as markdown tables (jobs or groups, then idle energy) and its notes as paragraphs and lists."""
    grouped = report.get("groups") is not None
    if grouped:
        columns, rows = group_table(report)
    else:
        columns = job_columns(report)
        rows = job_rows(report, columns)
        total = total_cells(report, [k for k, _, _ in columns])
        if total is not None:
            rows.append([f"**{c}**" if c else c for c in total])

    def md(h: Sequence[str], rs: Sequence[Sequence[str]]) -> list[str]:
        return ["| " + " | ".join(h) + " |", "|" + "---|" * len(h)] + ["| " + " | ".join(r) + " |" for r in rs]

    lines = md([t for _, t, _ in columns], rows)
    if not rows:
        lines += ["", f"*{empty_message(report)}*"]
    notes = footnotes(report) + unmeasured_notes(report) if not grouped else grouped_notes(report)
    if notes:
        lines += ["", *(f"- {line}" for line in notes)]
    share = idle_share_line(report)
    if share and rows:
        lines += ["", share]
    header, idle = idle_view(report)
    if idle:
        lines += ["", f"**{idle_title(report, header)}**", "", *md(header, idle)]
    note = window_note(report)
    if note:
        lines += ["", note]
    carbon = carbon_lines(report)
    if carbon:
        lines += ["", f"**{carbon[0]}**", "", *(f"- {line.strip()}" for line in carbon[1:])]
    return "\n".join(lines)
