"""Agent restarts (``agent.restore``): the checkpoint, bridging a gap by the counter's delta, re-adopting
jobs by pid and start time, and the collector ending the jobs of a silent agent (injectable clock)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import Engine, select

from wattwatch.agent.options import AgentOptions
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.restore import BRIDGED, GAP, Checkpoint, DeviceMark, JobMark, adopt, bridge
from wattwatch.agent.runner import Agent
from wattwatch.agent.spool import Spool
from wattwatch.collector.silent_scheduler import SilentHostScheduler
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sensors.base import DeviceInfo, EnergyReading
from wattwatch.sensors.nvml import NvmlSensor
from wattwatch.sensors.rapl import RaplSensor
from wattwatch.sim.clock import FakeClock
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.storage.repository import build_report, end_job, ingest_batch, upsert_job
from wattwatch.storage.tables import jobs

T0 = 1_700_000_000.0


def write_proc(root: Path, pid: int, start_ticks: int) -> None:
    """A /proc/PID/stat a ProcFs can read: a process started ``start_ticks`` after boot."""
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    fields = " ".join(["S", "1", *["0"] * 9, "0", "0", "0", "0", *["0"] * 4, str(start_ticks), "0"])
    (root / str(pid) / "stat").write_text(f"{pid} (python) {fields}\n")


def write_boot_id(root: Path, boot_id: str) -> None:
    path = root / "sys" / "kernel" / "random" / "boot_id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot_id + "\n")


# -- bridging ---------------------------------------------------------------------------------------


def mark(t_s: float, counter_j: float | None, **kw: object) -> DeviceMark:
    return DeviceMark(key="gpu0", t_s=t_s, energy_j=0.0, source="counter", uuid="GPU-a", counter_j=counter_j, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("before", "after", "same_boot", "expected_j", "why"),
    [
        (mark(T0, 5000.0, power_limit_w=700.0), mark(T0 + 10, 8000.0), True, 3000.0, ""),
        # RAPL: wrapped once in a gap shorter than its poll limit.
        (mark(T0, 90.0, wrap_j=100.0, max_gap_s=30.0), mark(T0 + 10, 40.0), True, 50.0, ""),
        (mark(T0, 90.0, wrap_j=100.0, max_gap_s=30.0), mark(T0 + 40, 40.0), True, 0.0, "wrapped twice"),
        (mark(T0, 5000.0), mark(T0 + 10, 100.0), True, 0.0, "went back"),
        (mark(T0, 5000.0), replace(mark(T0 + 10, 8000.0), uuid="GPU-b"), True, 0.0, "another device"),
        (mark(T0, 5000.0), mark(T0 + 10, 8000.0), False, 0.0, "rebooted"),
        (mark(T0, None), mark(T0 + 10, None), True, 0.0, "no energy counter"),
        (mark(T0, 5000.0, power_limit_w=700.0), mark(T0 + 10, 50000.0), True, 0.0, "not possible"),
        (mark(T0, 5000.0), mark(T0 + 7200, 8000.0), True, 0.0, "longer than"),
    ],
)
def test_a_gap_is_bridged_only_when_the_counter_is_continuous(
    before: DeviceMark, after: DeviceMark, same_boot: bool, expected_j: float, why: str
) -> None:
    gap = bridge(before, after, same_boot=same_boot, max_gap_s=3600.0)
    assert gap is not None and (gap.t_start_s, gap.t_end_s) == (before.t_s, after.t_s)
    assert gap.energy_j == pytest.approx(expected_j)
    assert gap.flag == (GAP if why else BRIDGED)
    assert why in gap.why
    assert bridge(after, before, same_boot=True, max_gap_s=3600.0) is None  # no gap going backwards


def test_rapl_readings_carry_the_raw_counter_across_a_wrap(tmp_path: Path) -> None:
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "name").write_text("package-0\n")
    (zone / "max_energy_range_uj").write_text("100000000\n")  # 100 J
    (zone / "energy_uj").write_text("90000000\n")
    clock = FakeClock()
    sensor = RaplSensor(tmp_path, clock=clock)
    first = sensor.read()[0]
    assert first.counter_j == pytest.approx(90.0) and first.counter_wrap_j == pytest.approx(100.0)
    (zone / "energy_uj").write_text("5000000\n")  # wrapped: 15 J later
    clock.t_s += 1.0
    second = sensor.read()[0]
    assert second.energy_j - first.energy_j == pytest.approx(15.0)
    assert second.counter_j == pytest.approx(5.0)


def nvml_mark(sensor: NvmlSensor) -> DeviceMark:
    reading = sensor.read()[0]
    info = sensor.devices()[0]
    return DeviceMark(
        key=reading.device,
        t_s=reading.t_s,
        energy_j=reading.energy_j,
        source=reading.source,
        uuid=info.uuid,
        counter_j=reading.counter_j,
        power_limit_w=info.power_limit_w,
    )


def test_nvml_counter_bridges_a_new_sensor_process_and_a_reset_is_a_gap() -> None:
    clock = FakeClock()
    fleet = SimulatedFleet(1, seed=4, clock=clock)
    fleet.set_activity(0, "training", T0 + 1.0, pid=10)
    clock.t_s = T0 + 30.0
    before = nvml_mark(NvmlSensor(fleet.module(), clock=clock, sleep=clock.sleep, power_sample_interval_s=None))
    clock.t_s += 10.0
    # A new sensor, as in a restarted agent: its own joules start from scratch, the counter does not.
    after = nvml_mark(NvmlSensor(fleet.module(), clock=clock, sleep=clock.sleep, power_sample_interval_s=None))
    gap = bridge(before, after, same_boot=True, max_gap_s=3600.0)
    assert gap is not None and gap.flag == BRIDGED
    exact_j = fleet.exact_energy_j(0, before.t_s, after.t_s)
    assert gap.energy_j == pytest.approx(exact_j, rel=1e-3)
    fleet.reset_counter(0, clock.t_s + 1.0)  # a driver reload while no agent runs
    clock.t_s += 10.0
    reset = nvml_mark(NvmlSensor(fleet.module(), clock=clock, sleep=clock.sleep, power_sample_interval_s=None))
    gap = bridge(after, reset, same_boot=True, max_gap_s=3600.0)
    assert gap is not None and gap.flag == GAP and "went back" in gap.why and gap.energy_j == 0.0


# -- re-adopting jobs ---------------------------------------------------------------------------------


def job_mark(job_id: str, pids: dict[int, int | None], refs: int = 1) -> JobMark:
    return JobMark(id=job_id, name=job_id, kind="training", started_at_s=T0, devices=["gpu0"], pids=pids, refs=refs)


def test_jobs_are_readopted_only_while_the_same_processes_run(tmp_path: Path) -> None:
    write_proc(tmp_path, 100, 5000)
    write_proc(tmp_path, 200, 7777)  # pid 200 was reused: the job's process started at 6000
    write_proc(tmp_path, 301, 4000)
    procfs = ProcFs(tmp_path, clock_ticks_per_s=100)
    marks = [
        job_mark("alive", {100: 5000}),
        job_mark("reused", {200: 6000}),
        job_mark("gone", {300: 1234}),
        job_mark("half", {300: 1234, 301: 4000}, refs=2),  # one of its two processes is left
        job_mark("unseen", {400: None}),  # the agent never saw the process: cannot tell, kept
        job_mark("no-pid", {}),
    ]
    result = adopt(marks, procfs, same_boot=True)
    assert sorted(j.id for j in result.readopt) == ["alive", "half", "no-pid", "unseen"]
    assert sorted(m.id for m in result.ended) == ["gone", "reused"]
    half = next(j for j in result.readopt if j.id == "half")
    assert half.pids == {301} and half.refs == 1 and half.started_at_s == T0
    assert result.watch == {"alive": {100: 5000}, "half": {301: 4000}}
    after_reboot = adopt(marks, procfs, same_boot=False)
    assert after_reboot.readopt == [] and len(after_reboot.ended) == len(marks)


def test_checkpoint_round_trips_and_rejects_what_it_cannot_read() -> None:
    cp = Checkpoint(T0, "boot-1", {"gpu0": mark(T0, 12.5, max_gap_s=None)}, [job_mark("a", {1: 2, 3: None})])
    assert Checkpoint.from_json(cp.to_json()) == cp
    assert Checkpoint.from_json("{") is None
    assert Checkpoint.from_json('{"version": 99}') is None


# -- the agent, restarted in-process -------------------------------------------------------------------


class CounterSensor:
    """Devices drawing constant power; GPUs have a counter that counts from "driver load" (``origin_s``),
    like NVML's, so a new instance (a new agent process) reads on where the old one left off."""

    name = "scripted"

    def __init__(self, power_w: dict[str, float], clock: Callable[[], float], origin_s: float) -> None:
        self.power_w = power_w
        self.clock = clock
        self.origin_s = origin_s

    def devices(self) -> Sequence[DeviceInfo]:
        return [
            DeviceInfo(
                key=k, kind="gpu" if k.startswith("gpu") else "cpu", index=i, uuid=f"GPU-{k}", power_limit_w=700.0
            )
            for i, k in enumerate(self.power_w)
        ]

    def _at(self, t_s: float) -> list[EnergyReading]:
        out = []
        for key, power_w in self.power_w.items():
            energy_j = power_w * (t_s - self.origin_s)
            counter_j = energy_j if key.startswith("gpu") else None  # the CPU is estimated: no counter
            out.append(EnergyReading(key, t_s, energy_j, "counter", counter_j=counter_j))
        return out

    def read(self) -> list[EnergyReading]:
        return self._at(self.clock())

    def read_at(self, t_s: float) -> list[EnergyReading]:
        return self._at(t_s)

    def close(self) -> None:
        pass


