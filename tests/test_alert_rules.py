"""The alert rules: valid for promtool, unit-tested with promtool, the PrometheusRule identical to the
rule file, every alert explained and using only the metrics docs/metrics.md promises."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import unavailable
from dashboard_queries import ROOT, contract, load_script, metric_names, series_names

PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "rules.yml"
RULES_TEST = PROMETHEUS / "rules.test.yml"
PROMETHEUS_RULE = ROOT / "deploy" / "kubernetes" / "base" / "prometheusrule.yaml"
EXPECTED_ALERTS = {
    "WattwatchGpuHeldButIdle",
    "WattwatchHostSilent",
    "WattwatchAgentNotPushing",
    "WattwatchSpoolGrowing",
    "WattwatchDeadBatches",
    "WattwatchIngestErrors",
    "WattwatchCollectorDatabaseDown",
    "WattwatchMetricsLeaderCount",
}


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _alerts() -> list[dict[str, Any]]:
    return [rule for group in _load(RULES)["groups"] for rule in group["rules"]]


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool not found (Debian: apt-get install prometheus)")
    return promtool


def test_promtool_checks_the_rules() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(EXPECTED_ALERTS)} rules found" in out.stdout


def test_promtool_unit_tests_pass() -> None:
    out = subprocess.run(
        [_promtool(), "test", "rules", RULES_TEST.name], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_committed_rules_are_the_generators_output() -> None:
    build = load_script(PROMETHEUS / "build.py")
    for path, text in build.render().items():
        assert path.read_text() == text, f"{path} is stale: run python deploy/prometheus/build.py"
    assert build.main(["--check"]) == 0


def test_prometheus_rule_holds_the_same_groups() -> None:
    rule = _load(PROMETHEUS_RULE)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert rule["metadata"]["namespace"] == "wattwatch"
    assert rule["spec"]["groups"] == _load(RULES)["groups"]


def test_every_alert_is_explained() -> None:
    alerts = _alerts()
    assert {a["alert"] for a in alerts} == EXPECTED_ALERTS
    known = series_names(contract())
    for a in alerts:
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        assert set(a["annotations"]) >= {"summary", "description"}, a["alert"]
        assert len(a["annotations"]["description"]) > 150, f"{a['alert']}: say what happened and what to do"
        names = metric_names(a["expr"])
        assert names and names <= known, f"{a['alert']}: {sorted(names - known)} not in docs/metrics.md"


def test_idle_gpu_alert_states_its_duration_and_threshold() -> None:
    idle = next(a for a in _alerts() if a["alert"] == "WattwatchGpuHeldButIdle")
    assert idle["for"] == "15m"
    assert "15m" in idle["annotations"]["description"] and "5%" in idle["annotations"]["description"]
    assert "< 0.05" in idle["expr"]


@pytest.mark.parametrize("alert", sorted(EXPECTED_ALERTS))
def test_every_alert_has_a_firing_and_a_quiet_unit_test(alert: str) -> None:
    cases = [case for group in _load(RULES_TEST)["tests"] for case in group.get("alert_rule_test", [])]
    mine = [case for case in cases if case["alertname"] == alert]
    assert any(case["exp_alerts"] for case in mine), f"{alert}: no case where it fires"
    assert any(not case["exp_alerts"] for case in mine), f"{alert}: no case where it stays quiet"
