"""Totals, groups and order of a report's jobs: ``--group-by``, ``--sort`` and the footer.

Pure functions on the report dict (``storage.reads.build_report`` / ``GET /api/v1/report``), so a report
read from a database and one fetched from a collector are shaped by the same code. Imports nothing heavy:
``wattwatch report --format json`` pays for none of it.

Groups add up: each group's energy, emissions and cost are the sum of its jobs' (``--group-by host``
splits a job over its hosts by the energy it drew on each, so a job on two hosts counts once in each
group's ``jobs`` but its joules once in all), and the groups' sum is the totals'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

SORT_KEYS = ("started", "energy", "duration", "name", "emissions", "cost")
DEFAULT_SORT = "started"
GROUP_BY_HELP = "kind, host or label:KEY"
# Jobs without the grouped-by value (no host, no such label) form one group of this name.
NO_VALUE = "(none)"


def parse_group_by(text: str) -> tuple[str, str | None]:
    """``kind`` / ``host`` / ``label:KEY`` -> (what, label key or None); ValueError saying what to use."""
    what, sep, key = text.partition(":")
    if what in ("kind", "host") and not sep:
        return what, None
    if what == "label" and sep and key:
        return what, key
    if what == "label":
        raise ValueError(f"--group-by {text!r} names no label key; use label:KEY, e.g. label:team")
    raise ValueError(f"--group-by {text!r} is unknown; use {GROUP_BY_HELP}")


def totals(jobs: Sequence[Mapping[str, Any]], idle: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The sums of ``jobs`` and ``idle``: energy, emissions, cost, setup and after energy, idle energy,
    and the idle share of everything measured (jobs + setup + after + idle; None when nothing was)."""
    energy_j = math.fsum(float(j.get("energy_j") or 0.0) for j in jobs)
    setup_j = math.fsum(float(j.get("setup_energy_j") or 0.0) for j in jobs)
    after_j = math.fsum(float(j.get("after_energy_j") or 0.0) for j in jobs)
    idle_j = math.fsum(float(i.get("energy_j") or 0.0) for i in idle)
    measured_j = energy_j + setup_j + after_j + idle_j
    costs = [float(j["cost"]) for j in jobs if j.get("cost") is not None]
    return {
        "jobs": len(jobs),
        "energy_j": energy_j,
        "emissions_g": math.fsum(float(j.get("emissions_g") or 0.0) for j in jobs),
        # None when no price per kWh is configured (no job has a cost), as on each job.
        "cost": math.fsum(costs) if costs else None,
        "duration_s": math.fsum(float(j.get("duration_s") or 0.0) for j in jobs),
        "setup_energy_j": setup_j,
        "after_energy_j": after_j,
        "idle_energy_j": idle_j,
        "measured_energy_j": measured_j,
        "idle_share": idle_j / measured_j if measured_j > 0 else None,
    }


def _parts(job: Mapping[str, Any], what: str, key: str | None) -> list[tuple[str, float, float, float | None]]:
    """(group, energy, emissions, cost) of ``job`` in each group it belongs to; they sum to the job's."""
    energy_j = float(job.get("energy_j") or 0.0)
    emissions_g = float(job.get("emissions_g") or 0.0)
    cost = job.get("cost")
    if what == "kind":
        return [(str(job.get("kind")), energy_j, emissions_g, cost)]
    if what == "label":
        labels = job.get("labels") or {}
        value = str(labels[key]) if key in labels else NO_VALUE
        return [(value, energy_j, emissions_g, cost)]
    per_host = job.get("per_host") or []
    if not per_host:
        return [(NO_VALUE, energy_j, emissions_g, cost)]
    out = []
    for h in per_host:
        host_j = float(h.get("energy_j") or 0.0)
        # Cost is proportional to energy (kWh x PUE x price), so a host's part is its share of the joules.
        share = host_j / energy_j if energy_j > 0 else 1.0 / len(per_host)
        out.append((str(h["host"]), host_j, float(h.get("emissions_g") or 0.0), None if cost is None else cost * share))
    return out


def groups(jobs: Sequence[Mapping[str, Any]], group_by: str) -> list[dict[str, Any]]:
    """``jobs`` summed per ``group_by`` value (``parse_group_by``'s syntax), in group-name order."""
    what, key = parse_group_by(group_by)
    acc: dict[str, dict[str, Any]] = {}
    for job in jobs:
        for name, energy_j, emissions_g, cost in _parts(job, what, key):
            g = acc.setdefault(
                name,
                {
                    "group": name,
                    "jobs": 0,
                    "job_ids": [],
                    "energy_j": 0.0,
                    "emissions_g": 0.0,
                    "cost": None,
                    "duration_s": 0.0,
                    "started_at_s": None,
                },
            )
            g["jobs"] += 1
            g["job_ids"].append(job["id"])
            g["energy_j"] += energy_j
            g["emissions_g"] += emissions_g
            if cost is not None:
                g["cost"] = (g["cost"] or 0.0) + cost
            g["duration_s"] += float(job.get("duration_s") or 0.0)
            started = job.get("started_at_s")
            if started is not None and (g["started_at_s"] is None or started < g["started_at_s"]):
                g["started_at_s"] = started
    total_j = math.fsum(g["energy_j"] for g in acc.values())
    for g in acc.values():
        g["energy_share"] = g["energy_j"] / total_j if total_j > 0 else None
    return [acc[name] for name in sorted(acc)]


def _sort_value(item: Mapping[str, Any], by: str, name_key: str) -> tuple[Any, ...]:
    if by == "name":
        return (str(item.get(name_key) or ""),)
    if by == "started":
        return (float(item.get("started_at_s") or 0.0),)
    field = {"energy": "energy_j", "duration": "duration_s", "emissions": "emissions_g", "cost": "cost"}[by]
    # Largest first; an item without the figure (no price: no cost) after every one with it.
    value = item.get(field)
    return (value is None, -float(value or 0.0))


def sort_items(items: Sequence[Mapping[str, Any]], by: str, *, name_key: str = "name") -> list[Mapping[str, Any]]:
    """``items`` (jobs, or groups with ``name_key="group"``) in ``--sort`` order: ``started`` oldest first,
    ``name`` A to Z, the figures (energy, duration, emissions, cost) largest first. Stable on ties."""
    if by not in SORT_KEYS:
        raise ValueError(f"--sort {by!r} is unknown; use one of {', '.join(SORT_KEYS)}")
    return sorted(items, key=lambda item: _sort_value(item, by, name_key))


def shape(report: dict[str, Any], *, group_by: str | None = None, sort: str | None = None) -> dict[str, Any]:
    """``report`` with its jobs in ``sort`` order (default ``started``), ``totals`` (always) and, with
    ``group_by``, ``groups`` (by group name, or in ``sort`` order: ``started`` is a group's first job's
    start) and ``group_by``. Fields are only added: a JSON reader of the plain report keeps working."""
    report["jobs"] = sort_items(report.get("jobs") or [], sort or DEFAULT_SORT)
    report["totals"] = totals(report["jobs"], report.get("idle") or [])
    if group_by is not None:
        report["group_by"] = group_by
        report["groups"] = sort_items(groups(report["jobs"], group_by), sort or "name", name_key="group")
    return report