POWER_W = {"gpu0": 300.0, "gpu1": 200.0, "cpu0": 50.0}


class GatedSensor(CounterSensor):
    """A CounterSensor whose tick reads wait until ``gate`` is set (a slow read, held as long as a test needs)."""

    def __init__(self, power_w: dict[str, float], clock: Callable[[], float], origin_s: float) -> None:
        super().__init__(power_w, clock, origin_s)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()

    def read(self) -> list[EnergyReading]:
        self.waiting.set()
        assert self.gate.wait(10.0)
        return super().read()


def make_agent(home: Path, proc: Path, clock: FakeClock, sensor: CounterSensor | None = None) -> Agent:
    settings = dataclasses.replace(
        Settings(home=home), collector_url="http://127.0.0.1:9", interval_s=3600.0, push_interval_s=3600.0
    )
    sensor = sensor or CounterSensor(POWER_W, clock, origin_s=T0 - 1000.0)
    return Agent(
        settings,
        [sensor],
        resolve_visible=lambda spec, devs: [f"gpu{i}" for i in spec.split(",")],
        clock=clock,
        serve_socket=False,
        options=AgentOptions(discover=False, proc_root=proc, fine_interval_s=0.0),
        procfs=ProcFs(proc, clock_ticks_per_s=100),
    )


