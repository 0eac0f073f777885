"""docs/accuracy.md's "other checks", each against a truth computed without wattwatch's accounting.

1. Sharing. Two real child processes tagged only by their environment (``WATTWATCH_JOB``) time-share one
   simulated GPU at 25 % and 70 % SM utilisation, then 80 % and 15 % (changed mid-interval); an agent
   (in this process, its ticks driven here every 0.25 s for 3 s) finds them in /proc and weighs each
   interval by the per-process utilisation the fake NVML reports; each job's part is split as the
   collector splits it. Figure: the share of the shared intervals' energy that went to one job. Truth:
   each interval's measured energy split by the simulator's exact power-weighted utilisation ratio over it
   (1 ms steps of its power and its processes' utilisation).
2. Two hosts. A real ``wattwatch collector`` and two real ``wattwatch agent --simulate 2`` (hosts node-a
   and node-b, 0.5 s tick); one ``wattwatch run`` of ``--train-s`` seconds on each host under one
   ``WATTWATCH_JOB``. Figure: the collector's per-host breakdown of the one job (its GPU energy plus the
   run's small share of the host's CPU package), and the job's total. Truth: each host's simulator log,
   replayed: the exact energy of its boards between the instants the run started and ended on them.
3. Scraped counters. A fake ``vllm serve`` process (vLLM's counter names, made with prometheus_client, three
   requests finished per scrape) on a simulated GPU; an agent in this process finds it by its command line,
   scrapes it 6 times 0.4 s apart and ticks right after each scrape; a real collector (in this process)
   stores it all. Figure: the report's J/query (``query_method: counts``). Truth: the simulator's exact
   energy between the first and last window edge, over the 18 requests counted.

Run: ``python benchmarks/checks.py [--runs 3] [--train-s 3]`` (about 20 s per run on a 2-core machine:
a minute at the defaults). The table gives min to max over runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sim import SimulatedFleet
from mdtable import command, paragraph, table
from realprocs import WATTWATCH, BenchError, clean_env, free_port, wait_for

from wattwatch.accounting.attribution import split_interval
from wattwatch.agent.options import AgentOptions
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.runner import Agent
from wattwatch.agent.scrape import parse_target
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sensors.nvml import NvmlSensor
from wattwatch.standalone import Collector
from wattwatch.storage.engine import make_engine
from wattwatch.storage.reads import build_report


@dataclass
class Check:
    """One row: a figure and its truth per run, and how to show them."""

    label: str
    digits: int  # decimals of the figure and its truth
    unit: str  # after the figure: " J", "%"
    points: bool = False  # the error is a difference in percentage points, not a relative error
    measured: list[float] = field(default_factory=list)
    exact: list[float] = field(default_factory=list)

    def add(self, measured: float, exact: float) -> None:
        """One run's figure and truth; both must be finite, the truth positive."""
        if not (math.isfinite(measured) and math.isfinite(exact) and exact > 0):
            raise BenchError(f"{self.label}: measured {measured}, exact {exact}")
        self.measured.append(measured)
        self.exact.append(exact)

    def cells(self) -> list[str]:
        """Exact, measured and error, each min to max over runs."""
        pairs = list(zip(self.measured, self.exact, strict=True))
        if self.points:
            error = spread([f"{100 * (m - x):+.2f}" for m, x in sorted(pairs, key=lambda p: p[0] - p[1])], " points")
        else:
            error = spread([f"{m / x - 1:+.3%}" for m, x in sorted(pairs, key=lambda p: p[0] / p[1])], "")
        scale = 100 if self.unit == "%" else 1
        exact = spread([f"{scale * x:.{self.digits}f}" for x in sorted(self.exact)], self.unit)
        measured = spread([f"{scale * m:.{self.digits}f}" for m in sorted(self.measured)], self.unit)
        return [exact, measured, error]


def spread(shown: list[str], unit: str) -> str:
    """``first to last`` of values already sorted and formatted, then the unit; one value when they read the
    same."""
    return (shown[0] if shown[0] == shown[-1] else f"{shown[0]} to {shown[-1]}") + unit


# -- 1. two jobs time-sharing one GPU -----------------------------------------------------------------

SLEEPER = "import time; time.sleep(60)"


