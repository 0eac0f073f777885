"""``wattwatch jobs``: list jobs (the report's filters), or show one job with its hosts, devices and phases.

Reads through ``report_cli.fetch``, so a job list and a report select the same jobs from a database or a
collector, and a reference (id, unique id prefix or name) means the same job for both. Everything shown
is a report entry's (``storage.reads``): one job is the report of that job, drawn in more detail.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from wattwatch.cli import options
from wattwatch.cli.errors import UsageError
from wattwatch.config import Settings
from wattwatch.reporting import options as report_options

EPILOG = """examples:
  wattwatch jobs                              jobs of the last 7 days, oldest first
  wattwatch jobs --kind training --sort energy --since 30d
  wattwatch jobs 3f2a9c1e                     one job: an id prefix as the list shows it, or a job name
  wattwatch jobs llama-ft --format json       the job's full report entry"""


def add_parser(sub: Any) -> None:
    """Add ``jobs`` to the command parsers ``sub``."""
    p = options.add_command(
        sub, "jobs", help="list jobs, or show one with its hosts, devices, phases and notes", epilog=EPILOG
    )
    p.add_argument("ref", nargs="?", metavar="JOB", help="show this job: its id, a unique prefix of it, or its name")
    report_options.add_source(p)
    report_options.add_filters(p)
    report_options.add_view(p, group_by=False)
    options.add_reader_auth(p)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``wattwatch jobs [JOB]``."""
    from wattwatch.cli import report as report_cli
    from wattwatch.reporting import group as report_group

    report_cli.check_view(args)
    width, color = report_options.table_style(args)
    args.job = args.ref
    report = report_cli.fetch(args, settings)
    if args.ref:
        if not report["jobs"]:
            # Filters given beside the reference excluded it (alone, fetch said the reference is unknown).
            raise UsageError(f"job {args.ref!r} does not match the filters given; drop them to see it")
        text = show(report["jobs"][0], report, args.format, width=width, color=color)
        report_options.emit(text, args, what=f"job {report['jobs'][0]['id']} ({args.format})")
        return 0
    report_group.shape(report, sort=args.sort)
    report_options.emit(listing(report, args.format, width=width, color=color), args, what=f"jobs ({args.format})")
    return 0


# The list's columns: (report entry key, title, drop rank as in report._COLUMNS).
_LIST_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("id", "JOB", 0),
    ("name", "NAME", 0),
    ("kind", "KIND", 5),
    ("status", "STATUS", 4),
    ("started_at_s", "STARTED UTC", 3),
    ("duration_s", "DURATION", 2),
    ("energy_j", "ENERGY", 0),
    ("emissions_g", "CO2e g", 1),
    ("hosts", "HOSTS", 6),
    ("reason", "NOTE", 0),
)


def _minute(t_s: float | None) -> str:
    # Month, day and minute (UTC): what tells a week's jobs apart; the full time is in `jobs JOB`.
    return "-" if t_s is None else datetime.fromtimestamp(t_s, tz=UTC).strftime("%m-%d %H:%MZ")


def _list_cell(job: Mapping[str, Any], key: str, notes: Mapping[str, int]) -> str:
    from wattwatch.reporting.render import cell

    if key == "started_at_s":
        return _minute(job.get(key))
    if key == "hosts":
        return ",".join(job.get("hosts") or [])
    return cell(job, key, notes)


def listing(report: Mapping[str, Any], fmt: str, *, width: int | None = None, color: bool = False) -> str:
    """The job list in ``fmt``: JSON and CSV are the report's own (every field); a table and markdown show
    a job per line (id prefix, name, kind, status, start, duration, energy, CO2e, hosts, note)."""
    from wattwatch.cli.render import table as table_render
    from wattwatch.reporting import render as rendering

    if fmt in ("json", "csv"):
        return rendering.render(report, fmt)
    jobs = report.get("jobs") or []
    if not jobs:
        return rendering.empty_message(report)
    marks = rendering.note_marks(report)
    header = [t for _, t, _ in _LIST_COLUMNS]
    rows = [[_list_cell(j, k, marks) for k, _, _ in _LIST_COLUMNS] for j in jobs]
    notes = rendering.footnotes(report)
    more = rendering.window_note(report)
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += ["", *(f"- {n}" for n in notes)] if notes else []
        return "\n".join([*lines, *(["", more] if more else [])])
    columns = [
        table_render.Column(
            t,
            right=k in ("duration_s", "energy_j", "emissions_g"),
            drop=d,
            cap=24 if k == "name" else (20 if k == "hosts" else None),
            minimum=10 if k == "name" else None,
        )
        for k, t, d in _LIST_COLUMNS
    ]
    fitted = table_render.render(columns, rows, width=width, color=color)
    parts = [fitted.text]
    if fitted.hidden:
        parts.append(table_render.dim(f"Not shown, to fit {width} columns: {', '.join(fitted.hidden)}.", color))
    if notes:
        parts += ["", *notes]
    if more:
        parts += ["", more]
    parts += ["", "One job in detail: `wattwatch jobs JOB` (an id prefix as shown, or a name)."]
    return "\n".join(parts)


def show(job: Mapping[str, Any], report: Mapping[str, Any], fmt: str, *, width: int | None, color: bool) -> str:
    """One job in ``fmt``: JSON is its report entry; CSV a row per device it held; a table and markdown
    its figures, then its hosts, devices and phases, and why it shows 0 J or no GPU where it does."""
    if fmt == "json":
        return json.dumps(job, indent=2)
    if fmt == "csv":
        return _devices_csv(job)
    facts = _facts(job, report)
    sections = _sections(job)
    if fmt == "markdown":
        return _markdown(job, facts, sections)
    return _text(facts, sections, width=width, color=color)


def _facts(job: Mapping[str, Any], report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(what, value) lines of a job's summary."""
    from wattwatch.reporting.render import cell, figure, format_duration, format_energy

    carbon = report.get("carbon") or {}
    currency = carbon.get("currency") or ""
    facts = [
        ("id", f"{job['id']} (shortest prefix: {job.get('short_id') or job['id']})"),
        ("name", str(job.get("name"))),
        ("kind", str(job.get("kind"))),
        ("status", cell(job, "status")),
        ("started", str(job.get("started_at"))),
        ("ended", str(job.get("ended_at") or "- (running)")),
        ("duration", format_duration(job.get("duration_s"))),
        (
            "energy",
            f"{format_energy(job.get('energy_j'))} (GPU {format_energy(job.get('gpu_energy_j'))}, CPU "
            f"{format_energy(job.get('cpu_energy_j'))}, DRAM {format_energy(job.get('dram_energy_j'))})",
        ),
        ("power", f"average {cell(job, 'avg_power_w')} W, peak {cell(job, 'peak_power_w')} W"),
        (
            "CO2e",
            f"{cell(job, 'emissions_g')} g at {job.get('grid_intensity_g_per_kwh') or 0:.4g} g/kWh "
            f"({job.get('intensity_source') or '-'}), PUE {job.get('pue') or 1:g}",
        ),
    ]
    if job.get("cost") is not None:
        facts.append(("cost", f"{figure(job['cost'])} {currency}".rstrip()))
    if job.get("labels"):
        facts.append(("labels", ", ".join(f"{k}={v}" for k, v in sorted(job["labels"].items()))))
    if job.get("queries"):
        facts.append(("queries", f"{job['queries']}, {format_energy(job.get('energy_per_query_j'))} per query"))
    if job.get("steps"):
        facts.append(("steps", f"{job['steps']}, {format_energy(job.get('energy_per_step_j'))} per step"))
    facts.append(("sources", ", ".join(job.get("sources") or []) or "-"))
    if job.get("source_note"):
        facts.append(("note", str(job["source_note"])))
    if job.get("reason"):
        facts.append(("why", f"{job['reason']}."))
        if job.get("fix"):
            facts.append(("fix", f"{job['fix']}."))
    return facts


