"""The agent's own /metrics: in-process agents on simulated GPUs read through the NVML sensor (and the fake
pynvml), a real collector for pushes, and real ``wattwatch agent`` / ``wattwatch up`` processes scraped over
HTTP and checked by promtool."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from procs import WATTWATCH, free_port, promtool_check, wait_for
from test_agent import LinearSensor
from wattwatch.agent.options import AgentOptions
from wattwatch.agent.runner import Agent
from wattwatch.cli.main import main
from wattwatch.config import Settings
from wattwatch.errors import ConfigError
from wattwatch.protocol import wire
from wattwatch.sensors.base import Sensor
from wattwatch.sensors.nvml import NvmlSensor, resolve_visible
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.standalone import Collector

AGENT_FAMILIES = {
    "wattwatch_device_energy_joules": "counter",
    "wattwatch_device_power_watts": "gauge",
    "wattwatch_gpu_utilization_ratio": "gauge",
    "wattwatch_device_job_info": "gauge",
    "wattwatch_agent_info": "gauge",
    "wattwatch_agent_jobs": "gauge",
    "wattwatch_agent_spool_batches": "gauge",
    "wattwatch_agent_spool_dead_batches": "gauge",
    "wattwatch_agent_batches_set_aside": "counter",
    "wattwatch_agent_batches_pushed": "counter",
    "wattwatch_agent_push_failures": "counter",
    "wattwatch_agent_push_conflicts": "counter",
    "wattwatch_agent_last_push_timestamp_seconds": "gauge",
    "wattwatch_agent_dropped_intervals": "counter",
    "wattwatch_agent_sample_duration_seconds": "histogram",
    "wattwatch_agent_sensor_errors": "counter",
    "wattwatch_agent_refused": "counter",
}
DCGM_LABELS = ("UUID", "modelName")  # camelCase on purpose: joins with dcgm-exporter's series


def samples(text: str, name: str, **labels: str) -> list[Sample]:
    """The samples called ``name`` whose labels include ``labels``."""
    found = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return [s for s in found if all(s.labels.get(k) == v for k, v in labels.items())]


def value(text: str, name: str, **labels: str) -> float:
    """The one sample's value (fails when there is not exactly one)."""
    found = samples(text, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return float(found[0].value)


def scrape(agent: Agent) -> str:
    """The agent's /metrics text, rendered in-process from its own registry."""
    return generate_latest(agent.metrics_registry).decode()


def spooled_intervals(agent: Agent) -> list[wire.Interval]:
    """Every interval in the agent's spool (seals what is pending first)."""
    agent.seal()
    batches = [wire.decode_batch(body) for _, body in agent.spool.peek(limit=100_000)]
    return [iv for b in batches for iv in b.intervals]


@pytest.fixture
def fleet() -> SimulatedFleet:
    return SimulatedFleet(2, seed=3)


def make_agent(
    tmp_path: Path, fleet: SimulatedFleet, *, extra: Sequence[Sensor] = (), collector_url: str = "http://127.0.0.1:9"
) -> Agent:
    """An agent on the simulated fleet through the NVML sensor; it ticks only when told (``agent.tick()``)."""
    sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
    settings = Settings(home=tmp_path, collector_url=collector_url, interval_s=3600, push_interval_s=3600, host="h")
    return Agent(
        settings,
        [sensor, *extra],
        gpu_processes=sensor,
        resolve_visible=resolve_visible,
        serve_socket=False,
        options=AgentOptions(discover=False),
    )


@pytest.fixture
def agent(tmp_path: Path, fleet: SimulatedFleet) -> Iterator[Agent]:
    a = make_agent(tmp_path, fleet)
    yield a
    a.stop(flush_timeout_s=0.1)


def test_device_counters_add_up_the_intervals_and_power_is_the_last_one(agent: Agent, fleet: SimulatedFleet) -> None:
    fleet.set_activity(0, "training", fleet.clock())
    agent.start()
    for _ in range(3):
        time.sleep(0.2)  # let the boards draw some energy: intervals of about 0.2 s
        assert agent.tick()
    text = scrape(agent)
    intervals = spooled_intervals(agent)
    for index in (0, 1):
        key = f"gpu{index}"
        mine = sorted((iv for iv in intervals if iv.device == key), key=lambda iv: iv.t_end_s)
        # The last tick's interval may still be held for the next reading (its end is partly an estimate).
        held = agent.sampler._last[key].held is not None
        assert len(mine) == 3 - held
        labels = {
            "host": "h",
            "device": key,
            "device_kind": "gpu",
            "gpu": str(index),
            "UUID": fleet.uuid(index),
            "source": "simulated",
        }
        energy_j = value(text, "wattwatch_device_energy_joules_total", **labels)
        assert energy_j == pytest.approx(sum(iv.energy_j for iv in mine), rel=1e-12)
        last = mine[-1]
        power_w = value(text, "wattwatch_device_power_watts", **labels)
        assert power_w == pytest.approx(last.energy_j / (last.t_end_s - last.t_start_s), rel=1e-12)
        assert samples(text, "wattwatch_device_power_watts", device=key)[0].labels["modelName"].startswith("NVIDIA")
    # The training board draws far more than the idle one, and is busier by NVML's account.
    assert value(text, "wattwatch_device_power_watts", device="gpu0") > 2 * value(
        text, "wattwatch_device_power_watts", device="gpu1"
    )
    busy = value(text, "wattwatch_gpu_utilization_ratio", device="gpu0", gpu="0", UUID=fleet.uuid(0))
    assert 0.0 < busy <= 1.0
    assert value(text, "wattwatch_gpu_utilization_ratio", device="gpu1") < busy
    assert value(text, "wattwatch_agent_info", host="h", agent_id=agent.agent_id) == 1
    # One sample at start (the baseline) and one per tick, each reading every sensor.
    assert value(text, "wattwatch_agent_sample_duration_seconds_count", host="h") == 4
    assert value(text, "wattwatch_agent_sample_duration_seconds_sum", host="h") > 0
    buckets = [s.value for s in samples(text, "wattwatch_agent_sample_duration_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 4
    assert value(text, "wattwatch_agent_sensor_errors_total", host="h", sensor="nvml") == 0


def test_a_lost_gpu_loses_its_utilisation_series_but_the_scrape_goes_on(agent: Agent, fleet: SimulatedFleet) -> None:
    agent.start()
    assert {s.labels["device"] for s in samples(scrape(agent), "wattwatch_gpu_utilization_ratio")} == {"gpu0", "gpu1"}
    fleet.lose(1)  # NVML answers GPU_IS_LOST from now on
    text = scrape(agent)
    assert {s.labels["device"] for s in samples(text, "wattwatch_gpu_utilization_ratio")} == {"gpu0"}
    assert value(text, "wattwatch_agent_jobs", host="h") == 0


def test_job_info_shows_a_running_job_on_its_gpus_and_drops_it_when_it_ends(
    agent: Agent, fleet: SimulatedFleet
) -> None:
    agent.start()
    assert samples(scrape(agent), "wattwatch_device_job_info") == []
    reply = agent.handle(
        {"op": "job_start", "id": "ft-7", "name": "llama-ft", "kind": "training", "cuda_visible_devices": "1"}
    )
    assert reply["ok"] and reply["devices"] == ["gpu1"]
    wait_for(lambda: bool(samples(scrape(agent), "wattwatch_device_job_info")), 5.0, "the job's start to be applied")
    text = scrape(agent)
    (info,) = samples(text, "wattwatch_device_job_info")
    assert info.value == 1
    assert info.labels == {
        "host": "h",
        "device": "gpu1",
        "device_kind": "gpu",
        "UUID": fleet.uuid(1),
        "job_id": "ft-7",
        "job_name": "llama-ft",
        "kind": "training",
    }
    assert value(text, "wattwatch_agent_jobs", host="h") == 1
    agent.handle({"op": "job_end", "id": "ft-7"})
    wait_for(lambda: not samples(scrape(agent), "wattwatch_device_job_info"), 5.0, "the job's end to be applied")
    assert value(scrape(agent), "wattwatch_agent_jobs", host="h") == 0


def test_sensor_errors_are_counted_per_sensor(tmp_path: Path, fleet: SimulatedFleet) -> None:
    broken = LinearSensor({"cpu0": 10.0}, time.time)
    agent = make_agent(tmp_path, fleet, extra=[broken])
    agent.start()
    try:
        assert agent.tick()
        broken.fail = True
        assert agent.tick()
        assert agent.tick()
        text = scrape(agent)
    finally:
        agent.stop(flush_timeout_s=0.1)
    assert value(text, "wattwatch_agent_sensor_errors_total", host="h", sensor="linear") == 2
    assert value(text, "wattwatch_agent_sensor_errors_total", host="h", sensor="nvml") == 0
    # The CPU device's series carry no GPU labels (empty, which Prometheus treats as absent).
    (cpu,) = samples(text, "wattwatch_device_energy_joules_total", device="cpu0")
    assert cpu.labels["device_kind"] == "cpu" and cpu.labels["gpu"] == cpu.labels["UUID"] == ""
    assert samples(text, "wattwatch_gpu_utilization_ratio", device="cpu0") == []


def test_spool_grows_while_the_collector_is_away_then_drains_into_a_real_one(
    tmp_path: Path, fleet: SimulatedFleet, sqlite_url: str
) -> None:
    port = free_port()
    agent = make_agent(tmp_path / "agent", fleet, collector_url=f"http://127.0.0.1:{port}")
    agent.start()
    collector: Collector | None = None
    try:
        assert agent.tick()  # from here on every tick releases at least the interval the one before held
        for n in (1, 2, 3):
            assert agent.tick()
            assert agent.seal() is not None
            assert agent.pusher.push_pending(force=True) is False  # nobody listens yet
            text = scrape(agent)
            assert value(text, "wattwatch_agent_spool_batches", host="h") == n
            assert value(text, "wattwatch_agent_push_failures_total", host="h") == n
            assert value(text, "wattwatch_agent_batches_pushed_total", host="h") == 0
            assert value(text, "wattwatch_agent_last_push_timestamp_seconds", host="h") == 0
        # A batch the collector cannot decode is refused for good and set aside, not retried.
        agent.spool.put(agent.spool.next_seq(), b"not a batch", time.time())
        collector = Collector(
            Settings(home=tmp_path / "c", db_url=sqlite_url, listen=f"127.0.0.1:{port}"),
            migrate=False,
            open_local=True,
        )
        collector.start()
        before_s = time.time()
        assert agent.pusher.push_pending(force=True) is True
        text = scrape(agent)
    finally:
        agent.stop(flush_timeout_s=2.0)
        if collector is not None:
            collector.stop()
    assert value(text, "wattwatch_agent_spool_batches", host="h") == 0
    assert value(text, "wattwatch_agent_spool_dead_batches", host="h") == 1
    assert value(text, "wattwatch_agent_batches_set_aside_total", host="h", reason="rejected") == 1
    assert value(text, "wattwatch_agent_batches_set_aside_total", host="h", reason="repeated_failure") == 0
    assert value(text, "wattwatch_agent_batches_pushed_total", host="h") == 3
    assert value(text, "wattwatch_agent_push_failures_total", host="h") == 3
    assert before_s <= value(text, "wattwatch_agent_last_push_timestamp_seconds", host="h") <= time.time()


def test_a_bad_metrics_listen_setting_names_itself(tmp_path: Path, fleet: SimulatedFleet) -> None:
    settings = Settings(home=tmp_path, metrics_listen="nonsense")
    with pytest.raises(ConfigError, match=r"--metrics-listen \(WATTWATCH_METRICS_LISTEN\) 'nonsense' is not HOST:PORT"):
        Agent(settings, [NvmlSensor(fleet.module(), clock=fleet.clock)], serve_socket=False)


def test_metrics_listen_is_on_the_command_line_of_agent_and_up(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("agent", "up"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "--metrics-listen HOST:PORT" in out
        assert f"wattwatch {command} " in out and "--metrics-listen 0.0.0.0:9471" in out.replace("127.0.0.1", "0.0.0.0")
    assert main(["agent", "--metrics-listen", "nonsense"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "wattwatch agent: error: --metrics-listen 'nonsense' is not HOST:PORT; use e.g. 0.0.0.0:9471"


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "WATTWATCH_HOME": str(home), "WATTWATCH_METRICS_LISTEN": ""}


@pytest.mark.slow
def test_agent_process_serves_every_family_and_promtool_accepts_them(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    cmd = [*WATTWATCH, "agent", "--simulate", "2", "--metrics-listen", f"127.0.0.1:{port}", "--interval", "0.2"]
    cmd += ["--collector", f"http://127.0.0.1:{free_port()}"]  # nobody there: batches stay spooled
    proc = subprocess.Popen(cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:

        def scraped() -> bool:
            try:
                text = httpx.get(url, timeout=2).text
            except httpx.HTTPError:
                assert proc.poll() is None, proc.communicate()
                return False
            return bool(samples(text, "wattwatch_agent_push_failures_total")[0].value) and bool(
                samples(text, "wattwatch_device_power_watts", device="gpu1")
            )

        wait_for(scraped, 30.0, "the agent's /metrics to show measurements and a failed push")
        resp = httpx.get(url, timeout=5)
    finally:
        proc.kill()  # a clean stop would spend its flush timeout on the absent collector
        out, _ = proc.communicate(timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families == AGENT_FAMILIES
    # Every simulated GPU and the estimated CPU and DRAM are measured; a series per device, no more.
    energy = samples(text, "wattwatch_device_energy_joules_total")
    assert sorted(s.labels["device"] for s in energy) == ["cpu0", "dram0", "gpu0", "gpu1"]
    assert all(s.value > 0 for s in energy)
    assert value(text, "wattwatch_agent_spool_batches") >= 1
    assert f"wattwatch agent: metrics on {url}" in out
    promtool_check(text, camel_case_labels=DCGM_LABELS)


@pytest.mark.slow
def test_up_serves_the_agent_metrics_and_pushes_show_there(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    cmd = [*WATTWATCH, "up", "--simulate", "1", "--listen", f"127.0.0.1:{port}", "--interval", "0.2"]
    proc = subprocess.Popen(
        [*cmd, "--metrics-listen", f"127.0.0.1:{metrics_port}"],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def pushed() -> bool:
            try:
                text = httpx.get(url, timeout=2).text
            except httpx.HTTPError:
                assert proc.poll() is None, proc.communicate()
                return False
            return value(text, "wattwatch_agent_batches_pushed_total") > 0

        wait_for(pushed, 30.0, "a push to the collector to show on the agent's /metrics")
        text = httpx.get(url, timeout=5).text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"wattwatch up: the agent's own metrics on {url}" in out
    assert value(text, "wattwatch_agent_last_push_timestamp_seconds") > time.time() - 60
    assert value(text, "wattwatch_agent_push_failures_total") == 0
    with pytest.raises(httpx.ConnectError):  # stopped with the agent: the port is free again
        httpx.get(url, timeout=2)


def test_a_taken_metrics_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [*WATTWATCH, "agent", "--simulate", "1", "--metrics-listen", f"127.0.0.1:{port}"]
        result = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"wattwatch agent: error: --metrics-listen 127.0.0.1:{port}: cannot listen there (Address already in use); "
        "choose a free port on an address of this host"
    ]
