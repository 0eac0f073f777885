"""The acceptance test for the dashboards and alert rules: a real `wattwatch up --simulate 4` with its
agent's /metrics, a training run (`wattwatch run`, steps marked) and an SDK inference server, scraped by a
real Prometheus every second. Every target of every dashboard, with Grafana's variables filled in as
"All", must return at least one series of finite values; every variable must list something; the alert
rules must evaluate cleanly, stay quiet on a healthy fleet, and join on the labels the metrics really
carry."""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conftest import unavailable
from dashboard_queries import ROOT, Query, load_dashboards, queries, substitute, variable_values
from procs import WATTWATCH, free_port, wait_for
from test_e2e import Up, start_up

# slow: a real Prometheus scraping live agents and evaluating every dashboard query and rule
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RULES = ROOT / "deploy" / "prometheus" / "rules.yml"

# Both loop until the stop file appears, so "now" panels (power, who holds a GPU) have running jobs.
TRAIN = textwrap.dedent(
    """
    import pathlib, sys, time, wattwatch
    stop = pathlib.Path(sys.argv[1])
    while not stop.exists():
        with wattwatch.step():
            time.sleep(0.2)
    """
)
SERVE = textwrap.dedent(
    """
    import pathlib, sys, time, wattwatch
    stop = pathlib.Path(sys.argv[1])
    with wattwatch.job("chat-serve", kind="inference"):
        while not stop.exists():
            with wattwatch.query(tokens_in=100, tokens_out=50):
                time.sleep(0.2)
            time.sleep(0.1)  # gaps with nothing in flight: waiting energy
    """
)


