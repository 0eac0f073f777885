"""The simulator's hardware flaws, each observed through the fake pynvml API exactly as configured."""

from __future__ import annotations

import math
import statistics
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pynvml
import pytest

from wattwatch.config import Settings
from wattwatch.sim.clock import FakeClock
from wattwatch.sim.flaws import PRESETS, Flaws, parse_flaws
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.standalone import SimulatedWorkload, build_agent

T0 = 1_700_000_000.0


def rig(n: int = 1, seed: int = 1, **flaws: Any) -> tuple[SimulatedFleet, FakeClock, Any]:
    clock = FakeClock(T0)
    fleet = SimulatedFleet(n, seed=seed, clock=clock, flaws=Flaws(**flaws))
    nv = fleet.module()
    nv.nvmlInit()
    return fleet, clock, nv


def counter_changes(nv: Any, handle: Any, clock: FakeClock, seconds: float, step_s: float = 0.0005) -> list[float]:
    """The instants (on ``step_s`` polls) at which the energy counter moved."""
    changes, last = [], None
    for _ in range(round(seconds / step_s)):
        clock.t_s += step_s
        value = nv.nvmlDeviceGetTotalEnergyConsumption(handle)
        if last is not None and value != last:
            changes.append(clock.t_s)
        last = value
    return changes


# -- refresh period ---------------------------------------------------------------------------------


def test_the_counter_moves_on_the_configured_refresh_grid() -> None:
    fleet, clock, nv = rig(refresh_period_s=(0.02, 0.02))
    fleet.set_activity(0, "training", T0 + 0.1)
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    clock.t_s = T0 + 0.2
    changes = counter_changes(nv, handle, clock, 1.0)
    gaps = [b - a for a, b in pairwise(changes)]
    assert len(changes) in (49, 50)
    assert all(abs(g - 0.020) <= 0.0005 + 1e-6 for g in gaps)
    # The power readings refresh on the same grid: the 1 s average changes exactly when the counter does.
    assert fleet.refresh_period_s(0) == 0.02


def test_each_board_draws_its_own_period_from_the_range_in_whole_ms() -> None:
    fleet, clock, nv = rig(n=6, refresh_period_s=(0.010, 0.200), seed=4)
    periods = [fleet.refresh_period_s(i) for i in range(6)]
    assert all(0.010 <= p <= 0.200 for p in periods)
    assert all(abs(p * 1000 - round(p * 1000)) < 1e-9 for p in periods)
    assert len(set(periods)) >= 4  # boards differ
    # Same seed and flaws, same periods; another flaws seed, other periods.
    assert [SimulatedFleet(6, seed=4, clock=clock, flaws=fleet.flaws).refresh_period_s(i) for i in range(6)] == periods
    other = SimulatedFleet(6, seed=4, clock=clock, flaws=Flaws(refresh_period_s=(0.010, 0.200), seed=9))
    assert [other.refresh_period_s(i) for i in range(6)] != periods
    # What a reader sees through NVML is each board's own period.
    for i in (0, 1, 2):
        fleet.set_activity(i, "training", T0 + 0.1)
        handle = nv.nvmlDeviceGetHandleByIndex(i)
        clock.t_s = T0 + 0.5
        changes = counter_changes(nv, handle, clock, max(1.0, 6 * periods[i]), step_s=0.001)
        gaps = [b - a for a, b in pairwise(changes)]
        assert gaps and all(abs(g - periods[i]) <= 0.001 + 1e-6 for g in gaps), (i, periods[i], gaps)


def test_without_the_flaw_the_generation_period_applies() -> None:
    fleet, _, _ = rig(n=2)
    assert [fleet.refresh_period_s(i) for i in range(2)] == [fleet.generation.update_period_s] * 2


# -- noise ------------------------------------------------------------------------------------------


