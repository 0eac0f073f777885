"""One owner per process at every instant: a process already on a GPU when it opens its job (a model loaded
first) is found by the agent as an anonymous job; the job's start claims it at that same boundary read,
the anonymous job ending there as the job's setup phase, and between its jobs the process is in a phase
of them, never a stray job. A real child process in the real /proc, the agent in-process on a simulated
GPU; then the collector's report (SQLite and PostgreSQL) hides the phases and shows them with their jobs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from procs import wait_for
from wattwatch.accounting.attribution import split_interval
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.runner import Agent
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.reporting.render import render
from wattwatch.sensors.nvml import NvmlSensor
from wattwatch.sensors.visible import resolve_visible
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.storage import repository


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WATTWATCH_", "SLURM_"))}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    yield proc
    proc.kill()
    proc.wait()


def spooled(home: Path) -> list[wire.Batch]:
    spool = Spool(home / "spool.db")
    try:
        return [wire.decode_batch(body) for _, body in spool.peek(limit=10_000)]
    finally:
        spool.close()


def make_agent(tmp_path: Path, fleet: SimulatedFleet) -> Agent:
    sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
    settings = Settings(home=tmp_path, collector_url="http://127.0.0.1:9", interval_s=3600, host="h")
    return Agent(settings, [sensor], gpu_processes=sensor, serve_socket=False, procfs=ProcFs())


def held(agent: Agent) -> list[tuple[str, str]]:
    """(job id, discovered-by) of the agent's active jobs."""
    return sorted((j["id"], j["discovered_by"]) for j in agent.jobs())


def open_job(agent: Agent, job_id: str, pid: int) -> float:
    """Start ``job_id`` for process ``pid`` (no CUDA_VISIBLE_DEVICES: bound by its process) and wait until
    the worker applied it, without a tick."""
    t_s = float(agent.handle({"op": "job_start", "id": job_id, "name": job_id, "kind": "inference", "pid": pid})["t_s"])
    wait_for(lambda: [j for j, _ in held(agent)] == [job_id], 5, f"{job_id} to hold the process alone")
    return t_s


def close_job(agent: Agent, job_id: str) -> float:
    """End ``job_id`` and wait until its process's after phase holds it, without a tick."""
    t_s = float(agent.handle({"op": "job_end", "id": job_id})["t_s"])
    wait_for(lambda: [b for _, b in held(agent)] == [f"after:{job_id}"], 5, f"the after phase of {job_id}")
    return t_s


