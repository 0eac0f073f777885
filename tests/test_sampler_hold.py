"""The sampler holds an interval whose end reading is partly extrapolated until the next reading confirms
it, and lowers it when that reading shows the estimate overshot (``Sampler.sample``)."""

from __future__ import annotations

from collections.abc import Sequence

from wattwatch.agent.sampler import Sampler, SharesFn
from wattwatch.sensors.base import DeviceInfo, EnergyReading

GPU = DeviceInfo("gpu0", "gpu", 0, "GPU-0", "test board", 700.0)


class ScriptedSensor:
    """Readings given in advance: (t_s, energy_j, extrapolated_j) per read, tick or boundary alike; None:
    the read gives no reading for the GPU (a failed read)."""

    name = "scripted"

    def __init__(self, script: Sequence[tuple[float, float, float] | None]) -> None:
        self.script = list(script)

    def devices(self) -> Sequence[DeviceInfo]:
        return [GPU]

    def _next(self) -> list[EnergyReading]:
        step = self.script.pop(0)
        if step is None:
            return []
        t_s, energy_j, extrapolated_j = step
        return [EnergyReading("gpu0", t_s, energy_j, "counter", extrapolated_j=extrapolated_j)]

    def read(self) -> list[EnergyReading]:
        return self._next()

    def read_at(self, t_s: float) -> list[EnergyReading]:
        return self._next()


def owner(name: str) -> SharesFn:
    def shares(device: DeviceInfo, start_s: float, end_s: float) -> tuple[dict[str, float], float]:
        return {name: 1.0}, 0.0

    return shares


def test_an_overshooting_tick_is_lowered_by_the_boundary_read_after_it() -> None:
    # Tick at 2.0 extrapolated 30 J past the counter; the boundary read at 2.1 (the job's end) finds only
    # 130 J: the tick overshot by 20 J, which must stay out of the interval after it.
    sensor = ScriptedSensor([(1.0, 100.0, 0.0), (2.0, 150.0, 30.0), (2.1, 130.0, 0.0), (3.0, 200.0, 0.0)])
    sampler = Sampler([sensor])
    assert sampler.sample(owner("a")) == []  # the baseline
    assert sampler.sample(owner("job")) == []  # held: its end is partly an estimate
    closed = sampler.sample(owner("job"), at_s=2.1)
    assert [(iv.t_start_s, iv.t_end_s) for iv in closed] == [(1.0, 2.0), (2.0, 2.1)]
    assert [iv.energy_j for iv in closed] == [30.0, 0.0]  # lowered, not the next one raised
    assert all(iv.shares == {"job": 1.0} for iv in closed)
    after = sampler.sample(owner("next"), final=True)
    assert [iv.energy_j for iv in after] == [70.0]  # what the next owner drew, nothing owed
    assert sampler.marks()["gpu0"].energy_j == 200.0


def test_a_tick_is_lowered_no_further_than_its_estimate_and_released_by_the_next() -> None:
    # The tick's extrapolated part is 10 J; a reading 40 J lower cannot take more than that back.
    sensor = ScriptedSensor([(1.0, 100.0, 0.0), (2.0, 150.0, 10.0), (3.0, 110.0, 0.0), (4.0, 170.0, 5.0)])
    sampler = Sampler([sensor])
    sampler.sample(owner("a"))
    assert sampler.sample(owner("a")) == []
    closed = sampler.sample(owner("a"))  # a tick releases the held interval and closes its own
    assert [iv.energy_j for iv in closed] == [40.0, 0.0]
    assert sampler.sample(owner("a")) == []  # held again
    assert [iv.energy_j for iv in sampler.flush()] == [30.0]
    assert sampler.flush() == []


def test_what_was_sent_is_never_lowered_and_a_gpu_without_a_reading_releases_what_it_held() -> None:
    # 110 J at 2.0 is partly an estimate (10 J) and held; the next read gives nothing for the GPU: the held
    # interval goes out as it is (what is held is not in the restart checkpoint), and is final. The next
    # reading, lower, cannot take it back: the sum stays the counter's, never more.
    sensor = ScriptedSensor([(1.0, 0.0, 0.0), (2.0, 110.0, 10.0), None, (3.0, 103.0, 0.0), (4.0, 150.0, 0.0)])
    sampler = Sampler([sensor])
    sampler.sample(owner("a"))
    assert sampler.sample(owner("a")) == []
    released = sampler.sample(owner("a"))
    assert [iv.energy_j for iv in released] == [110.0]
    assert sampler.settled_t_s == 2.0
    rest = sampler.sample(owner("a")) + sampler.sample(owner("a"), final=True)
    assert [iv.energy_j for iv in rest] == [0.0, 40.0]
    assert sum(iv.energy_j for iv in released + rest) == 150.0  # the last reading: nothing counted twice


def test_a_first_reading_is_never_lowered() -> None:
    # After a restart the gap up to the first reading is already sent: its estimate stands.
    sensor = ScriptedSensor([(1.0, 100.0, 20.0), (2.0, 90.0, 0.0), (3.0, 130.0, 0.0)])
    sampler = Sampler([sensor])
    sampler.sample(owner("a"))
    closed = sampler.sample(owner("a")) + sampler.sample(owner("a"), final=True)
    assert [iv.energy_j for iv in closed] == [0.0, 30.0]
    assert sampler.marks()["gpu0"].energy_j == 130.0
