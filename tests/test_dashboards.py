"""The Grafana dashboards: generated, portable (data source chosen by a variable), and using only the
metrics docs/metrics.md promises. Every expression is parsed by promtool; tests/test_dashboards_live.py
runs them against a real Prometheus."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import unavailable
from dashboard_queries import (
    DASHBOARDS,
    UIDS,
    all_panels,
    contract,
    load_dashboards,
    load_script,
    metric_names,
    queries,
    series_names,
    substitute,
    variable_values,
    variables_used,
)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
BOARDS = load_dashboards()


def test_committed_dashboards_are_the_generators_output() -> None:
    build = load_script(DASHBOARDS / "build.py")
    rendered = build.render()
    assert set(rendered) == set(BOARDS), "a dashboard file is missing or left over: run python dashboards/build.py"
    for name, text in rendered.items():
        assert (DASHBOARDS / name).read_text() == text, f"{name} is stale: run python dashboards/build.py"
    assert build.main(["--check"]) == 0


def test_four_dashboards_with_stable_unique_uids() -> None:
    uids = [d["uid"] for d in BOARDS.values()]
    assert sorted(uids) == sorted(UIDS)
    for name, d in BOARDS.items():
        assert name == f"{d['uid']}.json"
        assert d["schemaVersion"] >= 39
        assert d["title"].startswith("wattwatch / ")


def _datasources(node: Any) -> list[Any]:
    """Every value under a "datasource" key, anywhere in the JSON."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                found.append(value)
            found.extend(_datasources(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_datasources(item))
    return found


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_query_uses_the_datasource_variable(name: str) -> None:
    d = BOARDS[name]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    n_targets = 0
    for panel in all_panels(d):
        for t in panel.get("targets", []):
            n_targets += 1
            assert panel["datasource"] == DATASOURCE, panel["title"]
            assert t["datasource"] == DATASOURCE, panel["title"]
            assert t["expr"].strip(), panel["title"]
    assert n_targets >= 8
    # No data source uid hard-coded anywhere (Grafana's built-in annotation source aside).
    for ds in _datasources(d):
        assert ds == DATASOURCE or ds == {"type": "grafana", "uid": "-- Grafana --"}, ds


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_variables(name: str) -> None:
    d = BOARDS[name]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert "host" in variables
    for var in variables.values():
        if var["type"] != "query":
            continue
        assert var["datasource"] == DATASOURCE
        assert var["multi"] is True and var["includeAll"] is True and var["allValue"] == ".*", var["name"]
        assert re.fullmatch(r"label_values\(.+, (\w+)\)", var["definition"]), var["definition"]
        assert var["definition"].endswith(f", {var['name']})"), "a variable is named after the label it lists"
        assert var["query"]["query"] == var["definition"]
    # Each query uses variables the dashboard defines, and each defined variable is used.
    used: set[str] = set()
    for q in queries(d):
        used |= variables_used(q.expr)
        substitute(q.expr, variable_values(d))  # raises on an undefined variable
    for var in variables.values():
        used |= variables_used(var.get("definition", ""))
    assert set(variables) - {"datasource"} <= used


def test_cost_dashboards_have_a_price_per_kwh() -> None:
    for uid in ("wattwatch-carbon", "wattwatch-fleet"):
        variables = {v["name"]: v for v in BOARDS[f"{uid}.json"]["templating"]["list"]}
        price = variables["price_per_kwh"]
        assert price["type"] in ("textbox", "constant")
        assert float(price["query"]) == pytest.approx(0.15)
    carbon = BOARDS["wattwatch-carbon.json"]
    assert {"host", "kind", "job_id"} <= {v["name"] for v in carbon["templating"]["list"]}
    assert sum("$price_per_kwh" in q.expr for q in queries(carbon)) >= 3


def test_metric_names_are_found_in_expressions() -> None:
    # The extractor the next test relies on: it must see metrics, and not labels, functions or numbers.
    expr = (
        'sum by (host, le) (rate(a_bucket{job_id=~"x", kind="b"}[5m])) / 3.6e6 * scalar(max(b_total))'
        " and on (job_id) c offset 1m or time() > bool 2 * group_left ()"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
    assert metric_names('histogram_quantile(0.95, sum(rate(x{le="+Inf"}[1m])) by (le))') == {"x"}


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_expression_uses_only_contract_metrics(name: str) -> None:
    known = series_names(contract())
    assert len(known) > 30, "docs/metrics.md's tables were not parsed"
    d = BOARDS[name]
    values = variable_values(d)
    for q in queries(d):
        names = metric_names(substitute(q.expr, values))
        assert names, f"{q}: no metric found in {q.expr!r}"
        assert names <= known, f"{q}: {sorted(names - known)} not in docs/metrics.md"
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            selector = re.fullmatch(r"label_values\((.+), \w+\)", var["definition"])
            assert selector is not None
            assert metric_names(substitute(selector.group(1), values)) <= known, var["definition"]


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panels_fit_the_grid_without_overlapping(name: str) -> None:
    d = BOARDS[name]
    cells: dict[tuple[int, int], str] = {}
    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids))
    for panel in d["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
        if panel["type"] != "row":
            assert panel["description"], f"{panel['title']} says what it shows"


def test_promtool_parses_every_expression(tmp_path: Path) -> None:
    # promtool has no "check query"; a rule file with one recording rule per expression gets them parsed.
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool not found (Debian: apt-get install prometheus)")
    rules = []
    for d in BOARDS.values():
        values = variable_values(d)
        for i, q in enumerate(queries(d)):
            rules.append({"record": f"dashboard:{d['uid'].replace('-', '_')}:{i}", "expr": substitute(q.expr, values)})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rules)} rules found" in out.stdout
