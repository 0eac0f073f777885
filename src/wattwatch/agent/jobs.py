"""Which jobs run on this host, which devices they hold, and how a CPU package's interval is shared.

The registry is the agent's view of job boundaries. A job arrives explicitly (``wattwatch run``, the
SDK) and is bound to GPUs from its ``CUDA_VISIBLE_DEVICES`` or, failing that, to the GPUs where NVML
lists one of its processes; or it is discovered from a GPU process (``agent.discover``), and then holds
exactly the GPUs its processes are on, tick by tick. One id can be both (a ``wattwatch run`` job whose
id another process also carries in ``WATTWATCH_JOB``): each side holds a reference, and the job ends
when the last one does. A CPU package is split by the CPU time of each job's process tree.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from wattwatch.agent.procfs import ProcFs
from wattwatch.protocol import limits, wire
from wattwatch.protocol.units import JobKind

DISCOVERED_BY = "wattwatch.io/discovered-by"


@dataclass
class ActiveJob:
    """A job as this agent knows it. ``devices`` are device keys (``gpu0``); ``pids`` its root processes.

    ``proc_pids`` and ``proc_devices`` are what process discovery found on the last tick (replaced on
    every tick); ``pids`` and ``devices`` come from explicit starts and binding, and only grow.
    """

    id: str
    name: str
    kind: JobKind
    started_at_s: float
    labels: dict[str, str] = field(default_factory=dict)
    devices: frozenset[str] = frozenset()
    pids: set[int] = field(default_factory=set)
    # True when no CUDA_VISIBLE_DEVICES was given: the agent binds GPUs from NVML's process list.
    bind_by_process: bool = False
    refs: int = 1
    bind_reason: str = ""
    explicit: bool = True
    proc_pids: frozenset[int] = frozenset()
    proc_devices: frozenset[str] = frozenset()

    @property
    def held_devices(self) -> frozenset[str]:
        """Every device the job holds now."""
        return self.devices | self.proc_devices

    @property
    def all_pids(self) -> set[int]:
        """Root pids from every source (their descendants belong to the job too)."""
        return self.pids | self.proc_pids

    def to_wire(self, ended_at_s: float | None = None) -> wire.Job:
        """This job as the wire format's Job record, within ``wattwatch.protocol.limits`` (a discovered pod's name or
        labels are whatever Kubernetes holds: what does not fit is cut or left out, not sent to be refused)."""
        pids = self.all_pids
        return wire.Job(
            id=self.id,
            name=limits.fit_text(self.name) or self.id,
            kind=self.kind,
            started_at_s=self.started_at_s,
            ended_at_s=ended_at_s,
            devices=sorted(self.held_devices),
            labels=limits.fit_labels(self.labels)[0],
            pid=min(pids) if pids else None,
        )


class JobRegistry:
    """Thread-safe set of active jobs. Mutations return the wire records to send to the collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, ActiveJob] = {}

    def start(self, job: ActiveJob) -> tuple[ActiveJob, bool]:
        """Add ``job``; a job id already active here gains the new pids and devices (a second process
        of the same run). Returns the active job and whether it is new."""
        with self._lock:
            existing = self._jobs.get(job.id)
            if existing is None:
                self._jobs[job.id] = job
                return job, True
            existing.refs += 1
            existing.pids |= job.pids
            existing.devices = existing.devices | job.devices
            existing.bind_by_process = existing.bind_by_process and job.bind_by_process
            if job.explicit and not existing.explicit:
                # Explicit beats discovered: the user's name, kind and labels replace the guessed ones.
                existing.name, existing.kind, existing.labels = job.name, job.kind, dict(job.labels)
                existing.explicit = True
            return existing, False

    def end(self, job_id: str) -> ActiveJob | None:
        """Drop one reference to ``job_id``; returns the job when its last reference ended, else None."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            job.refs -= 1
            if job.refs > 0:
                return None
            del self._jobs[job_id]
            return job

    def get(self, job_id: str) -> ActiveJob | None:
        """The active job with this id, if any."""
        with self._lock:
            return self._jobs.get(job_id)

    def snapshot(self) -> list[ActiveJob]:
        """Copies of the active jobs (safe to read without the lock)."""
        with self._lock:
            return [replace(j, pids=set(j.pids), labels=dict(j.labels)) for j in self._jobs.values()]

    def bind(self, job_id: str, devices: Iterable[str], reason: str) -> bool:
        """Add devices to an explicit job found on them by process; True when something changed."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return False
            new = job.devices | frozenset(devices)
            if new == job.devices:
                return False
            job.devices = new
            job.bind_reason = reason
            return True

    def set_discovered(self, job_id: str, pids: Iterable[int], devices: Iterable[str]) -> bool:
        """Replace what process discovery says a job runs as and holds; True when the devices changed."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return False
            job.proc_pids = frozenset(pids)
            new = frozenset(devices)
            changed = new != job.proc_devices
            job.proc_devices = new
            return changed

    def holders(self) -> dict[str, list[str]]:
        """device key -> ids of the jobs holding it."""
        out: dict[str, list[str]] = {}
        with self._lock:
            for job in self._jobs.values():
                for key in job.held_devices:
                    out.setdefault(key, []).append(job.id)
        return out


class CpuTimeMeter:
    """Per-job CPU seconds between reads, for splitting CPU package energy by CPU time.

    A job's CPU time is the user + system time of every live process in its trees plus the time of
    children they reaped, so a process that exits and is waited for keeps counting. Trees are re-read
    every ``tree_refresh_s`` (children are read per process, never by scanning all of ``/proc``); a
    child born since is counted from the next refresh, or when its parent reaps it.
    """

    def __init__(
        self,
        cpu_count: int | None = None,
        cpu_times: Callable[[int], float] | None = None,
        *,
        procfs: ProcFs | None = None,
        tree_refresh_s: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cpu_count = cpu_count or os.cpu_count() or 1
        self._cpu_times = cpu_times
        self._procfs = procfs or ProcFs()
        self._tree_refresh_s = tree_refresh_s
        self._monotonic = monotonic
        self._trees: dict[str, tuple[float, frozenset[int], set[int]]] = {}
        self._last: dict[str, float] = {}
        self._memo: tuple[float, tuple[dict[str, float], float]] | None = None

    def shares(
        self, jobs: Iterable[ActiveJob], interval_s: float, *, at_s: float | None = None
    ) -> tuple[dict[str, float], float]:
        """(job id -> CPU seconds in the interval, idle CPU seconds) over the host's capacity.

        With ``at_s`` (the interval's end), several CPU packages closed at the same instant share one
        reading: the second package must not see a zero delta.
        """
        if at_s is not None and self._memo is not None and self._memo[0] == at_s:
            return self._memo[1]
        capacity_s = max(interval_s, 0.0) * self._cpu_count
        shares: dict[str, float] = {}
        seen: set[str] = set()
        for job in jobs:
            seen.add(job.id)
            total_s = self._job_cpu_s(job)
            previous = self._last.get(job.id)
            self._last[job.id] = total_s
            if previous is not None:
                shares[job.id] = max(total_s - previous, 0.0)
        for gone in set(self._last) - seen:
            del self._last[gone]
            self._trees.pop(gone, None)
        used_s = sum(shares.values())
        # Jobs can exceed capacity by clock skew between /proc and our timer; idle never goes negative.
        result = shares, max(capacity_s - used_s, 0.0)
        if at_s is not None:
            self._memo = (at_s, result)
        return result

    def _job_cpu_s(self, job: ActiveJob) -> float:
        roots = job.all_pids
        if self._cpu_times is not None:
            return sum(self._cpu_times(pid) for pid in roots)
        now = self._monotonic()
        cached = self._trees.get(job.id)
        frozen = frozenset(roots)
        if cached is None or cached[1] != frozen or now - cached[0] >= self._tree_refresh_s:
            tree = self._procfs.descendants(roots)
            self._trees[job.id] = (now, frozen, tree)
        else:
            tree = cached[2]
        total_s = 0.0
        for pid in tree:
            st = self._procfs.stat(pid)
            if st is not None:
                total_s += st.cpu_s + st.children_cpu_s
        return total_s
