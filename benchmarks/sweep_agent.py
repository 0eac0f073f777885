"""Jobs measured by the whole agent on a fake clock, against the simulator's exact integral: the engine of
``timing_sweep.py``.

One in-process ``Agent`` (sampler, process tracker, spool; no collector) reads two simulated boards
through wattwatch's ``NvmlSensor`` and the simulator's fake ``pynvml``, on one ``FakeClock`` that the
sensor's polling and the NVML calls' latency move on. Each job's training load starts and stops on its
board at the job's boundaries, late by the fleet's start/end lag (``SimulatedFleet.load_lag_s``), as
``standalone.SimulatedWorkload`` does under ``--simulate`` (which cannot load a GPU the job does not
name). The agent ticks every second.

Every job is one new process that puts its model on its GPU some time before it opens its job (1.5-3 s by
default, longer than a tick; listed by NVML from then on, after the fleet's process-list delay), opens
the job, runs it, closes it and exits. Every other job names its GPU (``CUDA_VISIBLE_DEVICES``, as
``wattwatch run`` and most schedulers do); the others do not, so the agent binds them to the GPUs NVML
lists their process on. Both kinds run on both boards (whose refresh phases differ). A process a
tick found before the job opened is claimed at the job's own boundary read; any other, at the
first tick that sees it (so a model load shorter than a tick, or a process NVML lists late, costs the job
the energy drawn until that tick).

Measured: the job's share of every interval the agent spooled (``split_interval``, as the collector
splits them). Truth: ``SimulatedFleet.exact_energy_j`` between the start and end the agent recorded for
the job: the simulator's integral of its activity timeline, which no wattwatch code computes.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from wattwatch.accounting.attribution import split_interval
from wattwatch.agent.options import AgentOptions
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.runner import Agent
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sensors.nvml import NvmlSensor
from wattwatch.sensors.visible import resolve_visible
from wattwatch.sim.clock import FakeClock
from wattwatch.sim.flaws import Flaws
from wattwatch.sim.fleet import SimulatedFleet

T0_S = 1_700_000_000.0
TICK_S = 1.0
SHAPES = ("declared", "by process")  # CUDA_VISIBLE_DEVICES given | bound to the GPU NVML lists its process on
MODEL_LOAD_S = (1.5, 3.0)  # the process is on its GPU this long before it opens its job (default)
GAP_S = (0.3, 0.9)  # between a job's end and the next process's arrival on that GPU
WAIT_S = 10.0  # real seconds the worker may take for one event


@dataclass
class Result:
    """Signed relative errors per job shape and window length, and the period the sensor learned."""

    errors: dict[tuple[str, float], list[float]] = field(default_factory=dict)
    learned_period_s: float | None = None
    by_job: dict[str, float] = field(default_factory=dict)

    def add(self, job: str, shape: str, window_s: float, error: float) -> None:
        """Record one job's error."""
        self.errors.setdefault((shape, window_s), []).append(error)
        self.by_job[job] = error


@dataclass(order=True)
class _Action:
    t_s: float
    order: int
    kind: str = field(compare=False)  # arrive | open | close | tick
    board: int = field(compare=False, default=0)
    job: str = field(compare=False, default="")
    pid: int = field(compare=False, default=0)
    shape: str = field(compare=False, default=SHAPES[0])


def schedule(
    windows_s: list[float], seed: int, model_load_s: tuple[float, float] = MODEL_LOAD_S
) -> tuple[list[_Action], dict[str, tuple[int, float, str]]]:
    """Each board's jobs in turn (a process arrives, opens its job ``model_load_s`` later, closes it; the
    kinds of job alternate), ticks every ``TICK_S``; and job id -> (board, window, kind)."""
    rng = random.Random(seed)
    actions: list[_Action] = []
    jobs: dict[str, tuple[int, float, str]] = {}
    order = 0
    end_s = T0_S
    for board in (0, 1):
        t_s = T0_S + 2.0 + 0.37 * board  # offset, so that the boards' boundaries rarely coincide
        for n, window_s in enumerate(windows_s):
            job, pid, shape = f"b{board}-j{n}", 10_000 + 1000 * board + n, SHAPES[(n + board) % 2]
            open_s = t_s + rng.uniform(*model_load_s)
            close_s = open_s + window_s
            for kind, at_s in (("arrive", t_s), ("open", open_s), ("close", close_s)):
                actions.append(_Action(at_s, order, kind, board, job, pid, shape))
                order += 1
            jobs[job] = (board, window_s, shape)
            t_s = close_s + rng.uniform(*GAP_S)
        end_s = max(end_s, t_s)
    tick_s = T0_S + TICK_S
    while tick_s < end_s + TICK_S:
        actions.append(_Action(tick_s, order, "tick"))
        order += 1
        tick_s += TICK_S
    return sorted(actions), jobs


def _write_proc(root: Path, pid: int) -> None:
    """A /proc/PID/stat the agent's ProcFs reads: a child of init, started ``pid`` ticks after boot."""
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    fields = " ".join(["S", "1", *["0"] * 13, *["0"] * 4, str(pid), "0"])
    (root / str(pid) / "stat").write_text(f"{pid} (python) {fields}\n")