@dataclass
class Prometheus:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def get(self, path: str, **params: Any) -> Any:
        """GET an API path; the ``data`` of a successful answer."""
        r = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = r.json()
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_prometheus(tmp_path: Path, collector: str, agent: str) -> Prometheus:
    """A Prometheus scraping the collector and the agent every second, with wattwatch's alert rules."""
    binary = shutil.which("prometheus")
    if binary is None:
        unavailable("prometheus not found (Debian: apt-get install prometheus)")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "wattwatch-collector", "static_configs": [{"targets": [collector]}]},
            {"job_name": "wattwatch-agent", "static_configs": [{"targets": [agent]}]},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp_path / "prometheus.log"
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(proc, f"http://127.0.0.1:{port}", log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited early:\n{log.read_text()}")
        try:
            return httpx.get(f"{prom.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, 30, "prometheus to be ready")
    return prom


@dataclass
class Fleet:
    up: Up
    prom: Prometheus
    training_job_id: str
    workloads: list[subprocess.Popen[bytes]]

    def check_workloads_run(self) -> None:
        """The "now" panels were queried while the jobs ran."""
        for w in self.workloads:
            assert w.poll() is None, f"workload {w.args!r} exited early ({w.returncode})"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One fleet for this module's tests: starting it and settling span energies takes most of the time."""
    tmp_path = tmp_path_factory.mktemp("live")
    agent_port = free_port()
    up = start_up(
        tmp_path, f"sqlite:///{tmp_path / 'live.db'}", "--interval", "1", "--metrics-listen", f"127.0.0.1:{agent_port}"
    )
    stop = tmp_path / "stop-jobs"
    workloads: list[subprocess.Popen[bytes]] = []
    prom = None
    try:
        prom = start_prometheus(tmp_path, up.url.removeprefix("http://"), f"127.0.0.1:{agent_port}")
        training_job_id = "live-train-1"
        run = [*WATTWATCH, "run", "--kind", "training", "--name", "llama-ft", "--job-id", training_job_id]
        workloads.append(
            subprocess.Popen(
                [*run, "--", sys.executable, "-c", TRAIN, str(stop)],
                env={**up.env, "CUDA_VISIBLE_DEVICES": "0,1"},
            )
        )
        workloads.append(
            subprocess.Popen([sys.executable, "-c", SERVE, str(stop)], env={**up.env, "CUDA_VISIBLE_DEVICES": "2"})
        )
        # GPU 3 runs nothing: the idle panels have a GPU no job holds.
        yield Fleet(up, prom, training_job_id, workloads)
    finally:
        stop.touch()
        for w in workloads:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        if prom is not None:
            prom.stop()
        log = up.stop()
        if up.proc.returncode not in (0, None):
            print(log)


def problem(prom: Prometheus, expr: str) -> str | None:
    """Why ``expr`` fails as an instant query (an error, no series, a value that is not finite), or None."""
    try:
        data = prom.get("/api/v1/query", query=expr)
    except (AssertionError, httpx.HTTPError, ValueError) as exc:
        return str(exc)
    scalar = data["resultType"] == "scalar"
    series = [{"metric": {}, "value": data["result"]}] if scalar else data["result"]
    if not series:
        return "no series"
    bad = [s for s in series if not math.isfinite(float(s["value"][1]))]
    return f"not finite: {bad}" if bad else None


def wait_until_all_answer(prom: Prometheus, checks: dict[str, str], timeout_s: float) -> None:
    """Poll until every expression in ``checks`` (name -> PromQL) answers; fail listing those that don't."""
    failing: dict[str, str] = {}

    def all_answer() -> bool:
        failing.clear()
        for name, expr in checks.items():
            why = problem(prom, expr)
            if why is not None:
                failing[name] = f"{why}\n      {expr}"
        return not failing

    try:
        wait_for(all_answer, timeout_s, f"all {len(checks)} queries to return finite series")
    except AssertionError as exc:
        lines = "\n".join(f"  {name}: {why}" for name, why in sorted(failing.items()))
        raise AssertionError(f"{exc}; still failing:\n{lines}") from None


def test_every_dashboard_query_returns_data_from_real_prometheus(fleet: Fleet) -> None:
    prom = fleet.prom
    t0 = time.monotonic()

    def targets_up() -> bool:
        result = prom.get("/api/v1/query", query="up == 1")["result"]
        return {s["metric"]["job"] for s in result} == {"wattwatch-collector", "wattwatch-agent"}

    wait_for(targets_up, 30, "prometheus to scrape both the collector and the agent")

    dashboards = load_dashboards()
    checks: dict[str, str] = {}
    all_queries: list[Query] = []
    for d in dashboards.values():
        values = variable_values(d)
        for q in queries(d):
            all_queries.append(q)
            checks[str(q)] = substitute(q.expr, values)
    assert len(checks) == len(all_queries), "two targets share a dashboard/panel/refId name"
    wait_until_all_answer(prom, checks, timeout_s=90)
    print(f"\n{len(checks)} dashboard queries answered {time.monotonic() - t0:.1f} s after the fleet started")

    # Every variable lists something with the others at "All"; the training job is among the training jobs.
    for d in dashboards.values():
        values = variable_values(d)
        for var in d["templating"]["list"]:
            if var["type"] != "query":
                continue
            selector, label = var["definition"].removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
            listed = prom.get(f"/api/v1/label/{label}/values", **{"match[]": substitute(selector, values)})
            assert listed, f"{d['uid']}: variable {var['name']} lists nothing"
            if d["uid"] == "wattwatch-training" and var["name"] == "job_id":
                assert fleet.training_job_id in listed
    fleet.check_workloads_run()


def test_alert_rules_evaluate_cleanly_on_a_healthy_fleet(fleet: Fleet) -> None:
    prom = fleet.prom
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}

    # What each rule compares, before the comparison: the joins and units must fit the real series.
    idle_join = alerts["WattwatchGpuHeldButIdle"]["expr"].rsplit("<", 1)[0]
    host_age = alerts["WattwatchHostSilent"]["expr"].rsplit(">", 1)[0]
    push_age = alerts["WattwatchAgentNotPushing"]["expr"].rsplit(">", 1)[0]
    wait_until_all_answer(
        prom,
        {"held GPU utilisation": idle_join, "host last seen age": host_age, "agent last push age": push_age},
        timeout_s=60,
    )
    held = prom.get("/api/v1/query", query=idle_join)["result"]
    # The training run holds GPUs 0 and 1, the server GPU 2; GPU 3 is held by nobody.
    assert sorted(s["metric"]["device"] for s in held) == ["gpu0", "gpu1", "gpu2"], held
    assert all(0 <= float(s["value"][1]) <= 1 for s in held), held
    for expr in (host_age, push_age):
        ages = [float(s["value"][1]) for s in prom.get("/api/v1/query", query=expr)["result"]]
        # Timestamps in seconds, recent: a healthy fleet is seconds behind, not minutes (nor milliseconds off).
        assert ages and all(-5 < age < 30 for age in ages), (expr, ages)

    def evaluated() -> bool:
        groups = prom.get("/api/v1/rules")["groups"]
        # Never evaluated reads as the zero time, 0001-01-01T00:00:00Z.
        return bool(groups) and all(not r["lastEvaluation"].startswith("0001") for g in groups for r in g["rules"])

    wait_for(evaluated, 30, "every alert rule to be evaluated")
    for group in prom.get("/api/v1/rules")["groups"]:
        for rule in group["rules"]:
            assert rule["health"] == "ok", rule
            if rule["name"] != "WattwatchGpuHeldButIdle":  # utilisation may dip below 5% in the simulator
                assert rule["state"] == "inactive", rule
    assert {r["name"] for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]} == set(alerts)
    fleet.check_workloads_run()