def test_a_process_on_the_gpu_before_its_jobs_is_their_setup_never_a_stray_job(
    tmp_path: Path, sleeper: subprocess.Popen[bytes], db_engine: Engine
) -> None:
    pid = sleeper.pid
    fleet = SimulatedFleet(1)
    agent = make_agent(tmp_path, fleet)
    agent.start()
    try:
        fleet.set_activity(0, "training", fleet.clock(), pid=pid)  # the model loads before any job opens
        assert agent.tick()
        [pre] = agent.jobs()
        assert pre["pids"] == [pid] and pre["devices"] == ["gpu0"] and pre["kind"] == "other"
        time.sleep(0.3)
        t1 = open_job(agent, "j1", pid)
        assert [j["devices"] for j in agent.jobs()] == [["gpu0"]]  # bound at the claim, not at the next tick
        time.sleep(0.3)
        assert agent.tick() and [j for j, _ in held(agent)] == ["j1"]
        time.sleep(0.2)
        t1_end = close_job(agent, "j1")
        [(after_1, _)] = held(agent)
        time.sleep(0.2)
        assert agent.tick() and held(agent) == [(after_1, "after:j1")]  # the same phase, not a new anonymous job
        time.sleep(0.2)
        t2 = open_job(agent, "j2", pid)
        time.sleep(0.4)
        t2_end = close_job(agent, "j2")
        [(after_2, _)] = held(agent)
        time.sleep(0.2)
        fleet.set_activity(0, "idle", fleet.clock(), pid=pid)  # the process leaves the GPU
        assert agent.tick() and agent.jobs() == []
    finally:
        agent.stop(flush_timeout_s=0.2)

    batches = spooled(tmp_path)
    records = [j for b in batches for j in b.jobs]
    ends = {j.id: j for j in records if j.ended_at_s is not None}
    # Each phase ends at the very boundary read of the job that claims its process, labelled as its setup.
    assert ends[pre["id"]].ended_at_s == t1
    assert ends[pre["id"]].labels[wire.PHASE_LABEL] == "setup" and ends[pre["id"]].labels[wire.PHASE_OF_LABEL] == "j1"
    assert min(j.started_at_s for j in records if j.id == after_1) == t1_end
    assert ends[after_1].ended_at_s == t2 and ends[after_1].labels[wire.PHASE_OF_LABEL] == "j2"
    assert ends[after_1].labels[wire.PHASE_LABEL] == "setup"
    assert min(j.started_at_s for j in records if j.id == after_2) == t2_end
    assert ends[after_2].labels[wire.PHASE_LABEL] == "after" and ends[after_2].labels[wire.PHASE_OF_LABEL] == "j2"
    assert {j.id for j in records} == {pre["id"], "j1", after_1, "j2", after_2}

    # One owner at every instant: every interval while the process is on the GPU has exactly one holder,
    # and it is the job whose window holds the interval.
    intervals = [iv for b in batches for iv in b.intervals if iv.device == "gpu0"]
    windows = {"j1": (t1, t1_end), "j2": (t2, t2_end)}
    for iv in intervals:
        assert len(iv.shares) <= 1, iv
        for job_id, (lo, hi) in windows.items():
            inside = lo <= iv.t_start_s and iv.t_end_s <= hi
            assert inside == (job_id in iv.shares), (job_id, iv)

    # The report: two jobs, the phases folded in as setup and after energy; nothing lost, nothing doubled.
    for b in batches:
        repository.ingest_batch(db_engine, b, received_at_s=time.time())
    report = repository.build_report(db_engine)
    jobs = {j["id"]: j for j in report["jobs"]}
    assert list(jobs) == ["j1", "j2"]

    def energy_of(job_id: str) -> float:
        return sum(split_interval(iv.energy_j, iv.shares)[0].get(job_id, 0.0) for iv in intervals)

    assert jobs["j1"]["setup_energy_j"] == pytest.approx(energy_of(pre["id"]), rel=1e-9)
    assert jobs["j1"]["setup_energy_j"] > 0 and jobs["j1"]["after_energy_j"] is None
    assert jobs["j1"]["setup_duration_s"] == pytest.approx(t1 - ends[pre["id"]].started_at_s)
    assert jobs["j2"]["setup_energy_j"] == pytest.approx(energy_of(after_1), rel=1e-9)
    assert jobs["j2"]["setup_duration_s"] == pytest.approx(t2 - t1_end)
    assert jobs["j2"]["after_energy_j"] == pytest.approx(energy_of(after_2), rel=1e-9)
    assert [p["id"] for p in jobs["j2"]["phases"]] == [after_1, after_2]
    for job_id in ("j1", "j2"):
        assert jobs[job_id]["energy_j"] == pytest.approx(energy_of(job_id), rel=1e-9)
    idle_j = sum(i["energy_j"] for i in report["idle"])
    folded_j = sum(j["energy_j"] + (j["setup_energy_j"] or 0) + (j["after_energy_j"] or 0) for j in jobs.values())
    assert folded_j + idle_j == pytest.approx(sum(iv.energy_j for iv in intervals), rel=1e-9)
    # A phase still answers by its own id.
    phase = repository.get_job(db_engine, after_1)
    assert phase is not None and (phase["phase"], phase["phase_of"]) == ("setup", "j2")
    assert [j["id"] for j in repository.list_jobs(db_engine)] == ["j2", "j1"]

    table = render(report, "table")
    assert "SETUP" in table.splitlines()[0] and "AFTER" in table.splitlines()[0]
    csv_lines = render(report, "csv").splitlines()
    assert ",setup_energy_j,setup_duration_s,after_energy_j,after_duration_s," in csv_lines[0] + ","
    assert "| SETUP |" in render(report, "markdown")