def exact_share(fleet: SimulatedFleet, pid_a: int, pid_b: int, t0_s: float, t1_s: float) -> float:
    """A's exact share of the board's energy over [t0_s, t1_s]: the integral of power x uA / (uA + uB) on a
    1 ms grid (power is constant on the simulator's 10 ms slots; 1 ms resolves the utilisation changes)."""
    step_s = 0.001
    a_j = total_j = 0.0
    for k in range(math.ceil((t1_s - t0_s) / step_s)):
        lo = t0_s + k * step_s
        hi = min(lo + step_s, t1_s)
        energy_j = fleet.exact_energy_j(0, lo, hi)
        ua = fleet.process_utilization(0, pid_a, (lo + hi) / 2)
        ub = fleet.process_utilization(0, pid_b, (lo + hi) / 2)
        total_j += energy_j
        a_j += energy_j * ua / (ua + ub) if ua + ub > 0 else energy_j / 2
    return a_j / total_j


@contextlib.contextmanager
def quiet(*loggers: str) -> Iterator[None]:
    """Only errors from ``loggers`` meanwhile (the sharing check's agent has no collector on purpose)."""
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def sharing_once(tmp: Path) -> tuple[float, float]:
    """(measured, exact) share of the shared intervals' energy that went to the ``chat`` job."""
    with quiet("wattwatch.agent.push", "wattwatch.agent.push_cadence", "wattwatch.agent.runner"):
        return _sharing_once(tmp)


def _sharing_once(tmp: Path) -> tuple[float, float]:
    fleet = SimulatedFleet(1)
    sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
    settings = Settings(home=tmp, collector_url="http://127.0.0.1:9", interval_s=3600, host="h")
    agent = Agent(settings, [sensor], gpu_processes=sensor, serve_socket=False, procfs=ProcFs())
    children = [
        subprocess.Popen(
            [sys.executable, "-c", SLEEPER], env={**clean_env(tmp), "WATTWATCH_JOB": job, "WATTWATCH_KIND": kind}
        )
        for job, kind in (("chat", "inference"), ("ft", "training"))
    ]
    serve, train = children
    agent.start()
    try:
        t0 = fleet.clock()
        fleet.set_activity(0, "training", t0)
        fleet.set_process_utilization(0, serve.pid, 25.0, t0)
        fleet.set_process_utilization(0, train.pid, 70.0, t0)
        if not agent.tick() or {j["id"] for j in agent.jobs()} != {"chat", "ft"}:
            raise BenchError(f"the agent did not find both jobs: {agent.jobs()}")
        for i in range(12):
            time.sleep(0.25)
            if i == 5:
                t_mid = fleet.clock() - 0.1  # inside the tick interval that is running
                fleet.set_process_utilization(0, serve.pid, 80.0, t_mid)
                fleet.set_process_utilization(0, train.pid, 15.0, t_mid)
            agent.tick()
    finally:
        agent.stop(flush_timeout_s=0.2)
        for child in children:
            child.kill()
            child.wait()
    spool = Spool(tmp / "spool.db")
    try:
        batches = [wire.decode_batch(body) for _, body in spool.peek(limit=10_000)]
    finally:
        spool.close()
    shared = [iv for b in batches for iv in b.intervals if iv.device == "gpu0" and len(iv.shares) == 2]
    if not shared:
        raise BenchError("no interval was shared by the two jobs")
    shared_j = sum(iv.energy_j for iv in shared)
    measured_j = sum(split_interval(iv.energy_j, iv.shares)[0]["chat"] for iv in shared)
    exact_j = sum(iv.energy_j * exact_share(fleet, serve.pid, train.pid, iv.t_start_s, iv.t_end_s) for iv in shared)
    return measured_j / shared_j, exact_j / shared_j


# -- 2. one run on two hosts ----------------------------------------------------------------------------

HOSTS = ("node-a", "node-b")
RUN = "llama-70b-run-7"


def host_truth_j(home: Path, n_gpus: int) -> float:
    """The exact energy of the boards this host's run held, between the instants the run started and ended
    on them (the simulator logs both: the agent set the boards' activity at the job's boundaries)."""
    log = home / "simulated-gpus.jsonl"
    fleet = SimulatedFleet.replay(log, n_gpus)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    total_j = 0.0
    for index in range(n_gpus):
        changes = [r for r in records if r.get("index") == index]
        starts = [r["t_s"] for r in changes if r.get("kind") == "training"]
        ends = [r["t_s"] for r in changes if r.get("kind") == "idle"]
        if not (starts and ends):
            raise BenchError(f"{home.name}: gpu{index} never ran the job")
        total_j += fleet.exact_energy_j(index, starts[0], ends[-1])
    return total_j


