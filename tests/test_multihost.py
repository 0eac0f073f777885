"""One run, many hosts, with real processes: one `wattwatch collector`, two `wattwatch agent --simulate 2`
(hosts node-a and node-b, each with its own WATTWATCH_HOME), and one training run started on both with the
same WATTWATCH_JOB. The collector's report must show one job whose energy is the sum of the hosts', each
host's part matching that host's simulator truth."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from procs import WATTWATCH, free_port, wait_for
from wattwatch.sim.fleet import SimulatedFleet

pytestmark = pytest.mark.e2e

HOSTS = ("node-a", "node-b")
RUN = "llama-70b-run-7"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WATTWATCH_", "CUDA_VISIBLE_DEVICES", "SLURM_"))}
    return {**env, "WATTWATCH_HOME": str(home)}


def host_truth_j(home: Path, n_gpus: int) -> float:
    """The exact energy of the boards this host's run held, between the instants the run started and
    ended on them (the simulator logs both: the agent set the boards' activity at the job's boundaries)."""
    log = home / "simulated-gpus.jsonl"
    fleet = SimulatedFleet.replay(log, n_gpus)
    total_j = 0.0
    for index in range(n_gpus):
        changes = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("index") == index]
        starts = [r["t_s"] for r in changes if r.get("kind") == "training"]
        ends = [r["t_s"] for r in changes if r.get("kind") == "idle"]
        if starts and ends:
            total_j += fleet.exact_energy_j(index, starts[0], ends[-1])
    return total_j


@pytest.mark.slow
def test_one_run_on_two_hosts_is_one_job_with_the_sum_and_a_per_host_breakdown(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    col_home = tmp_path / "collector"
    db_url = f"sqlite:///{tmp_path / 'central.db'}"
    collector = subprocess.Popen(
        [*WATTWATCH, "collector", "--db", db_url, "--migrate", "--open", "--listen", f"127.0.0.1:{port}"],
        env=base_env(col_home),
        stdout=(tmp_path / "collector.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    procs.append(collector)

    def collector_ready() -> bool:
        assert collector.poll() is None, (tmp_path / "collector.log").read_text()
        try:
            return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(collector_ready, 60, "the collector")

    agents: dict[str, subprocess.Popen[bytes]] = {}
    for host in HOSTS:
        home = tmp_path / host
        agents[host] = subprocess.Popen(
            [*WATTWATCH, "agent", "--simulate", "2", "--host", host, "--collector", url, "--interval", "0.5"],
            env=base_env(home),
            stdout=(tmp_path / f"{host}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        procs.append(agents[host])
    for host, agent in agents.items():
        wait_for(lambda a=agent, h=host: (tmp_path / h / "agent.sock").exists() and a.poll() is None, 60, host)

    # The same run on both hosts: `wattwatch run` under each host's agent, one WATTWATCH_JOB.
    train = [sys.executable, "-c", "import time; time.sleep(3)"]
    runs = [
        subprocess.Popen(
            [*WATTWATCH, "run", "--kind", "training", "--name", "llama-70b", "--", *train],
            env={**base_env(tmp_path / host), "WATTWATCH_JOB": RUN, "CUDA_VISIBLE_DEVICES": "0,1"},
        )
        for host in HOSTS
    ]
    assert [r.wait(timeout=60) for r in runs] == [0, 0]
    for host, agent in agents.items():
        agent.send_signal(signal.SIGTERM)  # stopping pushes the last intervals
        assert agent.wait(timeout=60) == 0, (tmp_path / f"{host}.log").read_text()

    report = httpx.get(f"{url}/api/v1/report", params={"job": RUN}, timeout=30).json()
    jobs = [j for j in report["jobs"] if j["id"] == RUN]
    assert len(jobs) == 1, report
    job = jobs[0]
    assert job["hosts"] == list(HOSTS)
    per_host = {h["host"]: h["energy_j"] for h in job["per_host"]}
    assert set(per_host) == set(HOSTS)
    assert job["energy_j"] == pytest.approx(sum(per_host.values()), rel=1e-9)
    gpus = sorted(d for d in job["devices"] if "/gpu" in d)
    assert gpus == ["node-a/gpu0", "node-a/gpu1", "node-b/gpu0", "node-b/gpu1"]
    lines = []
    for host in HOSTS:
        exact_j = host_truth_j(tmp_path / host, 2)
        lines.append(f"{host}: {per_host[host]:.1f} J vs exact {exact_j:.1f} J ({per_host[host] / exact_j - 1:+.3%})")
        # per_host includes the run's CPU-time share of the host's CPU package: a few joules at most here.
        assert per_host[host] == pytest.approx(exact_j, rel=0.01)
    print("\n" + "\n".join(lines) + f"\nrun total {job['energy_j']:.1f} J over {job['duration_s']:.2f} s")