def crash(agent: Agent) -> None:
    """What kill -9 leaves: the spool as last sealed, nothing flushed, no job ended."""
    agent._scheduler.shutdown(wait=False)
    agent.spool.close()


def batches(home: Path) -> list[wire.Batch]:
    spool = Spool(home / "spool.db")
    try:
        return [wire.decode_batch(body) for _, body in spool.peek(limit=1000)]
    finally:
        spool.close()


def start_job(agent: Agent, job_id: str, pid: int, gpu: str) -> None:
    reply = agent.handle(
        {"op": "job_start", "id": job_id, "name": job_id, "kind": "training", "pid": pid, "cuda_visible_devices": gpu}
    )
    assert reply["ok"], reply


def test_a_restarted_agent_bridges_the_gap_readopts_and_ends_jobs(tmp_path: Path) -> None:
    home, proc, clock = tmp_path / "home", tmp_path / "proc", FakeClock()
    write_boot_id(proc, "boot-1")
    for pid, ticks in ((500, 100), (501, 200), (502, 300)):
        write_proc(proc, pid, ticks)
    first = make_agent(home, proc, clock)
    first.start()
    start_job(first, "train", 500, "0")
    start_job(first, "dies", 501, "1")
    start_job(first, "reused", 502, "1")
    clock.t_s += 2.0
    assert first.tick()
    first.seal()  # what the push job does every push interval
    last_seen_s = clock.t_s
    clock.t_s += 0.5
    assert first.tick()  # measured, but never sealed: lost with the crash, and bridged instead
    crash(first)

    # While no agent runs: one process ends, another pid is reused by a new process.
    (proc / "501" / "stat").unlink()
    (proc / "501").rmdir()
    write_proc(proc, 502, 999)
    clock.t_s = last_seen_s + 10.0
    second = make_agent(home, proc, clock)
    second.start()
    try:
        assert sorted(j.id for j in second.registry.snapshot()) == ["train"]
        after = batches(home)
        bridged = {iv.device: iv for b in after for iv in b.intervals if iv.flags in ([BRIDGED], [GAP])}
        assert set(bridged) == {"gpu0", "gpu1", "cpu0"}
        gpu0, gpu1, cpu0 = bridged["gpu0"], bridged["gpu1"], bridged["cpu0"]
        assert (gpu0.t_start_s, gpu0.t_end_s) == (last_seen_s, clock.t_s)
        assert gpu0.flags == [BRIDGED] and gpu0.energy_j == pytest.approx(300.0 * 10.0)
        assert gpu0.shares == {"train": 1.0}
        assert gpu1.flags == [BRIDGED] and gpu1.shares == {}  # its jobs ended when last seen: idle
        assert gpu1.energy_j == pytest.approx(200.0 * 10.0)
        assert cpu0.flags == [GAP] and cpu0.energy_j == 0.0  # no counter: no energy invented
        # Every joule the GPUs drew is in an interval exactly once: measured, then bridged.
        for key, power_w in (("gpu0", 300.0), ("gpu1", 200.0)):
            ivs = sorted((iv for b in after for iv in b.intervals if iv.device == key), key=lambda iv: iv.t_start_s)
            assert all(a.t_end_s == b.t_start_s for a, b in itertools.pairwise(ivs))
            assert math.fsum(iv.energy_j for iv in ivs) == pytest.approx(power_w * (ivs[-1].t_end_s - ivs[0].t_start_s))
        records = [j for b in after for j in b.jobs]
        ends = {j.id: j for j in records if j.ended_at_s is not None}
        assert {k: (j.ended_at_s, j.ended_by) for k, j in ends.items()} == {
            "dies": (last_seen_s, "agent-restart"),
            "reused": (last_seen_s, "agent-restart"),
        }
        reannounced = [j for j in records if j.id == "train" and j.ended_at_s is None]
        assert len(reannounced) == 2 and reannounced[-1].started_at_s == T0

        # The re-adopted job's process ends without telling the new agent: the next tick ends it.
        (proc / "500" / "stat").unlink()
        clock.t_s += 1.0
        assert second.tick()
        second.seal()
        end = [j for b in batches(home) for j in b.jobs if j.id == "train" and j.ended_at_s is not None]
        assert [(j.ended_at_s, j.ended_by) for j in end] == [(clock.t_s, "process-gone")]
    finally:
        second.stop(flush_timeout_s=0.2)


