"""Which jobs run on this host, which devices they hold, and how a device's interval is shared.

The registry is the agent's view of job boundaries. A job arrives explicitly (``wattwatch run``, the
SDK) and is bound to GPUs from its ``CUDA_VISIBLE_DEVICES`` or, failing that, to the GPUs where NVML
lists one of its processes. A GPU held by several jobs is split equally (per-process utilisation
comes later); a CPU package is split by the CPU time of each job's process tree, the rest is idle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import psutil

from wattwatch import wire
from wattwatch.units import JobKind


@dataclass
class ActiveJob:
    """A job as this agent knows it. ``devices`` are device keys (``gpu0``); ``pids`` its root processes."""

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

    def to_wire(self, ended_at_s: float | None = None) -> wire.Job:
        """This job as the wire format's Job record."""
        return wire.Job(
            id=self.id,
            name=self.name,
            kind=self.kind,
            started_at_s=self.started_at_s,
            ended_at_s=ended_at_s,
            devices=sorted(self.devices),
            labels=dict(self.labels),
            pid=min(self.pids) if self.pids else None,
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
        """Add devices to a job found by process discovery; True when something changed."""
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

    def holders(self) -> dict[str, list[str]]:
        """device key -> ids of the jobs holding it."""
        out: dict[str, list[str]] = {}
        with self._lock:
            for job in self._jobs.values():
                for key in job.devices:
                    out.setdefault(key, []).append(job.id)
        return out


def gpu_shares(holders: Mapping[str, list[str]], device: str) -> dict[str, float]:
    """Weights for a GPU interval: every holder weighs 1 (equal split), nobody -> idle."""
    return dict.fromkeys(holders.get(device, []), 1.0)


def process_tree(pids: Iterable[int]) -> set[int]:
    """The given pids and all their live descendants."""
    out: set[int] = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out.add(pid)
            out.update(child.pid for child in proc.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


class CpuTimeMeter:
    """Per-job CPU seconds between reads, for splitting CPU package energy by CPU time.

    A job's CPU time is its root processes' own and reaped children's time plus its live descendants'.
    """

    def __init__(self, cpu_count: int | None = None, cpu_times: Callable[[int], float] | None = None) -> None:
        self._cpu_count = cpu_count or psutil.cpu_count() or 1
        self._cpu_times = cpu_times or _tree_cpu_s
        self._last: dict[str, float] = {}

    def shares(self, jobs: Iterable[ActiveJob], interval_s: float) -> tuple[dict[str, float], float]:
        """(job id -> CPU seconds in the interval, idle CPU seconds) over the host's capacity."""
        capacity_s = max(interval_s, 0.0) * self._cpu_count
        shares: dict[str, float] = {}
        seen: set[str] = set()
        for job in jobs:
            seen.add(job.id)
            total_s = sum(self._cpu_times(pid) for pid in job.pids)
            previous = self._last.get(job.id)
            self._last[job.id] = total_s
            if previous is not None:
                shares[job.id] = max(total_s - previous, 0.0)
        for gone in set(self._last) - seen:
            del self._last[gone]
        used_s = sum(shares.values())
        # Jobs can exceed capacity by clock skew between /proc and our timer; idle never goes negative.
        return shares, max(capacity_s - used_s, 0.0)


def _tree_cpu_s(pid: int) -> float:
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in proc.children(recursive=True):
            try:
                ct = child.cpu_times()
                total += ct.user + ct.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return float(total)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0
