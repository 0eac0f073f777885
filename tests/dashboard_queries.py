"""What the dashboard and alert tests share: the committed dashboards, their queries with Grafana's
variables filled in, the metric names an expression uses, and the metric contract (docs/metrics.md)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"
CONTRACT = ROOT / "docs" / "metrics.md"
UIDS = {"wattwatch-fleet", "wattwatch-training", "wattwatch-inference", "wattwatch-carbon"}

# Grafana's own variables, as a short test run would see them: Prometheus scrapes every second there.
BUILTIN_VALUES = {"__rate_interval": "15s", "__interval": "5s", "__range": "5m", "__range_s": "300"}


def load_script(path: Path) -> ModuleType:
    """Import a generator script (``dashboards/build.py``, ...) that is not part of a package."""
    spec = importlib.util.spec_from_file_location(f"_script_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_dashboards() -> dict[str, dict[str, Any]]:
    """The committed dashboards, by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


@dataclass(frozen=True)
class Query:
    """One panel target."""

    dashboard: str
    panel: str
    ref: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}"


def queries(dashboard: dict[str, Any]) -> list[Query]:
    """Every PromQL expression of the dashboard's panels."""
    return [
        Query(dashboard["uid"], panel["title"], t["refId"], t["expr"])
        for panel in all_panels(dashboard)
        for t in panel.get("targets", [])
    ]


def variable_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """What each variable stands for when a query runs with its default: "All" (the allValue) for
    query variables, the default text for text boxes and constants. The data source variable is absent:
    it is a panel setting, never part of an expression."""
    values = dict(BUILTIN_VALUES)
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            values[var["name"]] = var["allValue"]
        elif var["type"] in ("textbox", "constant"):
            values[var["name"]] = var["query"]
    return values


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana's variables (``$x``, ``${x}``, ``${x:fmt}``, ``[[x]]``) replaced; an unknown
    variable raises KeyError naming it."""

    def one(m: re.Match[str]) -> str:
        name = next(g for g in m.groups() if g)
        if name not in values:
            raise KeyError(f"variable ${name} is not defined (in {expr!r})")
        return values[name]

    return _VARIABLE.sub(one, expr)


def variables_used(expr: str) -> set[str]:
    """Names of the Grafana variables ``expr`` refers to."""
    return {next(g for g in m.groups() if g) for m in _VARIABLE.finditer(expr)}


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# A whole identifier (not the tail of a number such as 3.6e6, not a function name before "(").
_IDENTIFIER = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
_NUMBERS = {"inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (variables already substituted) selects."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    names = {m.group(1) for m in _IDENTIFIER.finditer(text)}
    return {n for n in names if n.lower() not in _KEYWORDS | _NUMBERS}


def contract() -> dict[str, str]:
    """Metric name -> type, from the tables of docs/metrics.md."""
    rows = re.findall(r"^\|\s*`(wattwatch_\w+)`\s*\|\s*([\w ()0-9]+?)\s*\|", CONTRACT.read_text(), re.MULTILINE)
    return {name: kind.split()[0] for name, kind in rows}


def series_names(metrics: dict[str, str]) -> set[str]:
    """Every series name the contract's families expose (a summary's ``_sum`` and ``_count``, a
    histogram's ``_bucket`` too)."""
    names = set(metrics)
    for name, kind in metrics.items():
        if kind in ("summary", "histogram"):
            names |= {f"{name}_sum", f"{name}_count"}
        if kind == "histogram":
            names.add(f"{name}_bucket")
    return names
