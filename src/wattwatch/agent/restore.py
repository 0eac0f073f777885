"""What a restarted agent takes over from the one before it: the last counter readings and the open jobs.

The agent keeps a ``Checkpoint`` in its spool, written in the same SQLite transaction as every batch
(``Spool.put``), so it always describes exactly what the spool holds: per device the last reading whose
interval is in a batch (the sampler's cumulative joules *and* the hardware counter's own value), and
the jobs open at that time with the start times of their processes. After a crash (``kill -9``, OOM)
or a plain stop, the next agent:

- bridges each device's gap by the counter's delta when the counter is continuous (same boot, same
  UUID, not gone backwards, not longer than a wrapping counter can be trusted over, mean power
  plausible): one interval flagged ``restart_bridged``, held by the jobs that were open then and
  still run. Otherwise no energy is invented: a zero-energy interval flagged ``restart_gap`` records it.
- re-adopts jobs whose processes still run: the same pid *and* the same start time in ``/proc``, so a
  reused pid is never mistaken for the old process;
- ends the other jobs at the checkpoint's time (the last time they were seen), ``ended_by``
  ``agent-restart``.

Pure functions and plain records; the agent (``agent.runner``) does the wiring.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import msgspec

from wattwatch.agent.jobs import ActiveJob
from wattwatch.agent.procfs import ProcFs
from wattwatch.protocol import wire
from wattwatch.protocol.units import JobKind, Source

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
BRIDGED = "restart_bridged"
GAP = "restart_gap"
ENDED_AT_RESTART = "agent-restart"  # a job whose processes were gone when the agent came back
ENDED_PROCESS_GONE = "process-gone"  # a re-adopted job whose processes ended without telling the agent
# A bridge whose mean power exceeds the board's power limit by this factor is not the same counter.
MAX_POWER_FACTOR = 1.5


@dataclass(frozen=True)
class DeviceMark:
    """One device's reading at ``t_s``: ``energy_j`` on the sampler's scale (this agent's run),
    ``counter_j`` on the hardware counter's own (None: no counter), which wraps after ``wrap_j`` (0: never).
    ``max_gap_s`` is the longest gap its delta can be trusted over (None: no limit)."""

    key: str
    t_s: float
    energy_j: float
    source: Source
    uuid: str | None = None
    counter_j: float | None = None
    wrap_j: float = 0.0
    max_gap_s: float | None = None
    power_limit_w: float | None = None


@dataclass(frozen=True)
class JobMark:
    """An open job as the checkpoint keeps it. ``pids`` maps each root pid to its start time in clock
    ticks since boot (None: the agent could not see the process, so cannot tell it apart later)."""

    id: str
    name: str
    kind: JobKind
    started_at_s: float
    labels: dict[str, str] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    pids: dict[int, int | None] = field(default_factory=dict)
    bind_by_process: bool = False
    bind_reason: str = ""
    explicit: bool = True
    refs: int = 1


@dataclass(frozen=True)
class Checkpoint:
    """The state a restarted agent needs; ``t_s`` is when the open job set was last known."""

    t_s: float
    boot_id: str | None
    devices: dict[str, DeviceMark]
    jobs: list[JobMark]

    def to_json(self) -> str:
        """The spool's form of it (written with every staged tick, so encoded by msgspec straight from the
        marks: ``dataclasses.asdict`` and ``json`` cost more than the rest of the write)."""
        return _ENCODER.encode(
            {
                "version": CHECKPOINT_VERSION,
                "t_s": self.t_s,
                "boot_id": self.boot_id,
                "devices": list(self.devices.values()),
                "jobs": [
                    {
                        **{f: getattr(j, f) for f in _JOB_FIELDS},
                        "pids": [[p, t] for p, t in j.pids.items()],
                    }
                    for j in self.jobs
                ],
            }
        ).decode()

    @classmethod
    def from_json(cls, text: str) -> Checkpoint | None:
        """Parse ``to_json``'s output; None (logged) when it is not one this agent understands."""
        try:
            raw = json.loads(text)
            if raw.get("version") != CHECKPOINT_VERSION:
                log.warning("ignoring a restart checkpoint of version %r", raw.get("version"))
                return None
            devices = {d["key"]: DeviceMark(**d) for d in raw["devices"]}
            jobs = [JobMark(**{**j, "pids": {int(p): t for p, t in j["pids"]}}) for j in raw["jobs"]]
            return cls(float(raw["t_s"]), raw.get("boot_id"), devices, jobs)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("ignoring an unreadable restart checkpoint (%s)", exc)
            return None


