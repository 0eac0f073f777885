"""Renders the report dict (``storage.repository.build_report`` / ``GET /api/v1/report``) for people.

Formats: ``table`` (terminal, ``reporting.text``), ``json`` (the contract of DESIGN.md), ``csv``
(``reporting.csv_out``) and ``markdown`` (``reporting.markdown``); the rows they share are ``reporting.rows``,
the notes around them ``reporting.notes``, the figures ``reporting.figures``.
Estimated energy is marked as such: a source column shows where each job's joules came from.
The table and markdown add p50/p95 J/query, waiting energy, J/step, setup and after columns only when
some job has them, so a report of training runs stays as narrow as before; CSV always has every column.
SETUP is what the job's process drew before the job opened (model load, warm-up), AFTER what it drew
after the job ended while it stayed on the GPU: not part of the job's ENERGY, and held by no other job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from wattwatch.reporting.csv_out import csv_text
from wattwatch.reporting.figures import figure, format_duration, format_energy, format_grams
from wattwatch.reporting.markdown import markdown
from wattwatch.reporting.notes import (
    carbon_lines,
    empty_message,
    footnotes,
    idle_share_line,
    idle_view,
    window_note,
)
from wattwatch.reporting.rows import cell, jobs_counted, note_marks
from wattwatch.reporting.text import table

# What callers format cells and notes with, importable from here as from the modules that hold them.
__all__ = [
    "FORMATS",
    "carbon_lines",
    "cell",
    "empty_message",
    "figure",
    "footnotes",
    "format_duration",
    "format_energy",
    "format_grams",
    "idle_share_line",
    "idle_view",
    "jobs_counted",
    "note_marks",
    "render",
    "window_note",
]

FORMATS = ("table", "json", "csv", "markdown")


def render(report: Mapping[str, Any], fmt: str = "table", *, width: int | None = None, color: bool = False) -> str:
    """Render ``report`` in one of ``FORMATS``. A table fits ``width`` columns (None: as wide as it is) and
    is bold where ``color``. With ``report_group.shape``'s ``totals`` a table and markdown end in a total
    row and the idle share; with its ``groups`` they show those, and CSV shows them too, ending in a row
    whose ``row`` is ``total`` (JSON shows whatever the report holds)."""
    if fmt == "json":
        return json.dumps(report, indent=2, sort_keys=False)
    if fmt == "csv":
        return csv_text(report)
    if fmt == "markdown":
        return markdown(report)
    if fmt == "table":
        return table(report, width=width, color=color)
    raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
