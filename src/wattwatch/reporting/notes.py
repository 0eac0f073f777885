"""What a table and markdown say around their rows: footnotes, the idle share and idle table, why a
report is empty, the window it covers and what its emissions rest on."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from wattwatch.reporting.figures import figure, format_duration, format_energy, format_grams
from wattwatch.reporting.rows import cell, note_marks


def footnotes(report: Mapping[str, Any]) -> list[str]:
    """``[n] JOB: reason. Fix: fix`` for each job with a reason."""
    notes = note_marks(report)
    lines = []
    for job in report.get("jobs", []):
        if job["id"] in notes:
            fix = f" Fix: {job['fix']}." if job.get("fix") else ""
            lines.append(f"[{notes[job['id']]}] {cell(job, 'id')}: {job['reason']}.{fix}")
    return lines


def unmeasured_notes(report: Mapping[str, Any]) -> list[str]:
    """``JOB: N s not measured ...`` for each job with time no reading of one of its devices covers
    (``unmeasured_s``), so its ENERGY reads as what it is: the energy of the rest of its window."""
    lines = []
    for job in report.get("jobs", []):
        unmeasured_s = float(job.get("unmeasured_s") or 0.0)
        if unmeasured_s > 0.0:
            duration = format_duration(job.get("duration_s"))
            lines.append(
                f"{cell(job, 'id')}: {figure(unmeasured_s)} s not measured of its {duration} (an agent's full "
                "disk, or an outage no counter bridged): ENERGY leaves that time out."
            )
    return lines


def grouped_notes(report: Mapping[str, Any]) -> list[str]:
    """A grouped report's one line on its jobs' notes (which it does not list)."""
    n = sum(1 for j in report.get("jobs", []) if j.get("reason"))
    if not n:
        return []
    what = "jobs carry notes on their" if n != 1 else "job carries a note on its"
    return [f"{n} {what} figures; the report without --group-by lists them."]


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


def idle_title(report: Mapping[str, Any], header: Sequence[str]) -> str:
    """The idle table's title: the whole hours it covers, and whether its rows are hosts."""
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