def test_a_job_takes_only_its_own_processes_and_a_process_inside_another_job_or_gone_gets_no_phase(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WATTWATCH_", "SLURM_"))}
    env["WATTWATCH_JOB"] = "shared"  # two ranks of one discovered job, on two GPUs
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env) for _ in range(2)]
    fleet = SimulatedFleet(2)
    agent = make_agent(tmp_path, fleet)
    agent.start()
    try:
        for index, rank in enumerate(ranks):
            fleet.set_activity(index, "training", fleet.clock(), pid=rank.pid)
        assert agent.tick()
        assert [(j["id"], j["devices"]) for j in agent.jobs()] == [("shared", ["gpu0", "gpu1"])]
        t_s = agent.handle({"op": "job_start", "id": "mine", "name": "mine", "pid": ranks[0].pid})["t_s"]
        agent.handle({"op": "job_start", "id": "inner", "name": "inner", "pid": ranks[0].pid})
        # The other rank stays with the discovered job, which now holds only its GPU.
        split = {"shared": ["gpu1"], "mine": ["gpu0"], "inner": []}
        wait_for(lambda: {j["id"]: j["devices"] for j in agent.jobs()} == split, 5, "the split")
        agent.handle({"op": "job_end", "id": "inner"})  # its process is still inside "mine": no phase
        assert agent.tick()
        assert sorted(j["id"] for j in agent.jobs()) == ["mine", "shared"]
        fleet.set_activity(0, "idle", fleet.clock(), pid=ranks[0].pid)  # the process leaves the GPU, then
        agent.handle({"op": "job_end", "id": "mine"})  # its job ends: nothing of it is left to phase
        assert agent.tick()
        assert [j["id"] for j in agent.jobs()] == ["shared"]
    finally:
        agent.stop(flush_timeout_s=0.2)
        for rank in ranks:
            rank.kill()
            rank.wait()
    records = [j for b in spooled(tmp_path) for j in b.jobs]
    assert {j.id for j in records} == {"shared", "mine", "inner"}
    assert all(wire.PHASE_LABEL not in j.labels for j in records)
    gpu0 = [iv for b in spooled(tmp_path) for iv in b.intervals if iv.device == "gpu0" and iv.t_start_s >= t_s]
    assert gpu0 and all("shared" not in iv.shares for iv in gpu0)