@contextmanager
def _quiet() -> Iterator[None]:
    """The agent logs every job and its failed pushes (there is no collector here): errors only."""
    logger = logging.getLogger("wattwatch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def measure(
    generation: str,
    flaws: Flaws,
    windows_s: list[float],
    seed: int = 7,
    model_load_s: tuple[float, float] = MODEL_LOAD_S,
) -> Result:
    """Run every job of ``windows_s`` on each board through an agent; the jobs' errors against the truth."""
    tmp = Path(tempfile.mkdtemp(prefix="wattwatch-sweep-"))
    try:
        with _quiet():
            return _measure(tmp, generation, flaws, windows_s, seed, model_load_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _measure(
    tmp: Path, generation: str, flaws: Flaws, windows_s: list[float], seed: int, model_load_s: tuple[float, float]
) -> Result:
    clock = FakeClock(T0_S)
    fleet = SimulatedFleet(2, seed=seed, clock=clock, generation=generation, flaws=flaws)
    proc = tmp / "proc"
    proc.mkdir()
    sensor = NvmlSensor(fleet.module(), clock=clock, sleep=clock.sleep)
    settings = replace(
        Settings(home=tmp / "home"), collector_url="http://127.0.0.1:9", interval_s=3600.0, push_interval_s=3600.0
    )
    settings.home.mkdir()
    agent = Agent(
        settings,
        [sensor],
        gpu_processes=sensor,
        resolve_visible=resolve_visible,
        clock=clock,
        serve_socket=False,
        options=AgentOptions(proc_root=proc, fine_interval_s=0.0),
        procfs=ProcFs(proc, clock_ticks_per_s=100),
    )
    actions, jobs = schedule(windows_s, seed, model_load_s)
    agent.start()
    result = Result()
    try:
        for action in actions:
            clock.t_s = max(clock.t_s, action.t_s)  # a read that took longer delays what comes next
            _act(agent, fleet, proc, action)
        timing = sensor.timing().get("gpu0")
        result.learned_period_s = timing.refresh_period_s if timing is not None else None
    finally:
        agent.stop(flush_timeout_s=0.1)
    _score(result, tmp / "home" / "spool.db", fleet, jobs)
    return result


def _request(agent: Agent, msg: dict[str, object]) -> None:
    """Send a job boundary and wait until the worker has handled it whole (``Agent.drain``). Waiting for
    the spool to grow was not enough: the push thread, woken by the boundary before, may seal a batch
    first, and the next action then moved the clock under a boundary read still polling (a job now
    and then off by 2-3 % on a loaded machine)."""
    reply = agent.handle(msg)
    if not reply["ok"]:
        raise RuntimeError(f"{msg['op']} {msg['id']} refused: {reply}")
    if not agent.drain(WAIT_S):
        raise RuntimeError(f"the agent's worker did not handle {msg['op']} {msg['id']} within {WAIT_S:g} s")


def _act(agent: Agent, fleet: SimulatedFleet, proc: Path, a: _Action) -> None:
    if a.kind == "tick":
        if not agent.tick(WAIT_S):
            raise RuntimeError("the agent's worker did not finish a tick")
    elif a.kind == "arrive":
        # Creating a CUDA context: NVML lists the process (after the fleet's delay); the load is the job's.
        _write_proc(proc, a.pid)
        fleet.set_process_utilization(a.board, a.pid, 5.0, fleet.clock())
    elif a.kind == "open":
        # The load is set before the request, for the instant the agent will stamp on it (nothing else moves
        # the clock meanwhile); set after it, it could land before a read the worker already took.
        fleet.set_activity(a.board, "training", fleet.clock() + fleet.load_lag_s(a.job, "start"), a.pid)
        msg: dict[str, object] = {"op": "job_start", "id": a.job, "name": a.job, "kind": "training", "pid": a.pid}
        if a.shape == "declared":
            msg["cuda_visible_devices"] = str(a.board)
        _request(agent, msg)
    else:  # close: the job ends and its process exits
        fleet.set_activity(a.board, "idle", fleet.clock() + fleet.load_lag_s(a.job, "end"), a.pid)
        _request(agent, {"op": "job_end", "id": a.job})
        fleet.set_process_utilization(a.board, a.pid, 0.0, fleet.clock())
        shutil.rmtree(proc / str(a.pid), ignore_errors=True)


def _score(result: Result, spool_path: Path, fleet: SimulatedFleet, jobs: dict[str, tuple[int, float, str]]) -> None:
    spool = Spool(spool_path)
    try:
        batches = [wire.decode_batch(body) for _, body in spool.peek(limit=1_000_000)]
    finally:
        spool.close()
    measured = dict.fromkeys(jobs, 0.0)
    window: dict[str, list[float]] = {}
    for batch in batches:
        for iv in batch.intervals:
            if set(iv.shares) & set(jobs):
                parts, _idle = split_interval(iv.energy_j, iv.shares, iv.idle_weight)
                for job, energy_j in parts.items():
                    if job in measured:
                        measured[job] += energy_j
        for job_rec in batch.jobs:
            if job_rec.id in jobs:
                span = window.setdefault(job_rec.id, [job_rec.started_at_s, job_rec.started_at_s])
                if job_rec.ended_at_s is not None:
                    span[1] = job_rec.ended_at_s
    for job, (board, window_s, shape) in jobs.items():
        start_s, end_s = window[job]
        if end_s <= start_s:
            raise RuntimeError(f"job {job} has no end in the spool")
        exact_j = fleet.exact_energy_j(board, start_s, end_s)
        result.add(job, shape, window_s, (measured[job] - exact_j) / exact_j)