def test_a_readopted_job_that_says_it_ended_and_exits_during_a_slow_tick_ends_when_it_said(tmp_path: Path) -> None:
    """`wattwatch run` sends job_end and exits at once; a tick queued before that end and still reading
    sees the process gone. The job ends at its own end (ended_by None), not at the tick as process-gone."""
    home, proc, clock = tmp_path / "home", tmp_path / "proc", FakeClock()
    write_boot_id(proc, "boot-1")
    write_proc(proc, 500, 100)
    first = make_agent(home, proc, clock)
    first.start()
    start_job(first, "train", 500, "0")
    clock.t_s += 2.0
    assert first.tick()
    first.seal()
    crash(first)
    clock.t_s += 10.0
    sensor = GatedSensor(POWER_W, clock, origin_s=T0 - 1000.0)
    second = make_agent(home, proc, clock, sensor)
    second.start()
    try:
        assert [j.id for j in second.registry.snapshot()] == ["train"]  # re-adopted, its pid watched
        sensor.gate.clear()
        sensor.waiting.clear()
        assert not second.tick(wait_s=0.0)  # queued; the worker waits inside its read
        assert sensor.waiting.wait(5.0)
        clock.t_s += 0.5
        end_s = second.handle({"op": "job_end", "id": "train"})["t_s"]
        (proc / "500" / "stat").unlink()  # the process exits right after its job_end was answered
        sensor.gate.set()
        assert second.tick()  # behind the end: both are done
        second.seal()
        ends = [(j.ended_at_s, j.ended_by) for b in batches(home) for j in b.jobs if j.id == "train" and j.ended_at_s]
        assert ends == [(end_s, None)]
    finally:
        sensor.gate.set()
        second.stop(flush_timeout_s=0.2)


