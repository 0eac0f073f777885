"""Zero-code counts: a real HTTP server on loopback exposes vLLM-shaped counters (made with
prometheus_client, as vLLM makes them, under vLLM's metric names); the scraper turns their advance into
QueryCount windows and finds the job by the process that listens on the port. The last test runs it all
with no SDK call: a fake `vllm serve` process, the agent, a real collector, the report."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from wattwatch.agent.options import AgentOptions
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.runner import Agent
from wattwatch.agent.scrape import PRESETS, Scraper, parse_target, read_counters
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings
from wattwatch.errors import ConfigError
from wattwatch.protocol import wire
from wattwatch.sensors.nvml import NvmlSensor
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.standalone import Collector
from wattwatch.storage.engine import make_engine
from wattwatch.storage.reads import build_report

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class FakeVllm:
    """vLLM's request and token counters in a fresh registry (a restart starts a new one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.success = Counter(
            "vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=self.registry
        )
        self.prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=self.registry)
        self.generation = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=self.registry)

    def serve(self, n: int, reason: str = "stop", prompt: int = 100, generated: int = 30) -> None:
        self.success.labels(MODEL, reason).inc(n)
        self.prompt.labels(MODEL).inc(n * prompt)
        self.generation.labels(MODEL).inc(n * generated)


@dataclass
class Server:
    url: str
    port: int
    engine: FakeVllm = field(default_factory=FakeVllm)
    status: int = 200


