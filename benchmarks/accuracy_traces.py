"""The workloads of the accuracy benchmark, played on a simulated GPU with a fake clock.

A trace is a list of jobs on one simulated board: each job runs an activity (training, inference or
an exact square wave) from its start to its end, with the board idle in between, so every boundary
is also a change of load, the hardest moment for a measurement. All activity (and any counter reset)
is scheduled before anything reads the board, so every method measuring the trace afterwards sees
the very same power, and ``exact_j`` is the integral they are all judged against.
"""

from __future__ import annotations

from dataclasses import dataclass

from wattwatch.sim.fleet import SimulatedFleet

T_START = 1_700_000_000.0  # the fake clock's origin (the fleet is created then)
FIRST_JOB_S = 2.3  # the first job starts this long after T_START
GAP_S = 1.7  # idle between jobs
SQUARE_LOW_W, SQUARE_HIGH_W = 150.0, 650.0


@dataclass(frozen=True)
class Trace:
    """One workload: ``jobs`` jobs of ``duration_s`` running ``kind``.

    ``square_factor`` (kind ``square``) is the wave's period in units of the board's refresh period;
    ``reset_at_s`` resets the energy counter that long into the first job (as a driver reload does).
    """

    name: str
    kind: str
    duration_s: float
    jobs: int = 1
    square_factor: float | None = None
    reset_at_s: float | None = None

    @property
    def has_reset(self) -> bool:
        """Whether the trace resets the energy counter mid-job."""
        return self.reset_at_s is not None


def job_windows(trace: Trace) -> list[tuple[float, float]]:
    """(start, end) of each job; starts drift by odd milliseconds so they fall anywhere on the refresh grid."""
    windows = []
    t_s = T_START + FIRST_JOB_S
    for j in range(trace.jobs):
        start_s = t_s + 0.0137 * j
        windows.append((start_s, start_s + trace.duration_s))
        t_s = start_s + trace.duration_s + GAP_S
    return windows


def play(fleet: SimulatedFleet, index: int, trace: Trace) -> list[tuple[float, float]]:
    """Schedule ``trace`` on board ``index`` of ``fleet``; returns the job windows."""
    windows = job_windows(trace)
    period_s = fleet.refresh_period_s(index)
    for j, (start_s, end_s) in enumerate(windows):
        pid = 1000 + j
        if trace.kind == "square":
            assert trace.square_factor is not None
            fleet.set_square_wave(index, start_s, trace.square_factor * period_s, SQUARE_LOW_W, SQUARE_HIGH_W, pid)
        else:
            fleet.set_activity(index, trace.kind, start_s, pid)
        fleet.set_activity(index, "idle", end_s)
    if trace.reset_at_s is not None:
        fleet.reset_counter(index, windows[0][0] + trace.reset_at_s)
    return windows


def gpu_traces() -> list[Trace]:
    """The GPU traces of the benchmark, in table order."""
    squares = [
        Trace(f"square wave {f:g}x refresh, 10 s", "square", 10.0, square_factor=f) for f in (0.5, 0.75, 1.0, 1.33)
    ]
    return [
        Trace("steady training, 60 s", "training", 60.0),
        Trace("bursty inference, 60 s", "inference", 60.0),
        *squares,
        Trace("1 s training jobs (x20)", "training", 1.0, jobs=20),
        Trace("1 s inference jobs (x20)", "inference", 1.0, jobs=20),
        Trace("10 s inference jobs (x5)", "inference", 10.0, jobs=5),
        Trace("counter reset mid-job, 10 s", "training", 10.0, reset_at_s=4.37),
    ]


def quick_traces() -> list[Trace]:
    """A reduced set for the smoke test: one of each kind of difficulty, short."""
    return [
        Trace("steady training, 10 s", "training", 10.0),
        Trace("square wave 1x refresh, 5 s", "square", 5.0, square_factor=1.0),
        Trace("1 s inference jobs (x8)", "inference", 1.0, jobs=8),
        Trace("counter reset mid-job, 10 s", "training", 10.0, reset_at_s=4.37),
    ]