def test_a_process_that_reached_the_gpu_inside_its_first_job_is_claimed_by_the_next_before_any_tick(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    pid = sleeper.pid
    fleet = SimulatedFleet(1)
    sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
    settings = Settings(home=tmp_path, collector_url="http://127.0.0.1:9", interval_s=3600, host="h")
    agent = Agent(
        settings, [sensor], gpu_processes=sensor, serve_socket=False, procfs=ProcFs(), resolve_visible=resolve_visible
    )
    agent.start()
    try:
        start = {"op": "job_start", "kind": "inference", "pid": pid, "cuda_visible_devices": "0"}
        agent.handle({**start, "id": "j1", "name": "j1"})
        wait_for(lambda: [j for j, _ in held(agent)] == ["j1"], 5, "j1")
        fleet.set_activity(0, "training", fleet.clock(), pid=pid)  # the model loads inside the first job
        time.sleep(0.2)
        close_job(agent, "j1")  # no tick yet: the process was never seen by one
        [(after_1, _)] = held(agent)
        time.sleep(0.2)
        t2 = agent.handle({**start, "id": "j2", "name": "j2"})["t_s"]
        wait_for(lambda: [j for j, _ in held(agent)] == ["j2"], 5, "j2 to take its process at its start")
    finally:
        agent.stop(flush_timeout_s=0.2)
    ends = {j.id: j for b in spooled(tmp_path) for j in b.jobs if j.ended_at_s is not None}
    assert ends[after_1].ended_at_s == t2 and ends[after_1].labels[wire.PHASE_OF_LABEL] == "j2"


@contextmanager
def two_jobs_sharing_a_gpu(tmp_path: Path) -> Iterator[tuple[Agent, SimulatedFleet, int, int, Callable[[], None]]]:
    """An agent whose GPU two processes A and B share at 70 % and 30 % SM, in jobs ``ja`` and ``jb``; the
    last item makes its boundary reads slow (0.15 s, as when the counter's refresh is a while off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WATTWATCH_", "SLURM_"))}
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env) for _ in range(2)]
    a, b = (p.pid for p in procs)
    fleet = SimulatedFleet(1)
    agent = make_agent(tmp_path, fleet)
    [sensor] = agent.sampler.sensors
    read_at = sensor.read_at

    def slow_read_at(t_s: float) -> Any:
        time.sleep(0.15)
        return read_at(t_s)

    def slow() -> None:
        sensor.read_at = slow_read_at  # type: ignore[method-assign]

    agent.start()
    try:
        t0 = fleet.clock()
        fleet.set_activity(0, "training", t0)
        fleet.set_process_utilization(0, a, 70.0, t0)
        fleet.set_process_utilization(0, b, 30.0, t0)
        assert agent.tick()
        for job_id, pid in (("ja", a), ("jb", b)):
            agent.handle({"op": "job_start", "id": job_id, "name": job_id, "kind": "inference", "pid": pid})
        wait_for(lambda: [j for j, _ in held(agent)] == ["ja", "jb"], 5, "both jobs to hold their processes")
        time.sleep(0.3)
        yield agent, fleet, a, b, slow
    finally:
        agent.stop(flush_timeout_s=0.2)
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_process_that_leaves_the_gpu_while_its_jobs_end_is_read_stays_in_its_after_phase(tmp_path: Path) -> None:
    """Two processes share a GPU in two jobs; A's job ends and A leaves the GPU 50 ms later, while the end's
    boundary read still waits for the counter. A was on the GPU at its job's end, so it is in its after
    phase from there and weighs in the split with B's job (before: asked after the read, A was gone, and
    B's job took the GPU whole until its own end)."""
    with two_jobs_sharing_a_gpu(tmp_path) as (agent, fleet, a, b, slow):
        slow()
        fleet.set_process_utilization(0, a, 0.0, fleet.clock() + 0.05)  # A leaves 50 ms after its job ends
        t_end_a = float(agent.handle({"op": "job_end", "id": "ja"})["t_s"])
        wait_for(lambda: "after:ja" in {by for _, by in held(agent)}, 5, "A's after phase")
        time.sleep(0.3)
        t_end_b = float(agent.handle({"op": "job_end", "id": "jb"})["t_s"])
        assert agent.tick()
    batches = spooled(tmp_path)
    records = [j for b_ in batches for j in b_.jobs]
    after_a = next(
        j for j in records if j.labels.get(wire.PHASE_LABEL) == "after" and j.labels[wire.PHASE_OF_LABEL] == "ja"
    )
    assert min(j.started_at_s for j in records if j.id == after_a.id) == t_end_a
    between = [iv for b_ in batches for iv in b_.intervals if iv.device == "gpu0" and t_end_a <= iv.t_start_s < t_end_b]
    assert between and all(set(iv.shares) == {"jb", after_a.id} for iv in between), between
    # A's 50 ms at 70 % SM against B's 30 % between the ends: its share (about 0.18), not nothing (no phase) nor
    # 0.7 (a phase weighed as busy throughout). NVML samples utilisation every 1/6 s, each the mean over its
    # period, so A's short busy stretch is resolved to about a sample: measured 0.17-0.24.
    parts = [split_interval(iv.energy_j, iv.shares)[0] for iv in between]
    share_a = sum(p[after_a.id] for p in parts) / sum(iv.energy_j for iv in between)
    board = fleet.board(0)
    util_a, util_b = (board.mean_process_util(pid, t_end_a, t_end_b) for pid in (a, b))
    print(
        f"\nA's after phase: {share_a:.3f} of the GPU between the ends "
        f"(utilisation alone: {util_a / (util_a + util_b):.3f})"
    )
    assert share_a == pytest.approx(util_a / (util_a + util_b), abs=0.1)


def test_a_process_that_leaves_while_the_end_before_its_own_is_read_stays_in_its_after_phase(tmp_path: Path) -> None:
    """Both jobs end 1 ms apart and B leaves the GPU 30 ms after its end, while the worker still reads A's end
    (B's end waits in the queue behind it): B was on the GPU at its job's end, so it gets its after phase."""
    with two_jobs_sharing_a_gpu(tmp_path) as (agent, fleet, _a, b, slow):
        slow()
        agent.handle({"op": "job_end", "id": "ja"})
        time.sleep(0.001)
        fleet.set_process_utilization(0, b, 0.0, fleet.clock() + 0.03)
        agent.handle({"op": "job_end", "id": "jb"})
        wait_for(lambda: {by for _, by in held(agent)} == {"after:ja", "after:jb"}, 5, "both after phases")