def test_instant_power_is_truth_plus_the_configured_noise_and_the_counter_stays_exact() -> None:
    noisy, clock, nv = rig(seed=2, power_noise_w=8.0)
    ideal = SimulatedFleet(1, seed=2, clock=clock)  # the same board without the flaw, on the same clock
    nv_ideal = ideal.module()
    nv_ideal.nvmlInit()
    for fleet in (noisy, ideal):
        fleet.set_activity(0, "training", T0 + 0.5)
    h, h_ideal = nv.nvmlDeviceGetHandleByIndex(0), nv_ideal.nvmlDeviceGetHandleByIndex(0)
    field = pynvml.NVML_FI_DEV_POWER_INSTANT
    errors_w, counters = [], []
    for k in range(4000):  # one read per 10 ms slot, 40 s
        clock.t_s = T0 + 1.0 + 0.01 * k + 0.0037
        (reading,) = nv.nvmlDeviceGetFieldValues(h, [field])
        errors_w.append(reading.value.uiVal / 1000 - noisy.power_w(0, clock.t_s))
        if k % 50 == 0:
            counters.append(
                (nv.nvmlDeviceGetTotalEnergyConsumption(h), nv_ideal.nvmlDeviceGetTotalEnergyConsumption(h_ideal))
            )
    assert statistics.pstdev(errors_w) == pytest.approx(8.0, rel=0.05)
    assert abs(statistics.fmean(errors_w)) < 0.5
    assert max(abs(e) for e in errors_w) < 8.0 * 6
    # Two reads in the same 10 ms slot see the same sample.
    (again,) = nv.nvmlDeviceGetFieldValues(h, [field])
    assert again.value.uiVal / 1000 - noisy.power_w(0, clock.t_s) == pytest.approx(errors_w[-1], abs=1e-9)
    # The counter is the truth the hardware accumulates: identical to the ideal board's, floor of the integral.
    assert all(a == b for a, b in counters)
    u = noisy.last_update_s(0, clock.t_s)
    counter_mj = nv.nvmlDeviceGetTotalEnergyConsumption(h)
    assert abs(counter_mj - math.floor(1000 * noisy.exact_energy_j(0, noisy.created_s, u))) <= 1
    assert noisy.exact_energy_j(0, T0, T0 + 30) == ideal.exact_energy_j(0, T0, T0 + 30)


def test_the_average_reading_carries_the_noise_of_a_mean() -> None:
    fleet, clock, nv = rig(seed=3, power_noise_w=10.0, refresh_period_s=(0.1, 0.1))
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    errors_w = []
    for k in range(3000):  # one read per refresh: each a new reading
        clock.t_s = T0 + 2.0 + 0.1 * k
        u = fleet.last_update_s(0, clock.t_s)
        errors_w.append(nv.nvmlDeviceGetPowerUsage(handle) / 1000 - fleet.exact_energy_j(0, u - 1.0, u))
    assert statistics.pstdev(errors_w) == pytest.approx(10.0 / math.sqrt(10), rel=0.07)


# -- call latency -----------------------------------------------------------------------------------


def test_every_call_costs_the_configured_latency_on_the_fake_clock() -> None:
    fleet, clock, nv = rig(call_latency_s=0.0005)
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    field = pynvml.NVML_FI_DEV_POWER_INSTANT
    for call in (
        lambda: nv.nvmlDeviceGetTotalEnergyConsumption(handle),
        lambda: nv.nvmlDeviceGetPowerUsage(handle),
        lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle),
        lambda: nv.nvmlDeviceGetHandleByUUID(fleet.uuid(0)),
    ):
        before = clock.t_s
        call()
        assert clock.t_s - before == pytest.approx(0.0005, abs=1e-6)
    # The value is read inside the call, not at its start or end.
    stamps = []
    for _ in range(200):
        before = clock.t_s
        (reading,) = nv.nvmlDeviceGetFieldValues(handle, [field])
        stamps.append((reading.timestamp / 1e6 - before) / (clock.t_s - before))
    assert 0.0 <= min(stamps) < 0.1 and 0.9 < max(stamps) <= 1.0
    # A failing call costs its time too.
    fleet.lose(0)
    before = clock.t_s
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetPowerUsage(handle)
    assert clock.t_s - before == pytest.approx(0.0005, abs=1e-6)