_ENCODER = msgspec.json.Encoder()
_JOB_FIELDS = tuple(f.name for f in fields(JobMark) if f.name != "pids")  # pids: a JSON object has no int keys


def read_boot_id(proc_root: Path) -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): counters and pids start over with a boot."""
    try:
        return (proc_root / "sys" / "kernel" / "random" / "boot_id").read_text().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class Bridge:
    """How a device's gap ``[t_start_s, t_end_s]`` is accounted for: ``energy_j`` with ``flag`` ``BRIDGED``,
    or 0 with ``GAP`` and the reason."""

    t_start_s: float
    t_end_s: float
    energy_j: float
    flag: str
    why: str = ""


def bridge(before: DeviceMark, after: DeviceMark, *, same_boot: bool, max_gap_s: float) -> Bridge | None:
    """The energy device ``before.key`` drew between the checkpoint's reading and the new agent's first
    (``after``), from the counter's delta when it is continuous; None when there is no gap to account for."""
    gap_s = after.t_s - before.t_s
    if gap_s <= 0:
        return None
    why = ""
    delta_j = 0.0
    if not same_boot:
        why = "the host rebooted"
    elif before.counter_j is None or after.counter_j is None:
        why = "no energy counter"
    elif before.uuid != after.uuid:
        why = f"another device ({before.uuid} before, {after.uuid} now)"
    elif gap_s > max_gap_s:
        why = f"{gap_s:.0f} s is longer than the {max_gap_s:.0f} s a gap is bridged over"
    elif before.max_gap_s is not None and gap_s > before.max_gap_s:
        why = f"the counter may have wrapped twice in {gap_s:.1f} s (it must be read every {before.max_gap_s:.1f} s)"
    else:
        delta_j = after.counter_j - before.counter_j
        if delta_j < 0 and before.wrap_j > 0:
            delta_j += before.wrap_j  # wrapped once: the gap is shorter than a wrap period
        if delta_j < 0:
            why = f"the counter went back by {-delta_j:.1f} J (driver reload?)"
        elif before.power_limit_w and delta_j / gap_s > MAX_POWER_FACTOR * before.power_limit_w:
            why = f"{delta_j / gap_s:.0f} W on average is not possible for a {before.power_limit_w:.0f} W board"
    if why:
        return Bridge(before.t_s, after.t_s, 0.0, GAP, why)
    return Bridge(before.t_s, after.t_s, delta_j, BRIDGED)


def gap_intervals(
    checkpoint: Checkpoint,
    now: Mapping[str, DeviceMark],
    gpu_holders: Mapping[str, Sequence[str]],
    *,
    same_boot: bool,
    max_gap_s: float,
) -> list[wire.Interval]:
    """One interval per device over its gap, from the checkpoint's reading to ``now``'s: bridged, or
    flagged with no energy (``bridge``). A GPU's belongs to ``gpu_holders`` (the jobs open before the gap
    that still run), equally until weighed; everything else's to idle (the jobs' CPU time over the gap is
    not known)."""
    out: list[wire.Interval] = []
    for key, before in checkpoint.devices.items():
        after = now.get(key)
        if after is None:
            log.info("%s was measured before the restart but is not now; its gap is not accounted", key)
            continue
        gap = bridge(before, after, same_boot=same_boot, max_gap_s=max_gap_s)
        if gap is None:
            continue
        gap_s = gap.t_end_s - gap.t_start_s
        if gap.why:
            log.warning("%s: %.1f s unmeasured while the agent was down: %s", key, gap_s, gap.why)
        else:
            log.info("%s: bridged %.1f s while the agent was down (%.1f J)", key, gap_s, gap.energy_j)
        out.append(
            wire.Interval(
                device=key,
                t_start_s=gap.t_start_s,
                t_end_s=gap.t_end_s,
                energy_j=gap.energy_j,
                source=after.source,
                shares=dict.fromkeys(gpu_holders.get(key, ()), 1.0),
                flags=[gap.flag],
            )
        )
    return out


