"""The agent's parts against a scripted sensor (the hardware boundary) and real sockets/threads."""

from __future__ import annotations

import logging
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import wattwatch
from wattwatch.agent.jobs import ActiveJob, CpuTimeMeter, JobRegistry
from wattwatch.agent.runner import Agent, tick_interval_s
from wattwatch.agent.sampler import Sampler
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sdk import AgentClient
from wattwatch.sensors.base import DeviceInfo, EnergyReading
from wattwatch.sensors.rapl import RaplSensor
from wattwatch.sim.clock import FakeClock


class LinearSensor:
    """A device drawing a constant ``power_w``: cumulative energy is power x time, exactly."""

    name = "linear"

    def __init__(self, power_w: dict[str, float], clock: Callable[[], float]) -> None:
        self.power_w = power_w
        self.clock = clock
        self.reads = 0
        self.fail = False
        # Counters count from "driver load", not from 1970: keeps doubles precise to well under a µJ.
        self.origin_s = clock() - 1000.0

    def devices(self) -> Sequence[DeviceInfo]:
        return [
            DeviceInfo(key=k, kind="gpu" if k.startswith("gpu") else "cpu", index=i) for i, k in enumerate(self.power_w)
        ]

    def _at(self, t_s: float) -> list[EnergyReading]:
        if self.fail:
            raise RuntimeError("sensor broke")
        self.reads += 1
        return [
            EnergyReading(device=k, t_s=t_s, energy_j=p * (t_s - self.origin_s), source="counter")
            for k, p in self.power_w.items()
        ]

    def read(self) -> list[EnergyReading]:
        return self._at(self.clock())

    def read_at(self, t_s: float) -> list[EnergyReading]:
        return self._at(t_s)

    def close(self) -> None:
        pass


def no_jobs(device: DeviceInfo, t_start_s: float, t_end_s: float) -> tuple[dict[str, float], float]:
    return {}, 0.0


def test_sampler_intervals_are_contiguous_and_carry_shares() -> None:
    clock = FakeClock(1000.0)
    sampler = Sampler([LinearSensor({"gpu0": 100.0, "gpu1": 50.0}, clock)])
    assert sampler.sample(no_jobs) == []  # the first reading is the baseline
    clock.t_s += 1.0
    first = sampler.sample(lambda d, t0, t1: ({"job-a": 1.0}, 0.0) if d.key == "gpu0" else ({}, 0.0))
    clock.t_s += 0.5
    second = sampler.sample(no_jobs, at_s=clock.t_s - 0.25)  # a boundary just past
    by_dev = {iv.device: iv for iv in first}
    assert by_dev["gpu0"].energy_j == pytest.approx(100.0)
    assert by_dev["gpu0"].shares == {"job-a": 1.0}
    assert by_dev["gpu1"].shares == {}
    assert {iv.device: iv.t_start_s for iv in second} == {"gpu0": 1001.0, "gpu1": 1001.0}
    assert {iv.device: iv.energy_j for iv in second} == pytest.approx({"gpu0": 25.0, "gpu1": 12.5})


class WaitingSensor(LinearSensor):
    """Reads its devices one after another, waiting before each next one as long as ``waits_s`` says for
    this read (as the NVML sensor does when one board's counter is about to refresh): each reading carries
    the time it was taken."""

    def __init__(self, power_w: dict[str, float], clock: FakeClock, waits_s: list[float]) -> None:
        super().__init__(power_w, clock)
        self.fake_clock = clock
        self.waits_s = waits_s

    def read(self) -> list[EnergyReading]:
        wait_s = self.waits_s[self.reads % len(self.waits_s)]
        self.reads += 1
        out = []
        for k, p in self.power_w.items():
            t_s = self.fake_clock.t_s
            out.append(EnergyReading(device=k, t_s=t_s, energy_j=p * (t_s - self.origin_s), source="counter"))
            self.fake_clock.t_s += wait_s
        return out


