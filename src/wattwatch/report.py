"""Renders the report dict (``storage.repository.build_report`` / ``GET /api/v1/report``) for people.

Formats: ``table`` (terminal), ``json`` (the contract of DESIGN.md), ``csv`` and ``markdown``.
Estimated energy is marked as such: a source column shows where each job's joules came from.
The table and markdown add p50/p95 J/query, waiting energy, J/step, setup and after columns only when
some job has them, so a report of training runs stays as narrow as before; CSV always has every column.
SETUP is what the job's process drew before the job opened (model load, warm-up), AFTER what it drew
after the job ended while it stayed on the GPU: not part of the job's ENERGY, and held by no other job.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wattwatch import table_render

FORMATS = ("table", "json", "csv", "markdown")

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
_TEXT_KEYS = frozenset({"id", "name", "kind", "status", "sources", "reason"})
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


def render(report: Mapping[str, Any], fmt: str = "table", *, width: int | None = None, color: bool = False) -> str:
    """Render ``report`` in one of ``FORMATS``. A table fits ``width`` columns (None: as wide as it is) and
    is bold where ``color``. With ``report_group.shape``'s ``totals`` a table and markdown end in a total
    row and the idle share; with its ``groups`` they show those, and CSV shows them too, ending in a row
    whose ``row`` is ``total`` (JSON shows whatever the report holds)."""
    if fmt == "json":
        return json.dumps(report, indent=2, sort_keys=False)
    if fmt == "csv":
        return _group_csv(report) if report.get("groups") is not None else _csv(report)
    if fmt == "markdown":
        return _markdown(report)
    if fmt == "table":
        return _table(report, width=width, color=color)
    raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def window_note(report: Mapping[str, Any]) -> str:
    """What the report covers and how to see more: its window and, when there is a next page, the cursor."""
    lines = []
    window = report.get("window") or {}
    if window.get("default"):
        lines.append(f"Jobs active in the last {window.get('since')} (the default; --since to change).")
    elif window.get("since_at"):
        lines.append(f"Jobs active since {window['since_at']} (--since {window.get('since')}).")
    shown, matched = len(report.get("jobs") or []), report.get("jobs_matched")
    if isinstance(matched, int) and matched > shown:
        lines.append(f"This page: {shown} of the {matched} jobs that match; totals are this page's (--limit for more).")
    if report.get("next_cursor"):
        lines.append(f"more jobs: --cursor {report['next_cursor']}")
    return "\n".join(lines)


def format_energy(energy_j: float | None) -> str:
    """Joules in a readable unit: ``812 J``, ``45.2 kJ``, ``1660 kJ``, ``3.41 kWh``, ``15.7 MWh``; never
    an exponent, which people misread."""
    if energy_j is None:
        return "-"
    if energy_j >= 3.6e9:
        return f"{figure(energy_j / 3.6e9)} MWh"
    if energy_j >= 3.6e6:
        return f"{figure(energy_j / 3.6e6)} kWh"
    if energy_j >= 1e4:
        return f"{figure(energy_j / 1e3)} kJ"
    if energy_j >= 10:
        return f"{energy_j:.0f} J"
    return f"{figure(energy_j)} J"


def figure(value: float) -> str:
    """Three significant digits without an exponent: ``0.0000278``, ``1.25``, ``1660`` (not 1.66e+03)."""
    if abs(value) >= 999.5:
        return f"{value:.0f}"
    text = f"{value:.3g}"
    if "e" in text:  # tiny: as many decimals as three significant digits need
        text = f"{value:.{min(2 - math.floor(math.log10(abs(value))), 15)}f}"
    return text


def format_grams(grams: float) -> str:
    """CO2e in a readable unit: ``140 g``, ``1.06 kg``, ``3.2 t``."""
    if grams >= 1e6:
        return f"{figure(grams / 1e6)} t"
    if grams >= 1e3:
        return f"{grams / 1e3:.3g} kg"
    return f"{figure(grams)} g"


def format_duration(duration_s: float | None) -> str:
    """Seconds as ``42.0s``, ``12m03s``, ``5h07m``."""
    if duration_s is None:
        return "-"
    if duration_s < 60:
        return f"{duration_s:.1f}s"
    if duration_s < 3600:
        return f"{int(duration_s // 60)}m{int(duration_s % 60):02d}s"
    return f"{int(duration_s // 3600)}h{int(duration_s % 3600 // 60):02d}m"


def cell(job: Mapping[str, Any], key: str, notes: Mapping[str, int] | None = None) -> str:
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


def footnotes(report: Mapping[str, Any]) -> list[str]:
    """``[n] JOB: reason. Fix: fix`` for each job with a reason."""
    notes = note_marks(report)
    lines = []
    for job in report.get("jobs", []):
        if job["id"] in notes:
            fix = f" Fix: {job['fix']}." if job.get("fix") else ""
            lines.append(f"[{notes[job['id']]}] {cell(job, 'id')}: {job['reason']}.{fix}")
    return lines


def _job_columns(report: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    jobs = report.get("jobs", [])
    shown = [c for c in _COLUMNS if c[0] not in _OPTIONAL or any(j.get(c[0]) is not None for j in jobs)]
    return [(k, _cost_title(report) if k == "cost" else t, d) for k, t, d in shown]


def _cost_title(report: Mapping[str, Any]) -> str:
    """``COST EUR``: the currency the carbon section states, when it does."""
    currency = (report.get("carbon") or {}).get("currency")
    return f"COST {currency}" if currency else "COST"


def _total_cells(report: Mapping[str, Any], keys: Sequence[str]) -> list[str] | None:
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


def _rows(report: Mapping[str, Any], columns: Sequence[tuple[str, str, int]]) -> list[list[str]]:
    notes = note_marks(report)
    return [[cell(job, key, notes) for key, _, _ in columns] for job in report.get("jobs", [])]


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    from wattwatch import table_render

    return table_render.render([table_render.Column(h) for h in header], rows).text


def idle_share_line(report: Mapping[str, Any]) -> str:
    """The footer's idle share: idle energy, its share of all measured, and what that measured holds. On
    one page of several the idle energy is the window's but the jobs are the page's, so no share is given
    (summing every matching job's energy on the server cost 50 ms of a 100-job page at 20,000 jobs): the
    line says how to get it."""
    totals = report.get("totals") or {}
    if not totals.get("measured_energy_j"):
        return ""
    shown, matched = len(report.get("jobs") or []), report.get("jobs_matched")
    if isinstance(matched, int) and matched > shown:
        if not report.get("idle"):
            return ""  # a later page: the idle energy is on the first one
        return (
            f"Idle: {format_energy(totals['idle_energy_j'])} in the window's whole hours; its share of all "
            f"measured is of every matching job: --limit {matched} (one page) gives it."
        )
    share = totals.get("idle_share") or 0.0
    phases = totals.get("setup_energy_j", 0.0) + totals.get("after_energy_j", 0.0)
    held = "jobs" + (" with setup and after" if phases else "")
    return (
        f"Idle: {format_energy(totals['idle_energy_j'])}, {share * 100:.1f} % of the "
        f"{format_energy(totals['measured_energy_j'])} measured ({held} {format_energy(totals['energy_j'] + phases)}"
        " + idle in the window's whole hours)."
    )


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


def _group_table(report: Mapping[str, Any]) -> tuple[list[tuple[str, str, int]], list[list[str]]]:
    groups = report.get("groups") or []
    priced = any(g.get("cost") is not None for g in groups)
    columns = [
        (
            k,
            _group_title(report.get("group_by") or "") if k == "group" else _cost_title(report) if k == "cost" else t,
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


def _columns(columns: Sequence[tuple[str, str, int]]) -> list[table_render.Column]:
    from wattwatch import table_render

    out = []
    for key, title, drop in columns:
        if key == "name":
            out.append(table_render.Column(title, drop=drop, cap=24, minimum=10))
        elif key == "sources":
            out.append(table_render.Column(title, drop=drop, cap=12))
        else:
            out.append(table_render.Column(title, right=key not in _TEXT_KEYS and key != "group", drop=drop))
    return out


def _hidden_note(hidden: Sequence[str], width: int | None) -> str:
    if not hidden:
        return ""
    from wattwatch import table_render

    text = f"Hidden to fit {width} columns: {', '.join(hidden)} (--width 0 shows them; CSV and JSON have all)."
    return table_render.wrap(text, max(width or 100, 40))


# Idle energy is shown per device up to this many rows; beyond (a fleet: 64 hosts are 576 rows) per host,
# which a person can read; CSV and JSON keep every device.
IDLE_DEVICE_ROWS = 24


def idle_view(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The idle table for people: (header, rows), per device, or per host when devices are too many."""
    idle = report.get("idle") or []
    if len(idle) <= IDLE_DEVICE_ROWS:
        rows = [[str(i["host"]), str(i["device"]), format_energy(i["energy_j"])] for i in idle]
        return ["HOST", "DEVICE", "ENERGY"], rows
    per_host: dict[str, list[float]] = {}
    for i in idle:
        per_host.setdefault(str(i["host"]), []).append(float(i["energy_j"] or 0.0))
    return ["HOST", "DEVICES", "ENERGY"], [[h, str(len(e)), format_energy(math.fsum(e))] for h, e in per_host.items()]


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


def _idle_title(report: Mapping[str, Any], header: Sequence[str]) -> str:
    start, end = report.get("idle_from"), report.get("idle_until")
    per_host = ", per host (per device: csv or json)" if "DEVICES" in header else ""
    if not start and not end:
        return f"Idle energy (held by no job){per_host}"
    window = f"from {start or 'the start'} to {end or 'now'}"
    return f"Idle energy (held by no job), whole hours {window}{per_host}"


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
    # Hosts on one intensity from one source share a line: a fleet in one region is one line, not 64.
    same: dict[tuple[float, str], list[str]] = {}
    for h in hosts:
        same.setdefault((float(h["g_per_kwh"]), str(h["source"])), []).append(str(h["host"]))
    for (g_per_kwh, source), names in same.items():
        lines.append(f"  {_host_list(sorted(names))}: {g_per_kwh:.4g} g/kWh ({source})")
    kinds = carbon.get("by_kind") or []
    if kinds:

        def money(value: float | None) -> str:
            return f", {figure(value)} {currency}" if value is not None else ""

        parts = [f"{k['kind']} {format_grams(k['emissions_g'])}{money(k.get('cost'))}" for k in kinds]
        total = f"total {format_grams(carbon['emissions_g'])}{money(carbon.get('cost'))}"
        lines.append(f"  by kind: {'; '.join(parts)}; {total}")
    return lines


def _host_list(names: Sequence[str]) -> str:
    """``node1``, ``node1, node2, node3``, or ``64 hosts (node0000 ... node0063)``."""
    if len(names) <= 3:
        return ", ".join(names)
    return f"{len(names)} hosts ({names[0]} ... {names[-1]})"


def _table(report: Mapping[str, Any], *, width: int | None = None, color: bool = False) -> str:
    from wattwatch import table_render

    grouped = report.get("groups") is not None
    if grouped:
        columns, rows = _group_table(report)
        has_rows = bool(report.get("groups"))
    else:
        columns = _job_columns(report)
        rows = _rows(report, columns)
        has_rows = bool(rows)
        total = _total_cells(report, [k for k, _, _ in columns])
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
    notes = footnotes(report) if not grouped else _grouped_notes(report)
    if notes:
        parts += ["", *notes]
    share = idle_share_line(report)
    if share and has_rows:
        parts += ["", share]
    header, idle = idle_view(report)
    if idle:
        parts += ["", f"{_idle_title(report, header)}:", _grid(header, idle)]
    if any("estimate" in (j.get("sources") or []) for j in report.get("jobs", [])):
        parts += ["", "Note: 'estimate' energy comes from a TDP model (no RAPL counter here), not a measurement."]
    note = window_note(report)
    if note:
        parts += ["", note]
    carbon = carbon_lines(report)
    if carbon:
        parts += ["", *carbon]
    return "\n".join(parts)


def _grouped_notes(report: Mapping[str, Any]) -> list[str]:
    n = sum(1 for j in report.get("jobs", []) if j.get("reason"))
    if not n:
        return []
    what = "jobs carry notes on their" if n != 1 else "job carries a note on its"
    return [f"{n} {what} figures; the report without --group-by lists them."]


def _markdown(report: Mapping[str, Any]) -> str:
    grouped = report.get("groups") is not None
    if grouped:
        columns, rows = _group_table(report)
    else:
        columns = _job_columns(report)
        rows = _rows(report, columns)
        total = _total_cells(report, [k for k, _, _ in columns])
        if total is not None:
            rows.append([f"**{c}**" if c else c for c in total])

    def md(h: Sequence[str], rs: Sequence[Sequence[str]]) -> list[str]:
        return ["| " + " | ".join(h) + " |", "|" + "---|" * len(h)] + ["| " + " | ".join(r) + " |" for r in rs]

    lines = md([t for _, t, _ in columns], rows)
    if not rows:
        lines += ["", f"*{empty_message(report)}*"]
    notes = footnotes(report) if not grouped else _grouped_notes(report)
    if notes:
        lines += ["", *(f"- {line}" for line in notes)]
    share = idle_share_line(report)
    if share and rows:
        lines += ["", share]
    header, idle = idle_view(report)
    if idle:
        lines += ["", f"**{_idle_title(report, header)}**", "", *md(header, idle)]
    note = window_note(report)
    if note:
        lines += ["", note]
    carbon = carbon_lines(report)
    if carbon:
        lines += ["", f"**{carbon[0]}**", "", *(f"- {line.strip()}" for line in carbon[1:])]
    return "\n".join(lines)


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