def test_call_jitter_is_a_seeded_tail_above_the_latency() -> None:
    _, clock, nv = rig(call_latency_s=0.0003, call_jitter_s=0.0002)
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    costs = []
    for _ in range(5000):
        before = clock.t_s
        nv.nvmlDeviceGetTotalEnergyConsumption(handle)
        costs.append(clock.t_s - before)
    tick = 1e-6  # the fake clock's float resolution near 1.7e9 s is 0.24 us
    assert min(costs) >= 0.0003 - tick
    assert statistics.fmean(costs) == pytest.approx(0.0005, rel=0.05)
    assert statistics.pstdev(costs) == pytest.approx(0.0002, rel=0.1)
    assert max(costs) <= 0.0003 + 10 * 0.0002 + tick


def test_in_real_time_a_call_really_takes_its_latency() -> None:
    fleet = SimulatedFleet(1, flaws=Flaws(call_latency_s=0.02))  # real clock: the call sleeps
    nv = fleet.module()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    began = time.perf_counter()
    nv.nvmlDeviceGetTotalEnergyConsumption(handle)
    assert time.perf_counter() - began >= 0.02 - 0.001  # sleep's own rounding


def test_a_custom_clock_without_sleep_cannot_take_latency() -> None:
    with pytest.raises(ValueError, match="sleep="):
        SimulatedFleet(1, clock=lambda: T0, flaws=Flaws(call_latency_s=0.001))
    fleet = SimulatedFleet(1, clock=lambda: T0, flaws=Flaws(call_latency_s=0.001), sleep=lambda s: None)
    assert fleet.flaws.call_latency_s == 0.001


# -- process-list delay -----------------------------------------------------------------------------


def test_a_new_process_is_listed_only_after_the_delay() -> None:
    fleet, clock, nv = rig(process_delay_s=(1.5, 1.5))
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    fleet.set_activity(0, "training", T0 + 1.0, pid=77)
    fleet.set_process_utilization(0, 77, 60.0, T0 + 1.0)
    clock.t_s = T0 + 2.49
    assert nv.nvmlDeviceGetComputeRunningProcesses(handle) == []
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetProcessUtilization(handle, int((T0 + 0.5) * 1e6))
    clock.t_s = T0 + 2.51
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)] == [77]
    clock.t_s = T0 + 4.0
    samples = nv.nvmlDeviceGetProcessUtilization(handle, int((T0 + 0.5) * 1e6))
    stamps = sorted(s.timeStamp / 1e6 for s in samples)
    assert stamps[0] >= T0 + 2.5 and stamps[0] < T0 + 2.5 + fleet.process_sample_period_s
    assert {s.smUtil for s in samples} == {60}
    # Known to NVML now: after leaving and coming back it is listed at once.
    fleet.set_activity(0, "idle", T0 + 4.5, pid=77)
    fleet.set_activity(0, "inference", T0 + 6.0, pid=77)
    clock.t_s = T0 + 6.01
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)] == [77]


def test_process_delays_are_drawn_per_process_within_the_range() -> None:
    fleet, _, _ = rig(process_delay_s=(0.5, 2.0))
    for pid in range(100, 140):
        fleet.set_activity(0, "training", T0 + 1.0, pid=pid)
    delays = [fleet.visible_from_s(0, pid) - (T0 + 1.0) for pid in range(100, 140)]
    assert all(0.5 <= d <= 2.0 for d in delays) and statistics.pstdev(delays) > 0.2
    assert fleet.visible_from_s(0, 999) == math.inf  # never ran


def test_process_sample_period_is_configurable() -> None:
    fleet, clock, nv = rig(process_sample_period_s=0.05)
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    fleet.set_process_utilization(0, 5, 40.0, T0 + 1.0)
    clock.t_s = T0 + 2.0
    stamps = sorted(s.timeStamp for s in nv.nvmlDeviceGetProcessUtilization(handle, int((T0 + 1.2) * 1e6)))
    assert {round(b - a) for a, b in pairwise(stamps)} <= {50_000, 49_999, 50_001}
    assert len(stamps) in (15, 16)


# -- workload lag -----------------------------------------------------------------------------------