def test_after_a_reboot_nothing_is_bridged_or_readopted(tmp_path: Path) -> None:
    home, proc, clock = tmp_path / "home", tmp_path / "proc", FakeClock()
    write_boot_id(proc, "boot-1")
    write_proc(proc, 500, 100)
    first = make_agent(home, proc, clock)
    first.start()
    start_job(first, "train", 500, "0")
    clock.t_s += 2.0
    assert first.tick()
    first.seal()
    crash(first)
    write_boot_id(proc, "boot-2")  # same pid, same start ticks: a coincidence after a reboot
    clock.t_s += 60.0
    second = make_agent(home, proc, clock)
    second.start()
    try:
        assert second.registry.snapshot() == []
        after = [iv for b in batches(home) for iv in b.intervals if iv.flags]
        assert {iv.device: (iv.flags, iv.energy_j) for iv in after} == {
            "gpu0": ([GAP], 0.0),
            "gpu1": ([GAP], 0.0),
            "cpu0": ([GAP], 0.0),
        }
    finally:
        second.stop(flush_timeout_s=0.2)


def test_a_clean_stop_keeps_the_open_jobs_for_the_next_agent(tmp_path: Path) -> None:
    home, proc, clock = tmp_path / "home", tmp_path / "proc", FakeClock()
    write_boot_id(proc, "boot-1")
    write_proc(proc, 500, 100)
    first = make_agent(home, proc, clock)
    first.start()
    start_job(first, "train", 500, "0")
    clock.t_s += 2.0
    first.stop(flush_timeout_s=0.2)
    clock.t_s += 5.0
    second = make_agent(home, proc, clock)
    second.start()
    try:
        assert [j.id for j in second.registry.snapshot()] == ["train"]
        # An end the job's client sends to the new agent ends it the usual way, at a boundary read.
        assert second.job_end("train")["ok"]
        assert second.tick()
    finally:
        second.stop(flush_timeout_s=0.2)
    ends = [j for b in batches(home) for j in b.jobs if j.ended_at_s is not None]
    assert [(j.id, j.ended_by) for j in ends] == [("train", None)]


# -- the collector ends the jobs of a silent agent ------------------------------------------------------


def agent_batch(
    seq: int, sent_at_s: float, *job_records: wire.Job, end_s: float | None = None, holders: Sequence[str] = ()
) -> wire.Batch:
    intervals = []
    if end_s is not None:
        intervals = [
            wire.Interval(
                device="gpu0",
                t_start_s=end_s - 1.0,
                t_end_s=end_s,
                energy_j=300.0,
                source="counter",
                shares=dict.fromkeys(holders, 1.0),
            )
        ]
    return wire.Batch(
        agent_id="agent-a",
        seq=seq,
        host="node-a",
        sent_at_s=sent_at_s,
        devices=[wire.Device(key="gpu0", kind="gpu")],
        intervals=intervals,
        jobs=list(job_records),
    )


def job_row(engine: Engine, job_id: str) -> tuple[float | None, str | None]:
    with engine.connect() as conn:
        row = conn.execute(select(jobs.c.ended_at_s, jobs.c.ended_by).where(jobs.c.id == job_id)).one()
    return row[0], row[1]


