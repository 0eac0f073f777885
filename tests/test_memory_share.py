"""DRAM shared by the memory each job's processes hold, the rest to idle: from fixture /proc trees
(tests/fixtures/proc) through the agent and the collector, energy conserved on every interval."""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine

from wattwatch.accounting.attribution import split_interval
from wattwatch.agent.jobs import ActiveJob
from wattwatch.agent.memory import MemoryShareMeter
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.runner import Agent
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sensors.base import DeviceInfo, EnergyReading
from wattwatch.storage import repository
from wattwatch.storage.engine import make_engine

PROC = Path(__file__).parent / "fixtures" / "proc"
GIB = 2**30
MIB = 2**20
INSTALLED_B = 268435456 * 1024  # the fixture's MemTotal: 256 GiB


def job(job_id: str, *pids: int) -> ActiveJob:
    return ActiveJob(job_id, job_id, "training", 0.0, pids=set(pids))


def test_jobs_get_the_memory_their_trees_hold_and_idle_the_rest_of_the_installed_memory() -> None:
    meter = MemoryShareMeter(ProcFs(PROC, clock_ticks_per_s=100), page_size_b=4096)
    assert meter.installed_b() == INSTALLED_B
    # torchrun 4200: no smaps_rollup, so its resident set (51200 pages); its rank 4242: Pss 32 GiB.
    assert meter.process_memory_b(4200) == 51200 * 4096 == 200 * MIB
    assert meter.process_memory_b(4242) == 32 * GIB  # Pss, not the 40 GiB resident set
    assert meter.process_memory_b(999_999) == 0.0  # gone
    shares, idle_b = meter.shares([job("slurm", 4200), job("vllm", 5150), job("gone", 999_999)])
    # vLLM: the API server (2 GiB) and its engine core (16 GiB), found as 5150's child.
    assert shares == {"slurm": 32 * GIB + 200 * MIB, "vllm": 18 * GIB}  # a job holding nothing is left out
    assert idle_b == INSTALLED_B - sum(shares.values())
    # 1 kJ of DRAM energy: the rank's job gets its 12.6 %, the server 7 %, the host's idle the rest.
    parts, idle_j = split_interval(1000.0, shares, idle_b)
    assert parts["slurm"] == pytest.approx(1000.0 * (32 * GIB + 200 * MIB) / INSTALLED_B)
    assert parts["vllm"] == pytest.approx(1000.0 * 18 / 256)
    assert math.fsum([*parts.values(), idle_j]) == pytest.approx(1000.0, rel=1e-12)


def write_proc(root: Path, memory_kib: dict[int, int], total_kib: int, children: dict[int, list[int]]) -> None:
    """A /proc tree: every pid's Pss (smaps_rollup), its children, and MemTotal."""
    (root / "meminfo").write_text(f"MemTotal: {total_kib} kB\nMemFree: 0 kB\n")
    for pid, kib in memory_kib.items():
        task = root / str(pid) / "task" / str(pid)
        task.mkdir(parents=True, exist_ok=True)
        (task / "children").write_text(" ".join(map(str, children.get(pid, []))))
        (root / str(pid) / "smaps_rollup").write_text(f"00-ff ---p 0 00:00 0 [rollup]\nRss: {kib} kB\nPss: {kib} kB\n")


