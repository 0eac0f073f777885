"""The simulated fleet: exact truth, and a fake pynvml that reports it the way an H100 does."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import pynvml
import pytest

from wattwatch.sim.clock import FakeClock
from wattwatch.sim.fleet import COUNTER_PERIOD_S, SimulatedFleet

T0 = 1_700_000_000.0


def make_fleet(n: int = 3, seed: int = 1, **kwargs: object) -> tuple[SimulatedFleet, FakeClock]:
    clock = FakeClock()
    return SimulatedFleet(n, seed=seed, clock=clock, **kwargs), clock  # type: ignore[arg-type]


def numeric_energy_j(fleet: SimulatedFleet, index: int, t0_s: float, t1_s: float, step_s: float = 1e-4) -> float:
    n = round((t1_s - t0_s) / step_s)
    return sum(fleet.power_w(index, t0_s + (i + 0.5) * step_s) for i in range(n)) * step_s


def test_exact_energy_matches_fine_numerical_integration_across_activity_changes() -> None:
    fleet, _ = make_fleet()
    fleet.set_activity(0, "training", T0 + 0.123456, pid=10)
    fleet.set_activity(0, "inference", T0 + 2.0071, pid=11)
    fleet.set_activity(0, "idle", T0 + 3.3333, pid=None)
    t0, t1 = T0 + 0.05, T0 + 4.05  # whole number of 0.1 ms steps
    exact = fleet.exact_energy_j(0, t0, t1)
    assert exact == pytest.approx(numeric_energy_j(fleet, 0, t0, t1), rel=2e-4)
    # Additive over any split, including one inside a slot.
    mid = T0 + 1.234567
    assert fleet.exact_energy_j(0, t0, mid) + fleet.exact_energy_j(0, mid, t1) == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError):
        fleet.exact_energy_j(0, t1, t0)


def test_profiles_are_realistic_for_an_h100() -> None:
    fleet, _ = make_fleet()
    start = T0 + 1.0
    fleet.set_activity(1, "training", start, pid=1)
    fleet.set_activity(2, "inference", start, pid=2)
    slots = [start + 0.005 + k * 0.01 for k in range(3000)]  # 30 s, one sample per 10 ms slot
    idle = [fleet.power_w(0, t) for t in slots]
    train = [fleet.power_w(1, t) for t in slots]
    infer = [fleet.power_w(2, t) for t in slots]
    assert min(idle) >= 60 and max(idle) <= 75
    assert all(190 <= p <= 700 for p in train)
    dip_fraction = sum(p < 350 for p in train) / len(train)
    assert 0.08 <= dip_fraction <= 0.22
    assert 550 <= sum(p for p in train if p >= 350) / sum(p >= 350 for p in train) <= 690
    assert max(infer) <= 700 and max(infer) >= 640  # prefill spikes
    assert min(infer) >= 84  # gaps near 90-120 W
    assert any(340 <= p <= 505 for p in infer)  # decode plateau
    assert 150 < fleet.exact_energy_j(2, start, start + 30) / 30 < 550


def test_exact_energy_of_a_minute_is_fast() -> None:
    fleet, _ = make_fleet()
    fleet.set_activity(0, "training", T0 + 0.5)
    fleet.set_activity(1, "inference", T0 + 0.5)
    for index in (0, 1, 2):
        began = time.perf_counter()
        fleet.exact_energy_j(index, T0 + 1.0, T0 + 61.0)
        # The contract is "well under 50 ms"; it takes ~5 ms here. Loose bound for loaded CI machines.
        assert time.perf_counter() - began < 0.2


def test_power_is_a_pure_function_of_seed_board_timeline_and_time() -> None:
    a, _ = make_fleet(seed=7)
    b, clock_b = make_fleet(seed=7)
    clock_b.t_s += 1234.5  # when the fleet object was created does not matter
    c, _ = make_fleet(seed=8)
    for fleet in (a, b, c):
        fleet.set_activity(0, "training", T0 + 1.0)
    ts = [T0 + 1.0 + 0.37 * k for k in range(50)]
    assert [a.power_w(0, t) for t in ts] == [b.power_w(0, t) for t in ts]
    assert [a.power_w(0, t) for t in ts] != [c.power_w(0, t) for t in ts]
    assert [a.power_w(0, t) for t in ts] != [a.power_w(1, t) for t in ts]
    assert a.uuid(0) == b.uuid(0) != a.uuid(1)


def test_replay_from_truth_log_equals_original(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    fleet, _ = make_fleet(seed=5, truth_path=truth)
    fleet.set_activity(0, "training", T0 + 0.31, pid=100)
    fleet.set_activity(1, "inference", T0 + 0.77, pid=101)
    fleet.set_activity(0, "training", T0 + 1.5, pid=102)  # another process joins, same profile
    fleet.set_activity(0, "idle", T0 + 5.55)
    lines = [json.loads(line) for line in truth.read_text().splitlines()]
    assert lines[0] == {"index": 0, "kind": "training", "t_s": T0 + 0.31, "pid": 100}
    assert len(lines) == 4
    windows = [(0, T0, T0 + 6), (1, T0 + 0.5, T0 + 9.25), (2, T0 - 3, T0 + 1)]
    replayed = SimulatedFleet.replay(truth, 3, seed=5)
    for index, t0, t1 in windows:
        assert replayed.exact_energy_j(index, t0, t1) == fleet.exact_energy_j(index, t0, t1)
    assert replayed.pids(0, T0 + 2) == {100, 102}

    # And from another process, as the end-to-end test does.
    code = (
        "import sys, json; from pathlib import Path; from wattwatch.sim.fleet import SimulatedFleet; "
        "f = SimulatedFleet.replay(Path(sys.argv[1]), 3, seed=5); "
        "print(json.dumps([f.exact_energy_j(i, a, b) for i, a, b in json.loads(sys.argv[2])]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(truth), json.dumps(windows)], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [fleet.exact_energy_j(i, a, b) for i, a, b in windows]


def test_replay_rejects_a_corrupt_line_but_ignores_a_line_being_written(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    truth.write_text('{"index": 0, "kind": "training", "t_s": 5.0, "pid": 1}\n{"index": 0, "ki')
    assert SimulatedFleet.replay(truth, 1).activity(0, 6.0) == "training"
    truth.write_text('{"index": 0, "kind": "dancing", "t_s": 5.0, "pid": 1}\n')
    with pytest.raises(ValueError, match=r"truth\.jsonl:1"):
        SimulatedFleet.replay(truth, 1)


def test_energy_counter_advances_every_100_ms_in_integer_mj() -> None:
    fleet, clock = make_fleet()
    fleet.set_activity(0, "training", T0 + 0.2)
    nv = fleet.module()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    changes: list[float] = []
    values: list[int] = []
    for _ in range(2000):  # 2 s in 1 ms steps
        clock.sleep(0.001)
        value = nv.nvmlDeviceGetTotalEnergyConsumption(handle)
        assert isinstance(value, int)
        if values and value != values[-1]:
            assert value > values[-1]
            changes.append(clock.t_s)
        values.append(value)
    gaps = [b - a for a, b in pairwise(changes)]
    assert len(changes) in (19, 20)
    assert all(abs(g - COUNTER_PERIOD_S) < 1.5e-3 for g in gaps)
    # The value is the floor of the exact integral since fleet creation, up to the last update.
    u = fleet.last_update_s(0, clock.t_s)
    assert abs(values[-1] - math.floor(1000 * fleet.exact_energy_j(0, fleet.created_s, u))) <= 1


def test_power_usage_is_the_trailing_1s_average_not_the_instant_power() -> None:
    fleet, clock = make_fleet()
    nv = fleet.module()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(1)
    fleet.set_activity(1, "training", T0 + 5.0)
    clock.t_s = T0 + 5.35  # a third of a second into training: the average still remembers idle
    average_w = nv.nvmlDeviceGetPowerUsage(handle) / 1000
    u = fleet.last_update_s(1, clock.t_s)
    assert average_w == pytest.approx(fleet.exact_energy_j(1, u - 1.0, u), abs=1e-3)
    assert 100 < average_w < 400
    (field,) = nv.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_POWER_INSTANT])
    assert field.nvmlReturn == pynvml.NVML_SUCCESS
    assert field.fieldId == pynvml.NVML_FI_DEV_POWER_INSTANT
    assert field.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert field.timestamp == int(clock.t_s * 1e6)
    assert field.value.uiVal / 1000 == fleet.power_w(1, clock.t_s)
    assert abs(field.value.uiVal / 1000 - average_w) > 50
    fields = nv.nvmlDeviceGetFieldValues(handle, [(pynvml.NVML_FI_DEV_POWER_INSTANT, 0), 9999])
    assert fields[0].scopeId == 0 and fields[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_fake_module_speaks_pynvml() -> None:
    fleet, clock = make_fleet(n=2)
    nv = fleet.module()
    assert nv.WATTWATCH_SIMULATED is True
    assert nv.NVMLError is pynvml.NVMLError and nv.NVML_ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 2
    assert nv.nvmlSystemGetDriverVersion()
    handle = nv.nvmlDeviceGetHandleByIndex(1)
    uuid = nv.nvmlDeviceGetUUID(handle)
    assert uuid.startswith("GPU-") and len(uuid) == 40
    assert nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(uuid)) == 1
    assert nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(uuid.encode())) == 1
    assert nv.nvmlDeviceGetName(handle) == "NVIDIA H100 80GB HBM3"
    assert nv.nvmlDeviceGetEnforcedPowerLimit(handle) == 700_000
    assert nv.nvmlDeviceGetPowerManagementLimit(handle) == 700_000
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID("GPU-nope")

    fleet.set_activity(1, "training", T0 + 1, pid=4242)
    fleet.set_activity(1, "training", T0 + 1, pid=4343)
    clock.t_s = T0 + 3
    procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    assert sorted(p.pid for p in procs) == [4242, 4343]
    mem = nv.nvmlDeviceGetMemoryInfo(handle)
    assert mem.total == mem.used + mem.free and mem.used > 0.5 * mem.total
    assert sum(p.usedGpuMemory for p in procs) <= mem.used
    util = nv.nvmlDeviceGetUtilizationRates(handle)
    assert 50 <= util.gpu <= 100 and 0 <= util.memory <= 100
    fleet.set_activity(1, "idle", T0 + 4, pid=4242)
    clock.t_s = T0 + 6
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)] == [4343]
    assert nv.nvmlDeviceGetUtilizationRates(handle).gpu == 0
    fleet.set_activity(1, "idle", T0 + 7)
    clock.t_s = T0 + 8
    assert nv.nvmlDeviceGetComputeRunningProcesses(handle) == []
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetPowerUsage(handle)


def test_fault_injection() -> None:
    fleet, clock = make_fleet(n=2)
    nv = fleet.module()
    nv.nvmlInit()
    h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    clock.t_s = T0 + 10
    before = nv.nvmlDeviceGetTotalEnergyConsumption(h0)
    assert before > 500_000  # ~10 s of idle
    fleet.reset_counter(0, T0 + 10.5)
    clock.t_s = T0 + 11
    after = nv.nvmlDeviceGetTotalEnergyConsumption(h0)
    assert 0 < after < 100_000

    fleet.set_energy_counter_supported(1, False)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetTotalEnergyConsumption(h1)
    assert nv.nvmlDeviceGetPowerUsage(h1) > 0

    fleet.lose(1)
    for call in (nv.nvmlDeviceGetPowerUsage, nv.nvmlDeviceGetUUID, nv.nvmlDeviceGetComputeRunningProcesses):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(h1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetTotalEnergyConsumption(h0) >= after


def test_history_already_reported_is_never_rewritten(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    fleet, clock = make_fleet(truth_path=truth)
    nv = fleet.module()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    fleet.set_activity(0, "training", T0 + 1)
    clock.t_s = T0 + 3
    seen = nv.nvmlDeviceGetTotalEnergyConsumption(handle)
    fleet.set_activity(0, "idle", T0 + 2)  # in the past of what NVML reported: moved to now
    assert json.loads(truth.read_text().splitlines()[-1])["t_s"] == T0 + 3
    assert nv.nvmlDeviceGetTotalEnergyConsumption(handle) == seen
    assert fleet.activity(0, T0 + 2.5) == "training"


def test_concurrent_readers_and_a_driver() -> None:
    fleet = SimulatedFleet(4, seed=2)  # real clock: threads really interleave
    errors: list[BaseException] = []

    def reader(index: int) -> None:
        try:
            nv = fleet.module()
            nv.nvmlInit()
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            last = -1
            for _ in range(300):
                value = nv.nvmlDeviceGetTotalEnergyConsumption(handle)
                assert value >= last
                last = value
                nv.nvmlDeviceGetPowerUsage(handle)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i % 4,)) for i in range(6)]
    for t in threads:
        t.start()
    for k in range(200):
        fleet.set_activity(k % 4, ("training", "inference", "idle")[k % 3], time.time(), pid=k)
    for t in threads:
        t.join()
    assert not errors


def test_per_process_utilisation_is_sampled_like_nvml(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    fleet, clock = make_fleet(n=2, truth_path=truth)
    nv = fleet.module()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(1)
    fleet.set_process_utilization(1, 500, 60.0, T0 + 1.0)
    fleet.set_process_utilization(1, 501, 20.0, T0 + 1.0)
    fleet.set_process_utilization(1, 501, 0.0, T0 + 2.0)  # 501 leaves
    assert fleet.process_utilization(1, 500, T0 + 1.5) == 60.0
    assert fleet.process_utilization(1, 501, T0 + 1.5) == 20.0
    assert fleet.process_utilization(1, 501, T0 + 2.5) == 0.0
    assert fleet.process_utilization(1, 500, T0 + 0.5) == 0.0
    with pytest.raises(ValueError):
        fleet.set_process_utilization(1, 500, 120.0, T0 + 3.0)

    clock.t_s = T0 + 1.5
    assert sorted(p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)) == [500, 501]
    samples = nv.nvmlDeviceGetProcessUtilization(handle, int((T0 + 1.1) * 1e6))
    assert isinstance(samples[0], pynvml.c_nvmlProcessUtilizationSample_t)
    stamps = sorted({s.timeStamp for s in samples})
    assert all(s.timeStamp > (T0 + 1.1) * 1e6 and s.timeStamp <= clock.t_s * 1e6 for s in samples)
    assert [round(b - a) for a, b in pairwise(stamps)] in ([166_667] * (len(stamps) - 1), [166_666] * (len(stamps) - 1))
    assert len(stamps) == 2  # 0.4 s at ~6 samples per second
    assert {(s.pid, s.smUtil) for s in samples} == {(500, 60), (501, 20)}

    clock.t_s = T0 + 3.0
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)] == [500]
    late = nv.nvmlDeviceGetProcessUtilization(handle, int((T0 + 2.2) * 1e6))
    assert {s.pid for s in late} == {500}
    # The sample that straddles 501's exit reports its mean over the sample period.
    straddle = [s for s in nv.nvmlDeviceGetProcessUtilization(handle, int((T0 + 1.9) * 1e6)) if s.pid == 501]
    assert len(straddle) == 1 and 0 < straddle[0].smUtil < 20
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing ran on board 0
        nv.nvmlDeviceGetProcessUtilization(nv.nvmlDeviceGetHandleByIndex(0), 0)
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing since now
        nv.nvmlDeviceGetProcessUtilization(handle, int(clock.t_s * 1e6))

    fleet.set_process_utilization(1, 500, 30.0, T0 + 2.5)  # in the past of what NVML reported: moved to now
    assert fleet.process_utilization(1, 500, T0 + 2.7) == 60.0
    replayed = SimulatedFleet.replay(truth, 2, seed=1)
    assert [replayed.process_utilization(1, 500, t) for t in (T0 + 1.5, T0 + 3.5)] == [60.0, 30.0]
    assert replayed.process_utilization(1, 501, T0 + 2.5) == 0.0


def test_square_wave_is_exact_and_replays(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    fleet, _ = make_fleet(n=1, truth_path=truth)
    fleet.set_square_wave(0, T0 + 1.0, 0.075, 150.0, 650.0, pid=9)
    assert fleet.activity(0, T0 + 1.5) == "square" and fleet.pids(0, T0 + 1.5) == {9}
    assert fleet.power_w(0, T0 + 1.0 + 0.01) == 650.0
    assert fleet.power_w(0, T0 + 1.0 + 0.05) == 150.0
    assert fleet.power_w(0, T0 + 1.0 + 0.076) == 650.0
    t0, t1 = T0 + 1.0123, T0 + 3.4567
    exact = fleet.exact_energy_j(0, t0, t1)
    assert exact == pytest.approx(numeric_energy_j(fleet, 0, t0, t1, step_s=1e-5), rel=1e-4)
    assert fleet.exact_energy_j(0, T0 + 1.0, T0 + 1.75) == pytest.approx(400.0 * 0.75)  # 10 whole periods
    with pytest.raises(ValueError, match="set_square_wave"):
        fleet.set_activity(0, "square", T0 + 5)
    replayed = SimulatedFleet.replay(truth, 1, seed=1)
    assert replayed.exact_energy_j(0, t0, t1) == exact


def test_generations_are_presets_of_nvml_behaviour() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="h100, h100-parttime, a100"):
        SimulatedFleet(1, generation="b200", clock=clock)
    a100 = SimulatedFleet(1, generation="a100", clock=clock, seed=3)
    h100 = SimulatedFleet(1, generation="h100", clock=clock, seed=3)
    for fleet in (a100, h100):
        fleet.set_activity(0, "training", T0 + 1.0)
    nv = a100.module()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetName(handle) == "NVIDIA A100-SXM4-80GB"
    assert nv.nvmlDeviceGetEnforcedPowerLimit(handle) == 400_000
    assert nv.nvmlDeviceGetMemoryInfo(handle).total == 81_920 * 1024 * 1024
    # The same activity, scaled to the board's power limit.
    t = T0 + 2.345
    assert a100.power_w(0, t) == pytest.approx(h100.power_w(0, t) * 400 / 700, abs=1e-3)
    assert 300 < a100.exact_energy_j(0, T0 + 2, T0 + 12) / 10 < 400

    # Part-time sampling: the instant reading is the mean of the last 25 ms of the last 100 ms period,
    # held until the next refresh, and (GA100) nvmlDeviceGetPowerUsage is that same sample.
    readings = set()
    for k in range(40):  # 0.1 s in 2.5 ms steps
        clock.t_s = T0 + 3.0 + k * 0.0025
        (field,) = nv.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_POWER_INSTANT])
        u = a100.last_update_s(0, clock.t_s)
        assert field.value.uiVal == round(1000 * a100.exact_energy_j(0, u - 0.025, u) / 0.025)
        assert nv.nvmlDeviceGetPowerUsage(handle) == field.value.uiVal
        readings.add(field.value.uiVal)
    assert len(readings) == 2  # one refresh in the 100 ms


def test_part_time_h100_averages_only_what_it_sampled() -> None:
    clock = FakeClock()
    fleet = SimulatedFleet(1, generation="h100-parttime", clock=clock, seed=2)
    # In step with the refresh grid: each sampled 25 ms falls in the wave's low half.
    fleet.set_square_wave(0, fleet.last_update_s(0, T0 + 0.5), 0.1, 100.0, 600.0)
    nv = fleet.module()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    clock.t_s = T0 + 5.0
    u = fleet.last_update_s(0, clock.t_s)
    want = sum(fleet.exact_energy_j(0, u - k * 0.1 - 0.025, u - k * 0.1) for k in range(10)) / 0.25
    assert nv.nvmlDeviceGetPowerUsage(handle) == round(1000 * want)
    # The sensor sees the same phase every time, so the 1 s "average" is the low level, not the 350 W mean.
    assert nv.nvmlDeviceGetPowerUsage(handle) == pytest.approx(100_000, abs=5)  # float edges: a few mW
    assert fleet.exact_energy_j(0, u - 1.0, u) == pytest.approx(350.0)


def test_pre_volta_board_has_neither_counter_nor_instant_power() -> None:
    clock = FakeClock()
    fleet = SimulatedFleet(1, generation="p100", clock=clock)
    nv = fleet.module()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    clock.t_s = T0 + 1.0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetTotalEnergyConsumption(handle)
    (field,) = nv.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_POWER_INSTANT])
    assert field.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert 20 < nv.nvmlDeviceGetPowerUsage(handle) / 1000 < 30  # an idle 250 W board
    assert fleet.last_update_s(0, T0 + 1.0) > T0 + 1.0 - 0.02  # 20 ms refresh


def test_counter_quantum_and_custom_generation() -> None:
    from wattwatch.sim.generations import GENERATIONS, BoardGeneration

    coarse = BoardGeneration(**{**GENERATIONS["h100"].__dict__, "name": "coarse", "counter_quantum_mj": 1000})
    clock = FakeClock()
    fleet = SimulatedFleet(1, generation=coarse, clock=clock)
    nv = fleet.module()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    values = set()
    for k in range(50):
        clock.t_s = T0 + 1.0 + k * 0.1
        values.add(nv.nvmlDeviceGetTotalEnergyConsumption(handle))
    assert all(v % 1000 == 0 for v in values) and len(values) > 40
    with pytest.raises(ValueError):
        BoardGeneration("bad", "x", 100.0, 1, sampled_fraction=0.0)


def test_resume_continues_the_same_boards_in_a_new_process(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    clock = FakeClock(T0)
    first = SimulatedFleet(2, seed=3, clock=clock, truth_path=truth)
    first.set_activity(0, "training", T0 + 1.0, pid=100)
    clock.t_s = T0 + 5.0
    counter_mj = first.counter_mj(0, T0 + 5.0)
    with truth.open("a") as f:
        f.write('{"index": 0, "ki')  # the killed process was writing a line
    clock.t_s = T0 + 15.0
    again = SimulatedFleet.resume(truth, 2, seed=3, clock=clock)
    # Same "driver load": the counter kept counting through the gap, on the same update grid.
    assert again.created_s == first.created_s
    assert again.counter_mj(0, T0 + 5.0) == counter_mj
    assert again.counter_mj(0, T0 + 15.0) > counter_mj
    assert again.activity(0, T0 + 10.0) == "training" and again.pids(0, T0 + 10.0) == {100}
    again.set_activity(0, "idle", T0 + 16.0)
    replayed = SimulatedFleet.replay(truth, 2, seed=3)
    assert replayed.activity(0, T0 + 17.0) == "idle"
    assert replayed.exact_energy_j(0, T0, T0 + 20.0) == again.exact_energy_j(0, T0, T0 + 20.0)
    # Another fleet (size, seed or generation) starts afresh.
    other = SimulatedFleet.resume(truth, 3, seed=3, clock=clock)
    assert other.created_s == T0 + 15.0 and other.activity(0, T0 + 10.0) == "idle"
