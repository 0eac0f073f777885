"""Idle GPU intervals held for a job that NVML lists late, and given to it when a tick finds it
(``agent.backfill``); the agent-level effect is measured by ``benchmarks/timing_sweep.py`` (its test is
in test_nvml_timing.py)."""

from __future__ import annotations

from wattwatch.agent.backfill import Backfill
from wattwatch.protocol import wire

GPUS = frozenset({"gpu0", "gpu1"})


def iv(device: str, start_s: float, end_s: float, energy_j: float = 10.0, **shares: float) -> wire.Interval:
    return wire.Interval(
        device=device, t_start_s=start_s, t_end_s=end_s, energy_j=energy_j, source="counter", shares=shares
    )


def test_idle_intervals_in_a_waiting_jobs_window_become_its_own_once_a_tick_finds_it() -> None:
    fill = Backfill(wait_s=5.0)
    before = fill.take([iv("gpu0", 9.0, 10.0), iv("gpu1", 9.0, 10.0)], GPUS)
    assert len(before) == 2  # nothing waits yet: sent as they are
    fill.expect("job", 10.0, {42})
    assert fill.take([iv("gpu0", 10.0, 11.0), iv("gpu1", 10.0, 11.0), iv("cpu0", 10.0, 11.0)], GPUS) == [
        iv("cpu0", 10.0, 11.0)
    ]
    # A tick sees pid 43 (a child of 42) on gpu1: gpu1's held interval is the job's, gpu0's goes out idle.
    assert fill.seen({43: ((43, 42, 1), frozenset({"gpu1"}))}, {}) == ["job"]
    out = fill.release(11.0)
    assert {(i.device, tuple(i.shares)) for i in out} == {("gpu0", ()), ("gpu1", ("job",))}
    # What reaches it later within the window (the sampler holds a tick's interval a reading) is its too;
    # after its end, or on another GPU, it is not.
    fill.ended("job", 11.5)
    late = fill.take([iv("gpu1", 11.0, 11.5), iv("gpu1", 11.5, 12.0), iv("gpu0", 11.0, 11.5)], GPUS)
    assert [tuple(i.shares) for i in late] == [("job",), (), ()]
    assert fill.flush() == []


def test_held_intervals_go_out_in_order_when_the_wait_is_over_and_held_ones_are_never_reordered() -> None:
    fill = Backfill(wait_s=2.0)
    fill.expect("job", 0.0, {7})
    assert fill.take([iv("gpu0", 0.0, 1.0)], GPUS) == []
    # A later interval someone holds waits behind the idle one on the same GPU.
    assert fill.take([iv("gpu0", 1.0, 2.0, other=1.0)], GPUS) == []
    assert fill.release(1.5) == []  # the job may still be found
    out = fill.release(2.5)  # it was not: everything leaves as it was, in order
    assert [(i.t_start_s, dict(i.shares)) for i in out] == [(0.0, {}), (1.0, {"other": 1.0})]
    assert fill.waiting == frozenset()


def test_a_job_without_pids_or_found_at_once_holds_nothing_and_intervals_outside_its_window_pass() -> None:
    fill = Backfill()
    fill.expect("no-pids", 0.0, set())
    assert len(fill.take([iv("gpu0", 0.0, 1.0)], GPUS)) == 1
    fill.expect("job", 5.0, {1})
    assert len(fill.take([iv("gpu0", 4.0, 5.0), iv("gpu0", 5.0, 6.0, held=1.0)], GPUS)) == 2
    assert len(fill.take([iv("gpu0", 6.0, 7.0)], GPUS)) == 0
    assert [tuple(i.shares) for i in fill.flush()] == [()]


def test_a_process_belongs_to_the_nearest_job_root_in_its_lineage() -> None:
    # `wattwatch run` (root 100, waiting) runs a script that opens an SDK job (root 200, waiting too); the
    # GPU process 300 is the inner job's, as the tracker would decide: the outer one gets nothing.
    fill = Backfill()
    fill.expect("outer", 0.0, {100})
    fill.expect("inner", 0.5, {200})
    assert fill.take([iv("gpu0", 0.5, 1.0)], GPUS) == []
    assert fill.seen({300: ((300, 200, 100, 1), frozenset({"gpu0"}))}, {}) == ["inner"]
    assert [dict(i.shares) for i in fill.release(1.0)] == [{"inner": 1.0}]
    # A running explicit job nearer than a waiting one keeps the process (it is that job's already).
    fill.expect("far", 2.0, {1})
    assert fill.take([iv("gpu1", 2.0, 3.0)], GPUS) == []
    assert fill.seen({400: ((400, 50, 1), frozenset({"gpu1"}))}, {50: "near"}) == []
