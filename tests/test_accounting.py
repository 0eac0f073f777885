"""Accounting is pure arithmetic; these tests pin its invariant: energy is conserved, never negative."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wattwatch.accounting import IntervalIn, emissions_g, rollup_intervals, split_interval
from wattwatch.accounting.quantiles import EnergySketch, nearest_rank
from wattwatch.accounting.rollup import hour_floor_s, recent_power
from wattwatch.accounting.spans import EnergySplit, split_job_energy

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
    # The job's timeline for per-span energy: one entry per tick, summed over the host's devices.
    assert rollup.job_ticks_j == {
        ("j", t0, t0 + 1): pytest.approx(510.0),
        ("j", t0 + 1, t0 + 3): 400.0,
        ("j", t0 + 3, t0 + 3): 1.0,
    }
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
    # Both intervals start in the same 1 s window: 630 J over 1.02 s, not 1500 W.
    assert rollup.job_host["j"].peak_power_w == pytest.approx(630.0 / 1.02)
    assert rollup.job_device[("j", "gpu0")].max_power_w == pytest.approx(630.0 / 1.02)
    assert rollup.job_device[("j", "gpu0")].energy_j == pytest.approx(630.0)


def test_rollup_peak_from_fine_ticks_adds_them_up_per_window() -> None:
    # 0.1 s ticks while requests flow: no single interval is long enough, their 1 s windows are.
    ivs = [
        IntervalIn("gpu0", 20.0 + k / 10, 20.1 + k / 10, 40.0 + (20.0 if k >= 10 else 0.0), "counter", {"j": 1.0})
        for k in range(20)
    ]
    ivs += [IntervalIn("gpu1", 20.0 + k / 10, 20.1 + k / 10, 30.0, "counter", {"j": 1.0}) for k in range(20)]
    rollup = rollup_intervals(ivs)
    assert rollup.job_host["j"].peak_power_w == pytest.approx(600.0 + 300.0)  # second window, both GPUs
    assert rollup.job_device[("j", "gpu0")].max_power_w == pytest.approx(600.0)
    assert rollup.job_device[("j", "gpu1")].max_power_w == pytest.approx(300.0)


# --- per-span energy (accounting.spans) and quantiles ---------------------------------------------------


def test_split_job_energy_shares_each_instant_among_spans_in_flight() -> None:
    # 10 W for 10 s. A alone on [0, 2), A and B on [2, 5), B alone on [5, 6), nobody on [6, 10).
    split = split_job_energy([(0.0, 10.0, 100.0)], [(0.0, 5.0), (2.0, 6.0)])
    assert split.span_energy_j == [35.0, 25.0]
    assert (split.waiting_energy_j, split.energy_j) == (40.0, 100.0)


def test_split_job_energy_overlapping_ticks_add_their_power() -> None:
    # Two hosts of one job with different tick bounds: 10 W on [0, 4) plus 20 W on [1, 3).
    split = split_job_energy([(0.0, 4.0, 40.0), (1.0, 3.0, 40.0)], [(0.5, 2.0)])
    assert split.span_energy_j == [pytest.approx(5.0 + 30.0)]
    assert split.waiting_energy_j == pytest.approx(45.0)


def test_split_job_energy_window_points_and_buckets() -> None:
    # Window [1, 8): 70 J of the 10 W tick plus a 7 J point at t=3 shared by A and B; a zero-length span
    # gets nothing; waiting is [6, 8), all in the bucket starting at 6.
    split = split_job_energy(
        [(0.0, 10.0, 100.0), (3.0, 3.0, 7.0)],
        [(0.0, 5.0), (2.0, 6.0), (3.0, 3.0)],
        window_start_s=1.0,
        window_end_s=8.0,
        bucket_s=2.0,
    )
    assert split.span_energy_j == [28.5, 28.5, 0.0]
    assert (split.waiting_energy_j, split.energy_j) == (20.0, 77.0)
    assert split.waiting_by_bucket_j == {6.0: 20.0}


def test_split_job_energy_point_at_a_span_boundary_goes_to_the_span_that_starts() -> None:
    # Spans are in flight on [start, end): at t=2, A has ended and B has begun.
    split = split_job_energy([(2.0, 2.0, 6.0)], [(0.0, 2.0), (2.0, 4.0)])
    assert split.span_energy_j == [0.0, 6.0]
    assert split_job_energy([(4.0, 4.0, 6.0)], [(0.0, 2.0), (2.0, 4.0)]).waiting_energy_j == 6.0


def test_split_job_energy_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="span 0 ends"):
        split_job_energy([], [(2.0, 1.0)])
    with pytest.raises(ValueError, match="tick"):
        split_job_energy([(0.0, 1.0, -1.0)], [])
    with pytest.raises(ValueError, match="window"):
        split_job_energy([], [], window_start_s=2.0, window_end_s=1.0)
    assert split_job_energy([], []) == EnergySplit([], 0.0, 0.0, {})


@given(
    values=st.lists(
        st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=1e9, allow_nan=False)), min_size=1, max_size=300
    ),
    q=st.sampled_from([0.01, 0.5, 0.95, 1.0]),
)
def test_sketch_quantiles_are_within_its_relative_accuracy(values: list[float], q: float) -> None:
    sketch = EnergySketch()
    for v in values:
        sketch.add(v)
    exact = nearest_rank(values, q)
    assert exact is not None
    # At most the accuracy; exactly it (up to rounding) for a value on a bucket's upper edge, such as 1.0.
    assert sketch.quantile(q) == pytest.approx(exact, rel=sketch.relative_accuracy * (1 + 1e-9), abs=0.0)
    # Round trip through JSON, then take every value back out: empty again.
    again = EnergySketch.from_json(json.loads(json.dumps(sketch.to_json())))
    for v in values:
        again.remove(v)
    assert again.count == 0 and again.quantile(0.5) is None


def test_sketch_merges_its_lowest_buckets_past_the_cap() -> None:
    sketch = EnergySketch(0.01, max_buckets=8)
    values = [1.5**k for k in range(40)]
    for v in values:
        sketch.add(v)
    assert len(sketch.buckets) == 8 and sketch.count == 40
    # High quantiles stay accurate; a value added before the merge can still be taken out.
    assert sketch.quantile(0.95) == pytest.approx(nearest_rank(values, 0.95), rel=0.01)
    sketch.remove(values[0])
    assert sketch.count == 39
    with pytest.raises(ValueError):
        EnergySketch().remove(1.0)
    with pytest.raises(ValueError):
        EnergySketch().add(-1.0)
    assert nearest_rank([], 0.5) is None


def test_recent_power_is_the_latest_second_of_ticks() -> None:
    # 0.1 s ticks: 2 s at 100 W, then 1 s at 500 W; power now is the last second's, not the average.
    ticks = [(t / 10, (t + 1) / 10, 10.0) for t in range(20)] + [(t / 10, (t + 1) / 10, 50.0) for t in range(20, 30)]
    power_w, end_s = recent_power(reversed(ticks))
    assert power_w == pytest.approx(500.0) and end_s == pytest.approx(3.0)
    # Fewer ticks than a second: their own span. No time at all: unknown.
    assert recent_power([(0.0, 0.4, 40.0)]) == (pytest.approx(100.0), 0.4)
    assert recent_power([]) is None


def test_power_now_sums_each_devices_latest_second_when_reads_do_not_line_up() -> None:
    """A GPU read on whole seconds and a CPU package read 0.3 s later, holding a sliver of the job: the
    job's power now is the GPU's 600 W plus the CPU's share, not the CPU's last second alone."""
    gpu = [IntervalIn("gpu0", t, t + 1.0, 600.0, "counter", {"job": 1.0}) for t in (0.0, 1.0, 2.0)]
    cpu = [
        IntervalIn("cpu0", t + 0.3, t + 1.3, 100.0, "counter", {"job": 1.0}, idle_weight=999.0) for t in (0.0, 1.0, 2.0)
    ]
    out = rollup_intervals([*gpu, *cpu])
    jh = out.job_host["job"]
    assert jh.recent_power_w == pytest.approx(600.0 + 100.0 / 1000.0)
    assert jh.recent_at_s == 3.3


def _rollup_by_dicts(ivs: list[IntervalIn]) -> dict[str, object]:
    """The rollup's windows, ticks and spans the plain way: a dict entry per key, parts added in arrival
    order (what rollup_intervals' runs of consecutive parts must equal, whatever the order)."""
    dev_w: dict[tuple[str, str, int], list[float]] = {}
    host_w: dict[tuple[str, int], list[float]] = {}
    ticks: dict[tuple[str, float, float], float] = {}
    span: dict[str, tuple[float, float]] = {}
    for iv in ivs:
        jobs_j, _ = split_interval(iv.energy_j, iv.shares, iv.idle_weight)
        for job, part_j in jobs_j.items():
            b = math.floor(iv.t_start_s)
            for w in (
                dev_w.setdefault((job, iv.device, b), [0.0, math.inf, -math.inf]),
                host_w.setdefault((job, b), [0.0, math.inf, -math.inf]),
            ):
                w[0] += part_j
                w[1], w[2] = min(w[1], iv.t_start_s), max(w[2], iv.t_end_s)
            ticks[(job, iv.t_start_s, iv.t_end_s)] = ticks.get((job, iv.t_start_s, iv.t_end_s), 0.0) + part_j
            first, last = span.get(job, (math.inf, -math.inf))
            span[job] = (min(first, iv.t_start_s), max(last, iv.t_end_s))

    def peak(windows: dict[Any, list[float]], key: Any) -> float:
        powers = [w[0] / (w[2] - w[1]) for k, w in windows.items() if k[:-1] == key and w[2] - w[1] >= 0.5]
        return max([0.0, *powers])

    return {
        "ticks": ticks,
        "device_peaks": {(j, d): peak(dev_w, (j, d)) for (j, d, _) in dev_w},
        "host_peaks": {j: peak(host_w, (j,)) for (j, _) in host_w},
        "spans": span,
    }


@given(st.randoms(use_true_random=False), st.sampled_from(["ticks", "devices", "shuffled"]))
def test_rollup_runs_equal_plain_sums_in_any_order(rng: Any, order: str) -> None:
    """The rollup sums each window and tick as a run of consecutive parts; parts that come back to a window
    or tick seen before (batches in device order, or shuffled) are added up by key instead: the same
    totals to the bit either way."""
    ivs = []
    for i in range(rng.randint(1, 12)):
        for dev in ("gpu0", "gpu1", "cpu0"):
            t0 = 3599.0 + i * rng.choice([0.25, 1.0, 2.0]) + (0.3 if dev == "cpu0" else 0.0)
            shares = rng.choice([{}, {"a": 1.0}, {"b": 2.0}, {"a": 1.0, "b": 0.5}, {"a": 0.0, "b": 1.0}])
            ivs.append(
                IntervalIn(
                    dev,
                    t0,
                    t0 + rng.choice([0.0, 0.25, 1.0]),
                    rng.uniform(0, 700),
                    "counter",
                    shares,
                    rng.choice([0.0, 1.0]),
                )
            )
    if order == "devices":
        ivs.sort(key=lambda iv: iv.device)
    elif order == "shuffled":
        rng.shuffle(ivs)
    out = rollup_intervals(ivs)
    want = _rollup_by_dicts(ivs)
    assert out.job_ticks_j == want["ticks"]
    assert {k: t.max_power_w for k, t in out.job_device.items()} == want["device_peaks"]
    assert {j: t.peak_power_w for j, t in out.job_host.items()} == want["host_peaks"]
    assert {j: (t.first_s, t.last_s) for j, t in out.job_host.items()} == want["spans"]
