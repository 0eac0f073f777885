"""After a restart: the jobs of the agent before this one that it re-adopted (their processes still ran)
are watched until those processes are gone, and those it could not re-adopt get an end record.

The restart's checkpoint, gap and adoption rules are ``agent.restore``'s; this is the bookkeeping the
worker does with them while it runs.
"""

from __future__ import annotations

import logging
import threading

import msgspec

from wattwatch.agent.events import WorkloadHook
from wattwatch.agent.jobs import JobRegistry
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.restore import ENDED_AT_RESTART, ENDED_PROCESS_GONE, JobMark, gone
from wattwatch.protocol import wire
from wattwatch.protocol.limits import fit_labels, fit_text

log = logging.getLogger(__name__)


def ended_at_restart(mark: JobMark, last_seen_s: float) -> wire.Job:
    """The end record of a job whose processes were gone when the agent came back."""
    return wire.Job(
        id=mark.id,
        name=fit_text(mark.name) or mark.id,
        kind=mark.kind,
        started_at_s=mark.started_at_s,
        ended_at_s=max(last_seen_s, mark.started_at_s),
        devices=list(mark.devices),
        labels=fit_labels(mark.labels)[0],
        pid=min(mark.pids) if mark.pids else None,
        ended_by=ENDED_AT_RESTART,
    )


class ReadoptedJobs:
    """Re-adopted jobs and their processes' start ticks, until the processes end; and the end events
    queued and not yet handled, so a job that said it ended is not also ended as gone."""

    def __init__(self, registry: JobRegistry, procfs: ProcFs, hook: WorkloadHook | None) -> None:
        self._registry = registry
        self._procfs = procfs
        self._hook = hook
        self._watch: dict[str, dict[int, int]] = {}  # re-adopted job -> pid -> start ticks, until they end
        # Job id -> end events queued and not yet processed (local-API threads add, the worker removes).
        self._ends_queued: dict[str, int] = {}
        self._ends_lock = threading.Lock()

    def watch(self, jobs: dict[str, dict[int, int]]) -> None:
        """Watch these re-adopted jobs' processes (job id -> pid -> start ticks)."""
        self._watch.update(jobs)

    def end_queued(self, job_id: str) -> None:
        """An end of ``job_id`` was queued (counted before the reply lets the process exit)."""
        with self._ends_lock:
            self._ends_queued[job_id] = self._ends_queued.get(job_id, 0) + 1

    def end_handled(self, job_id: str) -> None:
        """The worker handled a queued end of ``job_id``."""
        with self._ends_lock:
            left = self._ends_queued.get(job_id, 0) - 1
            if left > 0:
                self._ends_queued[job_id] = left
            else:
                self._ends_queued.pop(job_id, None)

    def end_gone(self, t_s: float) -> list[wire.Job]:
        """End the re-adopted jobs whose processes all ended without telling this agent."""
        out: list[wire.Job] = []
        for job_id, pids in list(self._watch.items()):
            if self._registry.get(job_id) is None:
                del self._watch[job_id]  # ended the usual way
                continue
            if not gone(pids, self._procfs):
                continue
            with self._ends_lock:
                if self._ends_queued.get(job_id):
                    # It told us before exiting (its end is queued behind this tick, which was slow enough
                    # to see the exit): that end, at its own boundary read, is the job's end.
                    continue
            del self._watch[job_id]
            ended = None
            while ended is None and self._registry.get(job_id) is not None:
                ended = self._registry.end(job_id)
            if ended is not None:
                record = ended.to_wire(ended_at_s=max(t_s, ended.started_at_s))
                out.append(msgspec.structs.replace(record, ended_by=ENDED_PROCESS_GONE))
                if self._hook is not None:
                    self._hook.job_ended(job_id, t_s)
                log.info("job %s ended: its processes are gone", job_id)
        return out