def test_memory_is_reread_every_refresh_and_a_missing_meminfo_leaves_everything_idle(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    write_proc(tmp_path, {10: 1024}, 4096, {})
    meter = MemoryShareMeter(ProcFs(tmp_path), refresh_s=5.0, monotonic=lambda: now[0])
    assert meter.shares([job("a", 10)]) == ({"a": 1024 * 1024}, 3072 * 1024)
    write_proc(tmp_path, {10: 2048}, 4096, {})
    now[0] = 4.9
    assert meter.shares([job("a", 10)])[0] == {"a": 1024 * 1024}  # cached: smaps_rollup is not free to read
    now[0] = 5.0
    assert meter.shares([job("a", 10)])[0] == {"a": 2048 * 1024}
    # Two DRAM devices closed at one instant share one reading, whatever changed in between.
    first = meter.shares([job("a", 10)], at_s=123.0)
    write_proc(tmp_path, {10: 3000}, 4096, {})
    now[0] = 20.0
    assert meter.shares([job("a", 10)], at_s=123.0) == first
    (tmp_path / "meminfo").unlink()
    with caplog.at_level(logging.WARNING, logger="wattwatch.agent.memory"):
        assert meter.shares([job("a", 10)], at_s=124.0) == ({}, 0.0)
        assert meter.shares([job("a", 10)], at_s=125.0) == ({}, 0.0)
    assert [r.message for r in caplog.records if "MemTotal" in r.message] == [
        f"{tmp_path}/meminfo has no MemTotal: DRAM energy is all the host's idle"
    ]


@settings(max_examples=60, deadline=None)
@given(
    memory_kib=st.lists(st.integers(0, 10**8), min_size=1, max_size=8),
    owners=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    total_kib=st.integers(1, 4 * 10**8),
    energy_j=st.one_of(st.floats(0.0, 1e7, allow_nan=False), st.sampled_from([0.0, 5e-324])),
)
def test_dram_split_conserves_energy_and_follows_the_memory_held(
    memory_kib: list[int], owners: list[int], total_kib: int, energy_j: float
) -> None:
    pids = [100 + i for i in range(len(memory_kib))]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_proc(root, dict(zip(pids, memory_kib, strict=True)), total_kib, {})
        jobs = [job(f"j{k}", *(p for p, o in zip(pids, owners, strict=False) if o == k)) for k in range(4)]
        shares, idle_b = MemoryShareMeter(ProcFs(root)).shares(jobs)
    held_kib = {f"j{k}": sum(m for m, o in zip(memory_kib, owners, strict=False) if o == k) for k in range(4)}
    assert shares == {j: kib * 1024.0 for j, kib in held_kib.items() if kib > 0}
    assert idle_b == max(total_kib - sum(held_kib.values()), 0) * 1024.0
    parts, idle_j = split_interval(energy_j, shares, idle_b)
    assert all(v >= 0 for v in parts.values()) and idle_j >= 0
    assert math.fsum([*parts.values(), idle_j]) == pytest.approx(energy_j, rel=1e-9, abs=1e-300)
    if shares and idle_b > 0 and energy_j > 1e-200:
        # Each job's part is its memory over the installed memory (when the jobs fit in it).
        for j, part in parts.items():
            assert part == pytest.approx(energy_j * shares[j] / (total_kib * 1024.0), rel=1e-9)


class DramSensor:
    """Two DRAM zones drawing a constant 12 W and 8 W."""

    name = "dram-test"

    def __init__(self) -> None:
        self.power_w = {"dram0": 12.0, "dram1": 8.0}
        self.origin_s = time.time() - 100.0

    def devices(self) -> Sequence[DeviceInfo]:
        return [DeviceInfo(key=k, kind="dram", index=i) for i, k in enumerate(self.power_w)]

    def read(self) -> list[EnergyReading]:
        return self.read_at(time.time())

    def read_at(self, t_s: float) -> list[EnergyReading]:
        return [EnergyReading(k, t_s, p * (t_s - self.origin_s), "counter") for k, p in self.power_w.items()]

    def close(self) -> None:
        pass


def test_agent_and_collector_give_each_job_its_memory_share_of_dram(tmp_path: Path, sqlite_url: str) -> None:
    settings_ = replace(Settings(home=tmp_path), collector_url="http://127.0.0.1:9", interval_s=0.2, host="h")
    agent = Agent(settings_, [DramSensor()], serve_socket=False, procfs=ProcFs(PROC, clock_ticks_per_s=100))
    agent.start()
    try:
        agent.handle({"op": "job_start", "id": "train", "name": "train", "kind": "training", "pid": 4200})
        agent.handle({"op": "job_start", "id": "serve", "name": "serve", "kind": "inference", "pid": 5150})
        assert agent.tick()
        assert agent.tick()
        agent.handle({"op": "job_end", "id": "train"})
        agent.handle({"op": "job_end", "id": "serve"})
        assert agent.tick()
    finally:
        agent.stop(flush_timeout_s=0.2)
    batches = [wire.decode_batch(body) for _, body in Spool(tmp_path / "spool.db").peek(limit=1000)]
    intervals = [iv for b in batches for iv in b.intervals]
    held = [iv for iv in intervals if iv.shares]
    assert {iv.device for iv in held} == {"dram0", "dram1"}
    memory_b = {"train": 32 * GIB + 200 * MIB, "serve": 18 * GIB}
    assert any(len(iv.shares) == 2 for iv in held)
    for iv in held:
        # Each job's memory, and the rest of the 256 GiB as idle weight.
        assert iv.shares == {j: memory_b[j] for j in iv.shares}
        assert iv.idle_weight == INSTALLED_B - sum(iv.shares.values())
    engine: Engine = make_engine(sqlite_url)
    try:
        for b in batches:
            repository.ingest_batch(engine, b, received_at_s=time.time())
        report = repository.build_report(engine, now_s=time.time() + 10)
    finally:
        engine.dispose()
    jobs = {j["id"]: j for j in report["jobs"]}
    for job_id, job_b in memory_b.items():
        expected_j = math.fsum(iv.energy_j * job_b / INSTALLED_B for iv in held if job_id in iv.shares)
        assert jobs[job_id]["dram_energy_j"] == pytest.approx(expected_j, rel=1e-6)
        assert expected_j > 0
    # Conservation: the jobs' DRAM energy plus the DRAM idle is every joule the zones measured.
    idle_j = math.fsum(i["energy_j"] for i in report["idle"] if i["device"].rsplit("/", 1)[-1].startswith("dram"))
    measured_j = math.fsum(iv.energy_j for iv in intervals)
    assert jobs["train"]["dram_energy_j"] + jobs["serve"]["dram_energy_j"] + idle_j == pytest.approx(measured_j)