def _sections(job: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of a job's hosts, devices and phases (a section without rows is left out)."""
    from wattwatch.reporting.render import figure, format_duration, format_energy

    hosts = [
        [
            str(h["host"]),
            format_energy(h.get("energy_j")),
            f"{h.get('peak_power_w') or 0:.0f}",
            f"{figure(h.get('emissions_g') or 0.0)}",
            f"{h.get('grid_intensity_g_per_kwh') or 0:.4g}",
        ]
        for h in job.get("per_host") or []
    ]
    devices = [
        [str(d["host"]), str(d["device"]), str(d["kind"]), format_energy(d.get("energy_j")), ",".join(d["sources"])]
        for d in job.get("per_device") or []
    ]
    phases = [
        [str(p["phase"]), str(p["id"]), format_energy(p.get("energy_j")), format_duration(p.get("duration_s"))]
        for p in job.get("phases") or []
    ]
    sections = [
        ("Per host", ["HOST", "ENERGY", "PEAK W", "CO2e g", "g/kWh"], hosts),
        ("Per device", ["HOST", "DEVICE", "KIND", "ENERGY", "SOURCES"], devices),
        ("Phases (not in the job's energy)", ["PHASE", "ID", "ENERGY", "DURATION"], phases),
    ]
    return [(title, header, rows) for title, header, rows in sections if rows]


_RIGHT = frozenset({"ENERGY", "PEAK W", "CO2e g", "g/kWh", "DURATION"})


_Sections = Sequence[tuple[str, list[str], list[list[str]]]]


def _text(facts: Sequence[tuple[str, str]], sections: _Sections, *, width: int | None, color: bool) -> str:
    from wattwatch.cli.render import table as table_render

    pad = max(len(k) for k, _ in facts)
    lines = [f"{k.ljust(pad)}  {v}" for k, v in facts]
    for title, header, rows in sections:
        columns = [table_render.Column(h, right=h in _RIGHT) for h in header]
        lines += ["", f"{title}:", table_render.render(columns, rows, width=width, color=color).text]
    return "\n".join(lines)


def _markdown(job: Mapping[str, Any], facts: Sequence[tuple[str, str]], sections: _Sections) -> str:
    lines = [f"**Job {job['id']}**", "", *(f"- {k}: {v}" for k, v in facts)]
    for title, header, rows in sections:
        lines += ["", f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _devices_csv(job: Mapping[str, Any]) -> str:
    import csv
    import io

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["job_id", "host", "device", "kind", "energy_j", "sources"])
    for d in job.get("per_device") or []:
        writer.writerow([job["id"], d["host"], d["device"], d["kind"], d["energy_j"], ";".join(d["sources"])])
    return out.getvalue().rstrip("\n")
