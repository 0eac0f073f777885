"""Accounting is pure arithmetic; these tests pin its invariant: energy is conserved, never negative."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wattwatch.accounting import IntervalIn, emissions_g, rollup_intervals, split_interval
from wattwatch.accounting.rollup import hour_floor_s

# Up to a petajoule per interval (a 10 MW cluster for three years), including subnormal energies.
energies_j = st.one_of(
    st.floats(min_value=0.0, max_value=1e15, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 5e-324, 1e-300, 0.1, 1.0, 1e15]),
)
weights = st.one_of(
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 5e-324, 1e-12, 1.0, 1e300, 1.7976931348623157e308]),
)
job_ids = st.text(alphabet="abcdefgh", min_size=1, max_size=4)


def assert_conserved(energy_j: float, jobs_j: dict[str, float], idle_j: float) -> None:
    assert all(part >= 0.0 for part in jobs_j.values())
    assert idle_j >= 0.0
    total_j = math.fsum([*jobs_j.values(), idle_j])
    assert total_j == pytest.approx(energy_j, rel=1e-9, abs=1e-300)
    # Plain left-to-right addition, as a SQL SUM would do it, holds to the same tolerance.
    assert sum(jobs_j.values()) + idle_j == pytest.approx(energy_j, rel=1e-9, abs=1e-300)


@given(energy_j=energies_j, shares=st.dictionaries(job_ids, weights, max_size=12), idle_weight=weights)
def test_split_conserves_energy_without_negative_parts(
    energy_j: float, shares: dict[str, float], idle_weight: float
) -> None:
    jobs_j, idle_j = split_interval(energy_j, shares, idle_weight)
    assert set(jobs_j) == set(shares)
    assert_conserved(energy_j, jobs_j, idle_j)
    if not shares:
        assert idle_j == energy_j
    elif idle_weight == 0.0:
        # A device the jobs hold completely has no idle energy: exactly zero, not a rounding crumb.
        assert idle_j == 0.0


@given(energy_j=energies_j, ids=st.sets(job_ids, min_size=1, max_size=12))
def test_all_zero_weights_split_equally(energy_j: float, ids: set[str]) -> None:
    jobs_j, idle_j = split_interval(energy_j, dict.fromkeys(ids, 0.0))
    assert idle_j == 0.0
    for part in jobs_j.values():
        assert part == pytest.approx(energy_j / len(ids), rel=1e-9, abs=1e-300)
    assert_conserved(energy_j, jobs_j, idle_j)


@given(energy_j=energies_j, shares=st.dictionaries(job_ids, weights, min_size=1, max_size=8), idle_weight=weights)
def test_split_is_proportional(energy_j: float, shares: dict[str, float], idle_weight: float) -> None:
    jobs_j, _ = split_interval(energy_j, shares, idle_weight)
    largest = max([*shares.values(), idle_weight])
    if largest == 0.0:
        return  # the equal split, tested above
    total_w = math.fsum([w / largest for w in [*shares.values(), idle_weight]])
    for job_id, weight in shares.items():
        expected_j = energy_j * (weight / largest) / total_w
        assert jobs_j[job_id] == pytest.approx(expected_j, rel=1e-9, abs=energy_j * 1e-12 + 1e-300)


def test_split_examples() -> None:
    assert split_interval(100.0, {"a": 3.0, "b": 1.0}) == ({"a": 75.0, "b": 25.0}, 0.0)
    assert split_interval(100.0, {"a": 1.0}, idle_weight=3.0) == ({"a": 25.0}, 75.0)
    assert split_interval(100.0, {}) == ({}, 100.0)
    # Jobs present but measured at zero next to a busy idle share: the idle share takes it all.
    assert split_interval(100.0, {"a": 0.0}, idle_weight=1.0) == ({"a": 0.0}, 100.0)
    assert split_interval(90.0, {"a": 0.0, "b": 0.0, "c": 0.0}) == ({"a": 30.0, "b": 30.0, "c": 30.0}, 0.0)


@pytest.mark.parametrize(
    ("energy_j", "shares", "idle_weight"),
    [(-1.0, {}, 0.0), (math.nan, {}, 0.0), (math.inf, {}, 0.0), (1.0, {"a": -1.0}, 0.0), (1.0, {"a": 1.0}, math.nan)],
)
def test_split_rejects_bad_numbers(energy_j: float, shares: dict[str, float], idle_weight: float) -> None:
    with pytest.raises(ValueError):
        split_interval(energy_j, shares, idle_weight)


def test_emissions_are_kwh_times_pue_times_intensity() -> None:
    assert emissions_g(3.6e6, 400.0, 1.5) == pytest.approx(600.0)
    assert emissions_g(0.0, 400.0, 1.2) == 0.0
    with pytest.raises(ValueError):
        emissions_g(-1.0, 400.0, 1.0)


def test_rollup_peak_is_whole_host_per_tick_and_idle_goes_to_the_start_hour() -> None:
    t0 = 7200.0 - 1.0  # the second tick starts in the next hour
    rollup = rollup_intervals(
        [
            IntervalIn("gpu0", t0, t0 + 1, 300.0, "counter", {"j": 1.0}),
            IntervalIn("gpu1", t0, t0 + 1, 200.0, "counter", {"j": 1.0}),
            IntervalIn("gpu0", t0 + 1, t0 + 3, 400.0, "counter", {"j": 1.0}),
            IntervalIn("gpu1", t0 + 1, t0 + 3, 100.0, "power", {}),
            IntervalIn("cpu0", t0, t0 + 1, 50.0, "estimate", {"j": 1.0}, idle_weight=4.0),
            IntervalIn("gpu0", t0 + 3, t0 + 3, 1.0, "counter", {"j": 1.0}),  # zero length: energy, no power
        ]
    )
    # Tick 1: 300 + 200 + 10 (cpu share) J in 1 s; tick 2: 400 J in 2 s.
    assert rollup.job_host["j"].peak_power_w == pytest.approx(510.0)
    assert rollup.job_host["j"].first_s == t0
    assert rollup.job_host["j"].last_s == t0 + 3
    assert rollup.job_device[("j", "gpu0")].energy_j == pytest.approx(701.0)
    assert rollup.job_device[("j", "gpu0")].max_power_w == pytest.approx(300.0)
    assert rollup.job_device[("j", "cpu0")].sources == {"estimate"}
    assert rollup.idle_j == {("gpu1", 7200.0): 100.0, ("cpu0", 3600.0): pytest.approx(40.0)}
    assert hour_floor_s(7199.9) == 3600.0
    assert hour_floor_s(7200.0) == 7200.0


def test_rollup_takes_no_peak_from_intervals_shorter_than_the_power_window() -> None:
    # A job boundary 20 ms before a tick: the counter's 100 ms steps make that interval's "power" noise.
    rollup = rollup_intervals(
        [
            IntervalIn("gpu0", 10.0, 10.02, 30.0, "counter", {"j": 1.0}),  # 1500 W "peak": quantisation
            IntervalIn("gpu0", 10.02, 11.02, 600.0, "counter", {"j": 1.0}),
        ]
    )
    assert rollup.job_host["j"].peak_power_w == pytest.approx(600.0)
    assert rollup.job_device[("j", "gpu0")].max_power_w == pytest.approx(600.0)
    assert rollup.job_device[("j", "gpu0")].energy_j == pytest.approx(630.0)