def test_sampler_carries_a_reading_taken_before_its_samples_stamp_to_the_stamp() -> None:
    power_w = {"gpu0": 600.0, "gpu1": 300.0, "gpu2": 100.0}
    clock = FakeClock(1000.0)
    sampler = Sampler([WaitingSensor(power_w, clock, [0.03, 0.0002, 0.01])])
    sampler.sample(no_jobs)
    intervals = []
    for _ in range(6):
        clock.t_s += 1.0
        intervals += sampler.sample(no_jobs)
    assert len({iv.t_end_s for iv in intervals}) == 6  # one stamp per sample: a job's devices add up per tick
    # Every interval holds the energy of its own span: gpu0, read 60 ms before the sample's last reading,
    # would otherwise carry 36 J into the next tick, and back.
    for iv in intervals:
        assert iv.energy_j == pytest.approx(power_w[iv.device] * (iv.t_end_s - iv.t_start_s), rel=1e-9)


def test_sampler_moves_a_late_boundary_onto_the_last_reading_and_survives_a_broken_sensor() -> None:
    clock = FakeClock(1000.0)
    good = LinearSensor({"gpu0": 100.0}, clock)
    bad = LinearSensor({"cpu0": 10.0}, clock)
    sampler = Sampler([good, bad])
    sampler.sample(no_jobs)
    clock.t_s += 1.0
    sampler.sample(no_jobs)
    late = sampler.sample(no_jobs, at_s=clock.t_s - 0.5)  # earlier than the last reading
    assert late == []  # no negative-length interval, no energy invented
    bad.fail = True
    clock.t_s += 1.0
    intervals = sampler.sample(no_jobs)
    assert [iv.device for iv in intervals] == ["gpu0"]


def test_registry_refcounts_a_job_joined_twice_and_splits_gpu_equally() -> None:
    reg = JobRegistry()
    reg.start(ActiveJob("a", "a", "training", 1.0, devices=frozenset({"gpu0"})))
    reg.start(ActiveJob("a", "a", "training", 2.0, devices=frozenset({"gpu1"})))
    reg.start(ActiveJob("b", "b", "inference", 2.0, devices=frozenset({"gpu1"})))
    assert sorted(reg.holders()["gpu1"]) == ["a", "b"]
    assert reg.end("a") is None  # one reference left
    ended = reg.end("a")
    assert ended is not None and ended.devices == frozenset({"gpu0", "gpu1"})
    assert reg.holders() == {"gpu1": ["b"]}


def test_cpu_meter_gives_jobs_their_cpu_seconds_and_the_rest_to_idle() -> None:
    used = {1: 0.0, 2: 0.0}
    meter = CpuTimeMeter(cpu_count=4, cpu_times=lambda pid: used[pid])
    jobs = [ActiveJob("a", "a", "training", 0, pids={1}), ActiveJob("b", "b", "training", 0, pids={2})]
    assert meter.shares(jobs, 1.0) == ({}, 4.0)  # first sight: no delta yet
    used[1], used[2] = 1.5, 0.5
    shares, idle = meter.shares(jobs, 1.0)
    assert shares == {"a": 1.5, "b": 0.5}
    assert idle == pytest.approx(2.0)