@pytest.fixture
def vllm() -> Iterator[Server]:
    state = Server(url="", port=0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(state.engine.registry) if state.status == 200 else b"oops"
            self.send_response(state.status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    state.port = server.server_address[1]
    state.url = f"http://127.0.0.1:{state.port}/metrics"
    yield state
    server.shutdown()
    server.server_close()


def test_target_specs() -> None:
    t = parse_target("vllm:http://10.0.0.5:8000/metrics#job=chat")
    assert (t.url, t.job, t.counters) == ("http://10.0.0.5:8000/metrics", "chat", PRESETS["vllm"])
    c = parse_target("custom:http://h/metrics#queries=a_total|b_total&tokens_out=gen")
    assert (c.counters.queries, c.counters.tokens_in, c.counters.tokens_out) == (("a_total", "b_total"), (), ("gen",))
    for bad, why in [
        ("http://h/metrics", "PRESET:URL"),
        ("nginx:http://h/metrics", "not one of"),
        ("custom:http://h/metrics", "#queries"),
        ("vllm:http://h/metrics#jobb=x", "unknown option"),
        ("vllm:http://h/metrics#job=has space", "job id"),
    ]:
        with pytest.raises(ConfigError, match=why):
            parse_target(bad)


def test_tgi_counters_without_total_suffix_and_histogram_sums() -> None:
    text = (
        "# TYPE tgi_request_success counter\ntgi_request_success 7\n"
        "# TYPE tgi_request_input_length histogram\n"
        'tgi_request_input_length_bucket{le="+Inf"} 7\ntgi_request_input_length_sum 700\n'
        "tgi_request_input_length_count 7\n"
        "# TYPE tgi_request_generated_tokens histogram\ntgi_request_generated_tokens_sum 210\n"
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e9\n"
    )
    values, start_s = read_counters(text, PRESETS["tgi"])
    # prometheus_client's parser adds _total to counters exposed without it; either form is matched.
    assert {name.removesuffix("_total"): v for (name, _), v in values.items()} == {
        "tgi_request_success": 7.0,
        "tgi_request_input_length_sum": 700.0,
        "tgi_request_generated_tokens_sum": 210.0,
    }
    assert start_s == 1.7e9


def test_counter_deltas_new_series_resets_and_outages(vllm: Server) -> None:
    now = [1000.0]
    scraper = Scraper(
        [parse_target(f"vllm:{vllm.url}")],
        lambda counts: None,
        job_of_pid=lambda pid: "chat" if pid == os.getpid() else None,
        candidate_pids=lambda: {os.getpid()},  # this test process is the "server": it owns the socket
        clock=lambda: now[0],
    )
    vllm.engine.serve(50)  # before the first scrape: nobody's window
    assert scraper.scrape_once() == []

    def scrape(t_s: float) -> list[tuple[str, float, float, int, int, int]]:
        now[0] = t_s
        return [(c.job, c.t_start_s, c.t_end_s, c.queries, c.tokens_in, c.tokens_out) for c in scraper.scrape_once()]

    vllm.engine.serve(3)
    vllm.engine.serve(1, reason="length", prompt=40, generated=256)  # a series that appears now counts whole
    assert scrape(1001.0) == [("chat", 1000.0, 1001.0, 4, 340, 346)]
    assert scrape(1002.0) == [("chat", 1001.0, 1002.0, 0, 0, 0)]  # idle windows are sent too
    vllm.status = 500
    vllm.engine.serve(2)
    assert scrape(1003.0) == []  # an outage keeps the window open
    vllm.status = 200
    assert scrape(1004.0) == [("chat", 1002.0, 1004.0, 2, 200, 60)]
    vllm.engine = FakeVllm()  # the server restarted: counters start again from zero
    vllm.engine.serve(1, prompt=10, generated=5)
    assert scrape(1005.0) == [("chat", 1004.0, 1005.0, 1, 10, 5)]


def test_the_agent_attributes_scraped_counts_to_the_serving_process_job(tmp_path: Path, vllm: Server) -> None:
    fleet = SimulatedFleet(1)
    sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
    settings = Settings(home=tmp_path, collector_url="http://127.0.0.1:9", interval_s=3600, host="h")
    options = AgentOptions(scrape=(parse_target(f"vllm:{vllm.url}"),))
    agent = Agent(settings, [sensor], gpu_processes=sensor, serve_socket=False, procfs=ProcFs(), options=options)
    agent.start()
    try:
        agent.handle({"op": "job_start", "id": "chat", "name": "chat", "kind": "inference", "pid": os.getpid()})
        fleet.set_activity(0, "inference", fleet.clock(), pid=os.getpid())  # the server's process is on gpu0
        assert agent.tick()
        assert agent.scraper is not None
        agent.scraper.scrape_once()
        vllm.engine.serve(5)
        counts = agent.scraper.scrape_once()
        assert [(c.job, c.queries, c.tokens_in, c.tokens_out) for c in counts] == [("chat", 5, 500, 150)]
    finally:
        agent.stop(flush_timeout_s=0.2)
    spool = Spool(tmp_path / "spool.db")
    batches = [wire.decode_batch(body) for _, body in spool.peek(limit=1000)]
    spool.close()
    assert [(c.job, c.queries) for b in batches for c in b.query_counts] == [("chat", 5)]


def test_a_metrics_front_beside_the_gpu_processes_belongs_to_their_parents_job(tmp_path: Path) -> None:
    """TGI's router (HTTP, metrics) and its shards (GPU) are siblings under the launcher: here this test
    process plays the launcher, a child http.server the router."""
    port = free_port()
    (tmp_path / "metrics").write_text("# TYPE tgi_request_success counter\ntgi_request_success 10\n")
    router = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not listening(port):
            assert time.monotonic() < deadline, "http.server did not start"
            time.sleep(0.05)
        scraper = Scraper(
            [parse_target(f"tgi:http://127.0.0.1:{port}/metrics")],
            lambda counts: None,
            job_of_pid=lambda pid: "tgi-serve" if pid == os.getpid() else None,
            candidate_pids=lambda: {os.getpid()},
        )
        scraper.scrape_once()
        (tmp_path / "metrics").write_text("# TYPE tgi_request_success counter\ntgi_request_success 14\n")
        assert [(c.job, c.queries) for c in scraper.scrape_once()] == [("tgi-serve", 4)]
    finally:
        router.kill()
        router.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


FAKE_VLLM = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from prometheus_client import CollectorRegistry, Counter, generate_latest

port = int(sys.argv[sys.argv.index("--port") + 1])
reg = CollectorRegistry()
ok = Counter("vllm:request_success", "Finished requests.", ["model_name", "finished_reason"], registry=reg)
prompt = Counter("vllm:prompt_tokens", "Prefill tokens.", ["model_name"], registry=reg)
gen = Counter("vllm:generation_tokens", "Generated tokens.", ["model_name"], registry=reg)


class Metrics(BaseHTTPRequestHandler):
    def do_GET(self):
        # Every scrape finds three more finished requests: the test knows exactly what was served.
        ok.labels("fake-model", "stop").inc(3)
        prompt.labels("fake-model").inc(300)
        gen.labels("fake-model").inc(90)
        body = generate_latest(reg)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Metrics).serve_forever()
"""


def test_a_vllm_server_nobody_tagged_gets_energy_per_query_from_its_counters(tmp_path: Path) -> None:
    """No SDK, no `wattwatch run`: the agent finds the server by its command, scrapes its port, and
    the collector's report has energy per query from the counts."""
    port, col_port = free_port(), free_port()
    script = tmp_path / "vllm"  # its command line reads "python .../vllm serve fake-model"
    script.write_text(FAKE_VLLM)
    server = subprocess.Popen([sys.executable, str(script), "serve", "fake-model", "--port", str(port)])
    collector_settings = Settings(home=tmp_path / "collector", listen=f"127.0.0.1:{col_port}")
    collector = Collector(collector_settings, migrate=True, open_local=True)
    collector.start()
    try:
        deadline = time.monotonic() + 30
        while not listening(port):
            assert time.monotonic() < deadline and server.poll() is None, "the fake vLLM did not start"
            time.sleep(0.05)
        fleet = SimulatedFleet(1)
        sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
        settings = Settings(home=tmp_path / "agent", collector_url=collector.url, interval_s=3600, host="gpu-1")
        options = AgentOptions(scrape=(parse_target(f"vllm:http://127.0.0.1:{port}/metrics"),))
        agent = Agent(settings, [sensor], gpu_processes=sensor, serve_socket=False, procfs=ProcFs(), options=options)
        agent.start()
        assert agent.scraper is not None
        try:
            fleet.set_activity(0, "inference", fleet.clock(), pid=server.pid)
            assert agent.tick()
            (job,) = agent.jobs()
            assert (job["kind"], job["discovered_by"]) == ("inference", "heuristic:vllm")
            assert agent.scraper.scrape_once() == []  # the baseline
            assert agent.tick()
            first_s = agent.sampler.last_t_s
            counts = []
            for _ in range(6):
                time.sleep(0.4)
                counts += agent.scraper.scrape_once()
                assert agent.tick()  # ticks right after scrapes: the windows' edges are readings
            last_s = agent.sampler.last_t_s
            fleet.set_activity(0, "idle", fleet.clock(), pid=server.pid)
            assert agent.tick()
        finally:
            agent.stop(flush_timeout_s=5.0)
    finally:
        server.kill()
        server.wait()
        collector.stop()
    assert [(c.job, c.queries, c.tokens_in, c.tokens_out) for c in counts] == [(job["id"], 3, 300, 90)] * 6
    engine = make_engine(collector_settings.resolved_db_url)
    try:
        report = build_report(engine, job_id=job["id"])
    finally:
        engine.dispose()
    (entry,) = report["jobs"]
    assert (entry["query_method"], entry["queries"], entry["tokens"]) == ("counts", 18, 18 * 130)
    # The windows' energy is the energy between the first and last window edge (tick readings).
    windows_j = fleet.exact_energy_j(0, first_s, last_s)
    print(f"\n{entry['energy_per_query_j']:.2f} J/query vs exact {windows_j / 18:.2f} J/query")
    assert entry["energy_per_query_j"] == pytest.approx(windows_j / 18, rel=0.02)
    assert entry["energy_per_query_j"] * 18 + entry["waiting_energy_j"] == pytest.approx(entry["energy_j"], rel=1e-9)