def test_a_jobs_load_starts_and_ends_off_its_boundaries_by_the_drawn_lag() -> None:
    fleet, clock, nv = rig(start_lag_s=(0.3, 0.3), end_lag_s=(-0.2, -0.2))
    workload = SimulatedWorkload(fleet)
    workload.job_started("job-1", "training", ["gpu0"], 42, T0 + 1.0)
    workload.job_ended("job-1", T0 + 3.0)
    assert fleet.activity(0, T0 + 1.29) == "idle" and fleet.activity(0, T0 + 1.31) == "training"
    assert fleet.activity(0, T0 + 2.79) == "training" and fleet.activity(0, T0 + 2.81) == "idle"
    # Seen through NVML: the instant power stays idle until the load really starts.
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    field = pynvml.NVML_FI_DEV_POWER_INSTANT
    clock.t_s = T0 + 1.25
    assert nv.nvmlDeviceGetFieldValues(handle, [field])[0].value.uiVal < 100_000
    clock.t_s = T0 + 1.35
    assert nv.nvmlDeviceGetFieldValues(handle, [field])[0].value.uiVal > 150_000


def test_workload_lags_are_drawn_per_job_and_reproducible() -> None:
    flaws = Flaws(start_lag_s=(0.002, 1.0), end_lag_s=(-0.1, 0.1), seed=5)
    starts = [flaws.lag_s(f"job-{k}", "start") for k in range(200)]
    ends = [flaws.lag_s(f"job-{k}", "end") for k in range(200)]
    assert all(0.002 <= s <= 1.0 for s in starts) and all(-0.1 <= e <= 0.1 for e in ends)
    assert min(ends) < 0 < max(ends)
    assert starts == [Flaws(start_lag_s=(0.002, 1.0), seed=5).lag_s(f"job-{k}", "start") for k in range(200)]
    assert Flaws().lag_s("job-1", "start") == 0.0
    with pytest.raises(ValueError):
        flaws.lag_s("job-1", "middle")


# -- presets, parsing, identity ---------------------------------------------------------------------


def test_presets_and_specs() -> None:
    assert parse_flaws("none").ideal and Flaws().ideal and not PRESETS["realistic"].ideal
    realistic = parse_flaws("realistic")
    assert realistic == PRESETS["realistic"]
    assert realistic.refresh_period_s == (0.010, 0.200)
    tuned = parse_flaws("realistic, refresh_ms=20, noise_w=2.5, process_delay_s=0.5:2, end_lag_s=-0.1:0.05, seed=3")
    assert tuned.refresh_period_s == pytest.approx((0.02, 0.02))
    assert (tuned.power_noise_w, tuned.process_delay_s, tuned.end_lag_s, tuned.seed) == (
        2.5,
        (0.5, 2.0),
        (-0.1, 0.05),
        3,
    )
    assert tuned.call_latency_s == realistic.call_latency_s
    assert "refresh 20 ms" in tuned.describe() and "noise 2.5 W" in tuned.describe()
    for bad, needle in [
        ("fancy", "preset"),
        ("loudness=3", "unknown simulator flaw"),
        ("noise_w=loud", "a number"),
        ("refresh_ms=0.1", "refresh_period_s"),
        ("start_lag_s=-1", "start_lag_s"),
        ("latency_ms=5000", "hang"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_flaws(bad)
    assert Flaws.from_dict(realistic.as_dict()) == realistic


def test_a_fleet_resumes_only_with_the_same_flaws(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    clock = FakeClock(T0)
    first = SimulatedFleet(1, clock=clock, truth_path=truth, flaws="refresh_ms=20")
    first.set_activity(0, "training", T0 + 1.0, pid=3)
    clock.t_s = T0 + 10.0
    same = SimulatedFleet.resume(truth, 1, clock=clock, flaws="refresh_ms=20")
    assert same.created_s == T0 and same.refresh_period_s(0) == 0.02
    other = SimulatedFleet.resume(truth, 1, clock=clock, flaws="refresh_ms=50")
    assert other.created_s == T0 + 10.0 and other.activity(0, T0 + 5.0) == "idle"


def test_an_agent_built_with_flaws_reads_a_fleet_that_has_them(tmp_path: Path) -> None:
    parts = build_agent(Settings(home=tmp_path), simulate=2, flaws=parse_flaws("realistic,seed=4"))
    try:
        fleet = parts.fleet
        assert fleet.flaws == parse_flaws("realistic,seed=4")
        assert all(0.010 <= fleet.refresh_period_s(i) <= 0.200 for i in range(2))
        assert {"gpu0", "gpu1"} <= set(parts.agent.sampler.devices)
    finally:
        parts.agent.spool.close()  # built, never started: nothing else to stop