def test_the_collector_ends_the_jobs_of_a_silent_agent_and_a_returning_one_reopens_nothing_wrongly(
    db_engine: Engine,
) -> None:
    clock = FakeClock(T0)
    reaper = SilentHostScheduler(db_engine, clock=clock, silent_after_s=600.0)
    start = wire.Job(id="ft", name="ft", kind="training", started_at_s=T0, devices=["gpu0"])
    other = wire.Job(id="other", name="other", kind="training", started_at_s=T0)
    ingest_batch(db_engine, agent_batch(0, T0 + 1.0, start, end_s=T0 + 1.0, holders=["ft"]), received_at_s=T0 + 1.0)
    ingest_batch(db_engine, agent_batch(1, T0 + 30.0, end_s=T0 + 30.0, holders=["ft"]), received_at_s=T0 + 30.0)
    # A job another host runs, still pushing: not touched.
    upsert_job(db_engine, "node-b", other, now_s=T0 + 500.0)

    clock.t_s = T0 + 500.0
    assert reaper.run_once() == []  # a collector just started gives every host its time first
    clock.t_s = T0 + 629.0
    assert reaper.run_once() == []  # silent for 599 s
    clock.t_s = T0 + 631.0
    assert reaper.run_once() == ["ft"]
    assert job_row(db_engine, "ft") == (T0 + 30.0, "collector-silent-agent")  # its last measured instant
    assert job_row(db_engine, "other") == (None, None)
    report = build_report(db_engine, now_s=clock.t_s)
    entry = next(j for j in report["jobs"] if j["id"] == "ft")
    assert entry["ended_by"] == "collector-silent-agent" and not entry["running"]
    assert reaper.run_once() == []  # nothing left to end

    # The agent's spool delivers a batch sealed before the silence: old news, the job stays ended.
    ingest_batch(db_engine, agent_batch(2, T0 + 20.0, start), received_at_s=T0 + 640.0)
    assert job_row(db_engine, "ft") == (T0 + 30.0, "collector-silent-agent")
    # Intervals alone never reopen a job either.
    ingest_batch(db_engine, agent_batch(3, T0 + 650.0, end_s=T0 + 650.0, holders=["ft"]), received_at_s=T0 + 650.0)
    assert job_row(db_engine, "ft")[0] == T0 + 30.0
    # A restarted agent that re-adopted the job announces it again: it runs, so it is open again.
    ingest_batch(db_engine, agent_batch(4, T0 + 660.0, start), received_at_s=T0 + 660.0)
    assert job_row(db_engine, "ft") == (None, None)
    # Its own end, when it comes, is the job's end.
    ended = replace_job(start, ended_at_s=T0 + 700.0)
    ingest_batch(db_engine, agent_batch(5, T0 + 701.0, ended), received_at_s=T0 + 701.0)
    assert job_row(db_engine, "ft") == (T0 + 700.0, None)
    # A job that really ended is never reopened, however fresh the record.
    ingest_batch(db_engine, agent_batch(6, T0 + 800.0, start), received_at_s=T0 + 800.0)
    assert job_row(db_engine, "ft") == (T0 + 700.0, None)


def test_an_agents_late_end_replaces_the_collectors_and_says_why(db_engine: Engine) -> None:
    clock = FakeClock(T0)
    reaper = SilentHostScheduler(db_engine, clock=clock, silent_after_s=60.0)
    a = wire.Job(id="a", name="a", kind="training", started_at_s=T0)
    b = wire.Job(id="b", name="b", kind="training", started_at_s=T0)
    ingest_batch(
        db_engine, agent_batch(0, T0 + 10.0, a, b, end_s=T0 + 10.0, holders=["a", "b"]), received_at_s=T0 + 10.0
    )
    clock.t_s = T0 + 100.0
    assert sorted(reaper.run_once()) == ["a", "b"]
    # The restarted agent found a's process gone: ended when last seen, earlier than the collector's guess.
    gone = replace_job(a, ended_at_s=T0 + 9.0, ended_by="agent-restart")
    ingest_batch(db_engine, agent_batch(1, T0 + 101.0, gone), received_at_s=T0 + 101.0)
    assert job_row(db_engine, "a") == (T0 + 9.0, "agent-restart")
    end_job(db_engine, "b", T0 + 50.0)  # an end through the HTTP API replaces it too
    assert job_row(db_engine, "b") == (T0 + 50.0, None)


def test_the_silent_host_pass_runs_on_its_schedule(sqlite_url: str) -> None:
    from wattwatch.storage.engine import make_engine

    engine = make_engine(sqlite_url)
    try:
        ran = threading.Event()
        reaper = SilentHostScheduler(engine, clock=lambda: T0, silent_after_s=5.0)
        assert reaper.interval_s == 1.0
        reaper.run_once = lambda: ran.set() or []  # type: ignore[method-assign]
        reaper.start()
        try:
            assert ran.wait(5.0)
        finally:
            reaper.stop()
        assert SilentHostScheduler(engine, clock=lambda: T0, silent_after_s=0.0).run_once() == []
        with pytest.raises(ValueError, match="host_silent_after_s"):
            SilentHostScheduler(engine, clock=lambda: T0, silent_after_s=-1.0)
    finally:
        engine.dispose()


def replace_job(job: wire.Job, **changes: object) -> wire.Job:
    import msgspec

    return msgspec.structs.replace(job, **changes)