class PidStarts:
    """Start times of job processes, read once per pid (a reused pid has another start time)."""

    def __init__(self, procfs: ProcFs) -> None:
        self._procfs = procfs
        self._cache: dict[int, int | None] = {}

    def marks(self, jobs: Iterable[ActiveJob]) -> list[JobMark]:
        """The checkpoint's form of ``jobs`` (the registry's snapshot)."""
        out: list[JobMark] = []
        seen: set[int] = set()
        for job in jobs:
            pids: dict[int, int | None] = {}
            for pid in sorted(job.all_pids):
                if pid not in self._cache:
                    st = self._procfs.stat(pid)
                    self._cache[pid] = None if st is None else st.start_ticks
                pids[pid] = self._cache[pid]
                seen.add(pid)
            out.append(
                JobMark(
                    id=job.id,
                    name=job.name,
                    kind=job.kind,
                    started_at_s=job.started_at_s,
                    labels=dict(job.labels),
                    devices=sorted(job.devices if job.explicit else job.held_devices),
                    pids=pids,
                    bind_by_process=job.bind_by_process,
                    bind_reason=job.bind_reason,
                    explicit=job.explicit,
                    refs=job.refs,
                )
            )
        for gone in set(self._cache) - seen:
            del self._cache[gone]
        return out


def running(procfs: ProcFs, pid: int, start_ticks: int | None) -> bool:
    """Whether ``pid`` is still the process the checkpoint saw (the same start time, when it was known)."""
    st = procfs.stat(pid)
    if start_ticks is None:
        return True  # never visible to this agent (another PID namespace): its client will end it
    return st is not None and st.start_ticks == start_ticks


@dataclass
class Adoption:
    """What to do with the checkpoint's jobs: ``readopt`` (alive) and ``ended`` (gone), and for each
    re-adopted job the pids to watch (those whose start time is known)."""

    readopt: list[ActiveJob] = field(default_factory=list)
    ended: list[JobMark] = field(default_factory=list)
    watch: dict[str, dict[int, int]] = field(default_factory=dict)


def adopt(jobs: Iterable[JobMark], procfs: ProcFs, *, same_boot: bool) -> Adoption:
    """Sort the checkpoint's explicit jobs into those whose processes still run and those that are gone.

    A job with several root processes stays while any of them runs (one reference fewer per gone one); a
    job without a pid (a client that sent none) cannot be checked and is kept. Discovered jobs are left to
    the process tracker, which finds them again by their processes.
    """
    result = Adoption()
    for mark in jobs:
        if not mark.explicit:
            continue
        alive = {p: t for p, t in mark.pids.items() if same_boot and running(procfs, p, t)}
        if (mark.pids and not alive) or not same_boot:
            result.ended.append(mark)
            continue
        refs = max(1, mark.refs - (len(mark.pids) - len(alive)))
        result.readopt.append(
            ActiveJob(
                id=mark.id,
                name=mark.name,
                kind=mark.kind,
                started_at_s=mark.started_at_s,
                labels=dict(mark.labels),
                devices=frozenset(mark.devices),
                pids=set(alive),
                bind_by_process=mark.bind_by_process,
                refs=refs,
                bind_reason=mark.bind_reason,
                explicit=True,
            )
        )
        known = {p: t for p, t in alive.items() if t is not None}
        if known:
            result.watch[mark.id] = known
    return result


def gone(watch: Mapping[int, int], procfs: ProcFs) -> bool:
    """Whether every watched process of a re-adopted job has ended."""
    return not any(running(procfs, pid, ticks) for pid, ticks in watch.items())


def no_limit(value: float) -> float | None:
    """``value`` for ``DeviceMark.max_gap_s``: None for no limit (JSON has no infinity)."""
    return None if math.isinf(value) or value <= 0 else float(value)