def agent_ready(agent: subprocess.Popen[bytes], home: Path) -> bool:
    """The agent is running and its socket is up."""
    if agent.poll() is not None:
        raise BenchError(f"an agent exited {agent.returncode}")
    return (home / "agent.sock").exists()


def two_hosts_once(tmp: Path, train_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """(measured, exact) joules per host and for the whole job (key ``run``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []

    def start(cmd: list[str], home: Path, log: str) -> subprocess.Popen[bytes]:
        with (tmp / log).open("wb") as sink:
            proc = subprocess.Popen(cmd, env=clean_env(home), stdout=sink, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    try:
        collector = start(
            [
                *WATTWATCH,
                "collector",
                "--db",
                f"sqlite:///{tmp / 'central.db'}",
                "--migrate",
                "--open",
                "--listen",
                f"127.0.0.1:{port}",
            ],
            tmp / "collector",
            "collector.log",
        )

        def collector_ready() -> bool:
            if collector.poll() is not None:
                raise BenchError(f"the collector exited:\n{(tmp / 'collector.log').read_text()}")
            try:
                return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(collector_ready, 60, "the collector")
        agents = {
            host: start(
                [*WATTWATCH, "agent", "--simulate", "2", "--host", host, "--collector", url, "--interval", "0.5"],
                tmp / host,
                f"{host}.log",
            )
            for host in HOSTS
        }
        for host, agent in agents.items():
            wait_for(partial(agent_ready, agent, tmp / host), 60, f"{host}'s agent")
        sleep_cmd = [sys.executable, "-c", f"import time; time.sleep({train_s})"]
        runs = [
            subprocess.Popen(
                [*WATTWATCH, "run", "--kind", "training", "--name", "llama-70b", "--", *sleep_cmd],
                env={**clean_env(tmp / host), "WATTWATCH_JOB": RUN, "CUDA_VISIBLE_DEVICES": "0,1"},
            )
            for host in HOSTS
        ]
        if [r.wait(timeout=60 + train_s) for r in runs] != [0, 0]:
            raise BenchError("wattwatch run failed")
        for host, agent in agents.items():
            agent.send_signal(signal.SIGTERM)  # stopping pushes the last intervals
            if agent.wait(timeout=60) != 0:
                raise BenchError(f"{host}'s agent exited {agent.returncode}:\n{(tmp / f'{host}.log').read_text()}")
        report = httpx.get(f"{url}/api/v1/report", params={"job": RUN}, timeout=30).json()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    jobs = [j for j in report["jobs"] if j["id"] == RUN]
    if len(jobs) != 1 or jobs[0]["hosts"] != list(HOSTS):
        raise BenchError(f"expected one job on {HOSTS}: {report}")
    measured = {h["host"]: float(h["energy_j"]) for h in jobs[0]["per_host"]}
    exact = {host: host_truth_j(tmp / host, 2) for host in HOSTS}
    measured["run"], exact["run"] = float(jobs[0]["energy_j"]), sum(exact.values())
    return measured, exact


# -- 3. a vLLM server's scraped counters ------------------------------------------------------------------

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
        # Every scrape finds three more finished requests: the benchmark knows exactly what was served.
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
SCRAPES = 6
PER_SCRAPE = 3


def listening(port: int) -> bool:
    """Something accepts connections on 127.0.0.1:port."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def scrape_once(tmp: Path) -> tuple[float, float]:
    """(measured, exact) J/query of a vLLM server known only by its counters."""
    port, col_port = free_port(), free_port()
    script = tmp / "vllm"  # its command line reads "python .../vllm serve fake-model"
    script.write_text(FAKE_VLLM)
    server = subprocess.Popen([sys.executable, str(script), "serve", "fake-model", "--port", str(port)])
    collector_settings = Settings(home=tmp / "collector", listen=f"127.0.0.1:{col_port}")
    collector = Collector(collector_settings, migrate=True, open_local=True)
    collector.start()
    try:
        wait_for(lambda: server.poll() is None and listening(port), 30, "the fake vLLM server")
        fleet = SimulatedFleet(1)
        sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
        settings = Settings(home=tmp / "agent", collector_url=collector.url, interval_s=3600, host="gpu-1")
        options = AgentOptions(scrape=(parse_target(f"vllm:http://127.0.0.1:{port}/metrics"),))
        agent = Agent(settings, [sensor], gpu_processes=sensor, serve_socket=False, procfs=ProcFs(), options=options)
        agent.start()
        try:
            if agent.scraper is None:
                raise BenchError("the agent has no scraper")
            fleet.set_activity(0, "inference", fleet.clock(), pid=server.pid)
            agent.tick()
            jobs = agent.jobs()
            if len(jobs) != 1 or jobs[0]["discovered_by"] != "heuristic:vllm":
                raise BenchError(f"the agent did not find the vLLM server: {jobs}")
            agent.scraper.scrape_once()  # the baseline
            agent.tick()
            first_s = agent.sampler.last_t_s
            counted = 0
            for _ in range(SCRAPES):
                time.sleep(0.4)
                counted += sum(c.queries for c in agent.scraper.scrape_once())
                agent.tick()  # right after the scrape: the window's edges are readings
            last_s = agent.sampler.last_t_s
            fleet.set_activity(0, "idle", fleet.clock(), pid=server.pid)
            agent.tick()
        finally:
            agent.stop(flush_timeout_s=5.0)
    finally:
        server.kill()
        server.wait()
        collector.stop()
    if counted != SCRAPES * PER_SCRAPE:
        raise BenchError(f"scraped {counted} queries, the server finished {SCRAPES * PER_SCRAPE}")
    engine = make_engine(collector_settings.resolved_db_url)
    try:
        report = build_report(engine, job_id=jobs[0]["id"])
    finally:
        engine.dispose()
    (entry,) = report["jobs"]
    if (entry["query_method"], entry["queries"]) != ("counts", counted):
        raise BenchError(f"the report counted {entry['queries']} queries by {entry['query_method']}")
    return float(entry["energy_per_query_j"]), fleet.exact_energy_j(0, first_s, last_s) / counted


# -- running and printing ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks ``--runs`` times and print the table under the command that produced it."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of every check (the table gives min to max)")
    ap.add_argument("--train-s", type=float, default=3.0, help="length of the run on two hosts")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.runs < 1 or args.train_s <= 0:
        ap.error("--runs must be at least 1 and --train-s positive")
    share = Check("two jobs time-sharing one GPU: one job's share of the shared energy", 2, "%", points=True)
    hosts = {
        "node-a": Check("one run on two hosts (two agents, one collector): node-a", 1, " J"),
        "node-b": Check("node-b", 1, " J"),
        "run": Check("the run: one job, both hosts", 1, " J"),
    }
    vllm = Check(f"a vLLM server's scraped counters ({SCRAPES * PER_SCRAPE} queries)", 2, " J/query")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_dir:
        for k in range(args.runs):
            tmp = Path(tmp_dir) / f"run{k}"
            for part in ("sharing", "hosts", "vllm"):
                (tmp / part).mkdir(parents=True)
            share.add(*sharing_once(tmp / "sharing"))
            measured, exact = two_hosts_once(tmp / "hosts", args.train_s)
            for key, check in hosts.items():
                check.add(measured[key], exact[key])
            vllm.add(*scrape_once(tmp / "vllm"))
    rows = [[c.label, *c.cells()] for c in (share, *hosts.values(), vllm)]
    runs = f"{args.runs} run{'s' if args.runs > 1 else ''}"
    print(command("checks.py", argv))
    print(
        paragraph(
            f"**Other checks** (real processes, simulated GPUs; {runs}, min to max), each against a truth computed"
            " by the simulator from its exact power, not by wattwatch's accounting: the share against the"
            " simulator's power-weighted utilisation ratio over each interval; each host against the exact energy"
            " of its boards between the run's start and end there; J/query against the exact energy between the"
            " first and last scrape's tick over the requests the server finished:"
        )
    )
    print(table(("check", "exact", "measured", "error"), rows))
    print(f"checks.py: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BenchError as exc:
        raise SystemExit(f"checks.py: {exc}") from None
