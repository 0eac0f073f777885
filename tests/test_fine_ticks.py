"""The fine tick: while query spans arrive, the agent closes intervals every ``fine_interval_s`` (the NVML
counter's 0.1 s update period) instead of every ``interval_s``, and returns to the normal tick once the
spans stop for ``fine_tick_hold_s``. Real threads, a simulated GPU read through the fake NVML module."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from wattwatch.agent.options import AgentOptions
from wattwatch.agent.runner import Agent
from wattwatch.config import Settings, load_settings
from wattwatch.errors import ConfigError
from wattwatch.protocol import wire
from wattwatch.sensors.discovery import discover
from wattwatch.sim.fleet import SimulatedFleet


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def gpu0_intervals(agent: Agent) -> list[wire.Interval]:
    agent.seal()
    batches = [wire.decode_batch(body) for _, body in agent.spool.peek(limit=100_000)]
    return sorted((iv for b in batches for iv in b.intervals if iv.device == "gpu0"), key=lambda iv: iv.t_start_s)


def make_agent(tmp_path: Path, fleet: SimulatedFleet, *, hold_s: float, fine_interval_s: float = 0.1) -> Agent:
    found = discover(simulate_fleet=fleet, powercap_root=tmp_path / "no-powercap", estimate_dram=False)
    settings = Settings(home=tmp_path, collector_url="http://127.0.0.1:9", interval_s=1.0, host="h")
    options = AgentOptions(discover=False, fine_tick_hold_s=hold_s)
    return Agent(
        settings,
        found.sensors,
        gpu_processes=found.nvml,
        serve_socket=False,
        options=options,
        fine_interval_s=fine_interval_s,
    )


def test_intervals_are_fine_while_query_spans_arrive_and_normal_after_the_hold(tmp_path: Path) -> None:
    fleet = SimulatedFleet(1)
    fleet.set_activity(0, "inference", fleet.clock())
    agent = make_agent(tmp_path, fleet, hold_s=1.0)
    assert (agent.interval_s, agent.fine_interval_s, agent.fine_tick_hold_s) == (1.0, 0.1, 1.0)
    agent.start()
    try:
        assert not agent.fine_ticking
        first_s = time.time()
        while time.time() < first_s + 2.0:  # requests for 2 s, sent as they finish
            t_s = time.time()
            agent.add_spans([wire.Query(job="srv", t_start_s=t_s - 0.3, t_end_s=t_s)])
            assert agent.fine_ticking
            time.sleep(0.05)
        last_s = time.time()

        def after_the_hold(intervals: list[wire.Interval]) -> list[wire.Interval]:
            # The hold (1 s) ends 1 s after the last span; the fine interval open then closes within a fine
            # tick (0.1 s); from there on the agent ticks every interval_s. 0.2 s covers that last fine tick.
            return [iv for iv in intervals if iv.t_start_s > last_s + 1.2]

        # Wait for the intervals asserted on below: at least one closed after the hold.
        wait_for(lambda: bool(after_the_hold(gpu0_intervals(agent))))
        assert not agent.fine_ticking
        intervals = gpu0_intervals(agent)
    finally:
        agent.stop(flush_timeout_s=0.2)
    # The first spans arrive mid-tick: fine intervals from the next fine tick on until the hold ends.
    fine = [
        iv.t_end_s - iv.t_start_s for iv in intervals if first_s + 0.2 <= iv.t_start_s and iv.t_end_s <= last_s + 0.9
    ]
    print(f"\nfine: {len(fine)} intervals, median {statistics.median(fine):.3f} s, max {max(fine):.3f} s")
    assert len(fine) >= 20
    assert statistics.median(fine) == pytest.approx(0.1, abs=0.02)
    assert max(fine) <= 0.15
    # Back to the normal tick: each interval after the hold is about interval_s long.
    after = [iv.t_end_s - iv.t_start_s for iv in after_the_hold(intervals)]
    assert after and all(d > 0.8 for d in after), after


def test_step_spans_do_not_start_the_fine_tick_and_zero_turns_it_off(tmp_path: Path) -> None:
    fleet = SimulatedFleet(1)
    agent = make_agent(tmp_path / "a", fleet, hold_s=5.0)
    t_s = time.time()
    agent.add_spans([wire.Query(job="ft", t_start_s=t_s - 1, t_end_s=t_s, kind="step")])
    assert not agent.fine_ticking
    agent.add_spans([wire.Query(job="srv", t_start_s=t_s - 1, t_end_s=t_s)])
    assert agent.fine_ticking
    agent.spool.close()  # never started: nothing else to stop
    off = make_agent(tmp_path / "b", fleet, hold_s=5.0, fine_interval_s=0.0)
    off.add_spans([wire.Query(job="srv", t_start_s=t_s - 1, t_end_s=t_s)])
    assert off.fine_interval_s == 0.0 and not off.fine_ticking
    off.spool.close()


def _fine(env: dict[str, str], flags: dict[str, tuple[str, object]] | None = None) -> AgentOptions:
    return AgentOptions.from_settings(load_settings({"WATTWATCH_HOME": "/nonexistent", **env}, flags=flags))


def test_fine_interval_comes_from_the_environment_and_the_command_line() -> None:
    assert _fine({}).fine_interval_s == 0.1
    assert _fine({"WATTWATCH_FINE_INTERVAL": "0.2", "WATTWATCH_FINE_HOLD": "3"}).fine_tick_hold_s == 3.0
    flag_off = {"fine_interval_s": ("--fine-interval 0", "0")}
    assert _fine({"WATTWATCH_FINE_INTERVAL": "0.2"}, flag_off).fine_interval_s == 0.0
    with pytest.raises(ConfigError, match=r"^WATTWATCH_FINE_INTERVAL=fast is not a number; the fine tick is 0"):
        _fine({"WATTWATCH_FINE_INTERVAL": "fast"})
    for too_fine in ("0.001", "nan", "-1"):
        with pytest.raises(ConfigError, match=f"^WATTWATCH_FINE_INTERVAL={too_fine} is .*0 \\(off\\) or 0.01 to"):
            _fine({"WATTWATCH_FINE_INTERVAL": too_fine})
    assert _fine({"WATTWATCH_FINE_INTERVAL": "0.01"}).fine_interval_s == 0.01
    with pytest.raises(ConfigError, match=r"^WATTWATCH_FINE_HOLD=1e6 is out of range"):
        _fine({"WATTWATCH_FINE_HOLD": "1e6"})