def test_spool_survives_reopen_and_never_reuses_a_seq(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    seqs = [spool.next_seq() for _ in range(3)]
    for seq in seqs:
        spool.put(seq, f"body{seq}".encode(), 1.0)
    spool.ack(seqs[0])
    assert spool.set_aside(seqs[1], {"reason": "rejected", "status": 422})
    spool.close()
    again = Spool(tmp_path / "spool.db")
    assert again.peek() == [(seqs[2], f"body{seqs[2]}".encode())]
    assert again.dead() == 1
    assert again.next_seq() == seqs[-1] + 1


def make_agent(tmp_path: Path, clock: Callable[[], float] = time.time) -> tuple[Agent, LinearSensor]:
    sensor = LinearSensor({"gpu0": 300.0, "gpu1": 200.0}, clock)
    settings = replace(Settings(home=tmp_path), collector_url="http://127.0.0.1:9", interval_s=0.2)
    agent = Agent(settings, [sensor], resolve_visible=lambda spec, devs: [f"gpu{i}" for i in spec.split(",")])
    return agent, sensor


def drain(agent: Agent) -> list[wire.Batch]:
    agent.seal()
    return [wire.decode_batch(body) for _, body in agent.spool.peek(limit=1000)]


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_sdk_job_and_queries_reach_the_agent_and_boundaries_are_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    agent, _ = make_agent(tmp_path)
    agent.start()
    try:
        client = AgentClient(agent.settings.socket_path)
        with (
            wattwatch.job("ft", kind="training", job_id="run-1", client=client) as jid,
            wattwatch.query(tokens_in=3, tokens_out=4, client=client),
        ):
            pass
        assert jid == "run-1"
        wait_for(lambda: agent.registry.get("run-1") is None)
        wait_for(lambda: agent._events.empty())
    finally:
        agent.stop(flush_timeout_s=0.5)
    batches = [wire.decode_batch(b) for _, b in Spool(tmp_path / "spool.db").peek(limit=1000)]
    jobs = [j for b in batches for j in b.jobs]
    assert [j.ended_at_s is None for j in jobs] == [True, False]
    start_s, end_s = jobs[0].started_at_s, jobs[1].ended_at_s
    assert end_s is not None
    # No CUDA_VISIBLE_DEVICES in this process: the job holds no GPU, so GPU energy in its span is idle.
    held = sum(iv.energy_j for b in batches for iv in b.intervals if "run-1" in iv.shares and iv.device == "gpu0")
    assert held == 0.0
    queries = [q for b in batches for q in b.queries]
    assert [(q.job, q.tokens_in, q.tokens_out) for q in queries] == [("run-1", 3, 4)]
    assert start_s <= queries[0].t_start_s <= queries[0].t_end_s <= end_s


def test_job_energy_comes_from_boundary_reads_not_ticks(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    agent.start()
    try:
        reply = agent.handle(
            {"op": "job_start", "id": "j", "name": "j", "kind": "training", "cuda_visible_devices": "0"}
        )
        time.sleep(0.05)
        end = agent.handle({"op": "job_end", "id": "j"})
        wait_for(lambda: agent.registry.get("j") is None)
        wait_for(lambda: agent._events.empty())
        batches = drain(agent)
    finally:
        agent.stop(flush_timeout_s=0.5)
    energy_j = sum(iv.energy_j for b in batches for iv in b.intervals if "j" in iv.shares)
    assert energy_j == pytest.approx(300.0 * (end["t_s"] - reply["t_s"]), rel=1e-6)


def test_local_api_errors_are_replies_not_crashes(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    agent.start()
    try:
        client = AgentClient(agent.settings.socket_path)
        bad_kind = client.request({"op": "job_start", "name": "x", "kind": "gaming"})
        assert bad_kind["ok"] is False and "kind" in bad_kind["error"]
        bad_id = client.request({"op": "job_start", "id": "has space", "name": "x"})
        assert bad_id["ok"] is False and "job id" in bad_id["error"]
        assert client.request({"op": "nope"})["ok"] is False
        assert client.request({"op": "ping"})["ok"] is True
    finally:
        agent.stop(flush_timeout_s=0.5)


def test_second_agent_on_the_same_socket_is_refused(tmp_path: Path) -> None:
    from wattwatch.errors import ConfigError

    agent, _ = make_agent(tmp_path)
    agent.start()
    try:
        other, _ = make_agent(tmp_path)
        with pytest.raises(ConfigError, match="already listens"):
            other._api.start()  # type: ignore[union-attr]
    finally:
        agent.stop(flush_timeout_s=0.5)


def test_sdk_is_a_noop_with_one_warning_when_no_agent(tmp_path: Path) -> None:
    from wattwatch.sdk import notices

    notices._warned = False
    client = AgentClient(tmp_path / "nothing.sock")
    ran = threading.Event()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        with wattwatch.job("x", client=client), wattwatch.query(client=client):
            ran.set()
        assert time.monotonic() - t0 < 1.0
    assert ran.is_set()
    assert len([w for w in caught if "no agent reachable" in str(w.message)]) == 1


class CountingAgent(Agent):
    """Records the ops the local API delivers (to see the SDK batch its spans)."""

    ops: list[str]

    def handle(self, msg: dict[str, object]) -> dict[str, object]:
        self.ops = [*getattr(self, "ops", []), str(msg.get("op"))]
        return super().handle(msg)


def test_queries_op_keeps_good_spans_and_names_the_bad_ones(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    now = time.time()
    reply = agent.handle(
        {
            "op": "queries",
            "spans": [
                {"job": "chat", "t_start_s": now - 1, "t_end_s": now, "tokens_in": 5, "tokens_out": 7},
                {"job": "chat", "t_start_s": now, "t_end_s": now - 1},
                {"job": "ft", "t_start_s": now - 2, "t_end_s": now, "kind": "step"},
                {"job": "ft", "t_start_s": now - 2, "t_end_s": now, "kind": "batch"},
                "not a span",
            ],
        }
    )
    assert (reply["ok"], reply["accepted"], reply["rejected"]) == (False, 2, 3)
    assert "spans[1]" in reply["error"] and "spans[3]" in reply["error"] and "spans[4]" in reply["error"]
    batches = drain(agent)
    agent.spool.close()
    assert [(q.job, q.kind, q.tokens_in, q.tokens_out) for b in batches for q in b.queries] == [
        ("chat", "query", 5, 7),
        ("ft", "step", 0, 0),
    ]


def test_sdk_batches_spans_without_blocking_and_flushes_them_before_the_job_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sensor = LinearSensor({"gpu0": 300.0}, time.time)
    settings = replace(Settings(home=tmp_path), collector_url="http://127.0.0.1:9", interval_s=3600)
    agent = CountingAgent(settings, [sensor])
    agent.start()
    try:
        client = AgentClient(agent.settings.socket_path)
        with wattwatch.job("serve", kind="inference", job_id="srv", client=client):
            t0 = time.perf_counter()
            for i in range(2000):
                with wattwatch.sdk.query(tokens_in=i, tokens_out=1, client=client):
                    pass
            spent_s = time.perf_counter() - t0
            with wattwatch.sdk.epoch(client=client), wattwatch.sdk.step(tokens=64, client=client) as s:
                s["tokens_in"] += 1
        wait_for(lambda: agent.registry.get("srv") is None)
    finally:
        agent.stop(flush_timeout_s=0.5)
    print(f"\n2000 query spans recorded in {spent_s * 1e3:.1f} ms ({spent_s / 2000 * 1e6:.1f} us each)")
    assert spent_s < 1.0  # the workload's thread only appends to a buffer
    batches = [wire.decode_batch(b) for _, b in Spool(tmp_path / "spool.db").peek(limit=1000)]
    spans = [q for b in batches for q in b.queries]
    assert len([q for q in spans if q.kind == "query"]) == 2000
    assert sum(q.tokens_in for q in spans if q.kind == "query") == sum(range(2000))
    assert [(q.kind, q.tokens_in) for q in spans if q.kind != "query"] == [("step", 65), ("epoch", 0)]
    # Far fewer messages than spans, and all of them before the job's end.
    assert agent.ops.count("queries") < 100
    assert agent.ops.index("job_end") > max(i for i, op in enumerate(agent.ops) if op == "queries")


def test_span_buffer_keeps_spans_while_the_agent_is_away_and_delivers_them_later(tmp_path: Path) -> None:
    import wattwatch.sdk as sdk
    from wattwatch.sdk import notices

    notices._warned = True  # this test is about delivery, not the warning
    client = AgentClient(tmp_path / "agent.sock")
    now = time.time()
    for _ in range(10):
        sdk.record_span("query", now - 0.5, now, job_id="late", client=client)
    wait_for(lambda: client.spans.failed_sends >= 1 and client.spans.pending() == 10)  # kept while sends fail
    agent, _ = make_agent(tmp_path)
    agent.start()
    try:
        wait_for(lambda: client.spans.pending() == 0, timeout_s=15.0)
        wait_for(lambda: agent.outbox._queries != [])
        batches = drain(agent)
    finally:
        agent.stop(flush_timeout_s=0.2)
        client.close()
    assert len([q for b in batches for q in b.queries if q.job == "late"]) == 10


def test_record_span_never_raises_into_the_workload(tmp_path: Path) -> None:
    import wattwatch.sdk as sdk
    from wattwatch.sdk import notices

    notices._warned = False
    notices._refused.clear()  # the first refusal of a reason warns
    client = AgentClient(tmp_path / "nothing.sock")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sdk.record_span("query", 1.0, 2.0, tokens_in="many", job_id="j", client=client)  # type: ignore[arg-type]
    assert any("span was dropped" in str(w.message) for w in caught)  # limits.check_span refused it


def test_cpu_meter_reads_job_trees_from_proc(tmp_path: Path) -> None:
    from wattwatch.agent.procfs import ProcFs

    fixtures = Path(__file__).parent / "fixtures" / "proc"
    meter = CpuTimeMeter(cpu_count=8, procfs=ProcFs(fixtures, clock_ticks_per_s=100))
    job = ActiveJob("slurm", "slurm", "training", 0, pids={4200})
    assert meter.shares([job], 1.0) == ({}, 8.0)
    # torchrun (4200) and its rank (4242): own time plus reaped children's, from the fixture stat files.
    assert meter._job_cpu_s(job) == pytest.approx((500 + 100) / 100 + (9000 + 1200 + 300 + 40) / 100)


def test_the_tick_is_clamped_to_the_rapl_wrap_limit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from test_rapl import FIXTURE, small_range_package

    root = tmp_path / "powercap"
    shutil.copytree(FIXTURE, root)
    # 100 J at 250 W: package 0 wraps every 0.4 s, so it must be read every 0.2 s, not every 60 s.
    small_range_package(root, 100_000_000, max_power_w=250.0)
    rapl = RaplSensor(root)
    settings = replace(Settings(home=tmp_path), collector_url="http://127.0.0.1:9", interval_s=60.0)
    with caplog.at_level(logging.INFO, logger="wattwatch.agent.runner"):
        agent = Agent(settings, [rapl], serve_socket=False)
    assert agent.interval_s == pytest.approx(0.2)
    assert [r.getMessage() for r in caplog.records] == [
        "rapl cpu0 wraps every 0.4 s at full power; ticking every 0.2 s instead of every 60 s"
    ]
    assert tick_interval_s(0.1, [rapl]) == 0.1  # already often enough
    agent.start()
    try:

        def ticks() -> list[float]:
            return [iv.t_end_s - iv.t_start_s for b in drain(agent) for iv in b.intervals if iv.device == "cpu0"]

        wait_for(lambda: len(ticks()) >= 3)
        assert max(ticks()[:3]) < 0.5, ticks()
    finally:
        agent.stop(flush_timeout_s=0.2)


def test_queries_on_worker_threads_belong_to_the_job_the_main_thread_opened(tmp_path: Path) -> None:
    from wattwatch.sdk import jobs as sdk_jobs

    agent, _ = make_agent(tmp_path)
    agent.start()
    try:
        client = AgentClient(agent.settings.socket_path)
        done: list[str] = []

        def handle_request() -> None:
            with wattwatch.query(tokens_in=1, tokens_out=2, client=client):
                done.append("served")

        with wattwatch.job("srv", kind="inference", job_id="srv-1", client=client):
            worker = threading.Thread(target=handle_request)  # starts with an empty context
            worker.start()
            worker.join(timeout=10)
        assert done == ["served"]
        assert sdk_jobs._open_jobs == []
        wait_for(lambda: agent.registry.get("srv-1") is None)
        batches = drain(agent)
    finally:
        agent.stop(flush_timeout_s=0.5)
    assert [(q.job, q.tokens_out) for b in batches for q in b.queries] == [("srv-1", 2)]


def test_job_start_pid_is_the_socket_peer(tmp_path: Path) -> None:
    # A client in a container sends its pid in its own namespace; the kernel's view of the peer wins.
    import subprocess
    import sys

    from wattwatch.agent.local_api import LocalApi

    seen: list[dict[str, Any]] = []
    api = LocalApi(tmp_path / "agent.sock", lambda msg: (seen.append(dict(msg)), {"ok": True})[1])
    api.start()
    try:
        code = (
            "import json, os, socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "for m in ({'op': 'job_start', 'id': 'a', 'name': 'a', 'pid': 1}, {'op': 'job_start', 'id': 'b'}):\n"
            "    s.sendall(json.dumps(m).encode() + b'\\n'); s.makefile().readline()\n"
            "print(os.getpid())\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "agent.sock")], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
    finally:
        api.stop()
    assert seen[0]["pid"] == int(done.stdout) != 1
    assert "pid" not in seen[1]  # no pid sent (a Slurm prolog's socat): none is made up
