"""Wires the agent: sensors -> sampler -> batches -> spool -> push, driven by APScheduler ticks and by
job boundaries from the local API.

Threads: APScheduler runs the tick (enqueue) and the push; one worker thread owns the sampler and the
job registry, so every reading is taken in event order and every interval is closed with the job set
that really held the device; the local API answers clients at once and never waits for a reading.
"""

from __future__ import annotations

import logging
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from apscheduler.schedulers.background import BackgroundScheduler

from wattwatch import wire
from wattwatch.agent.jobs import ActiveJob, CpuTimeMeter, JobRegistry, gpu_shares, process_tree
from wattwatch.agent.local_api import LocalApi
from wattwatch.agent.push import Pusher
from wattwatch.agent.sampler import Sampler
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings
from wattwatch.errors import ConfigError
from wattwatch.sensors.base import DeviceInfo, Sensor
from wattwatch.units import JOB_KINDS, JobKind

log = logging.getLogger(__name__)

_JOB_ID = re.compile(r"^[A-Za-z0-9_.:@/-]{1,200}$")


class GpuProcesses(Protocol):
    """What the agent needs from the NVML sensor to bind jobs by process."""

    def running_pids(self, key: str) -> set[int]:
        """Pids NVML lists on GPU ``key``."""
        ...


class WorkloadHook(Protocol):
    """Told when a job starts or ends on devices; simulated GPUs use it to change their load."""

    def job_started(self, job_id: str, kind: str, devices: Sequence[str], pid: int | None, t_s: float) -> None:
        """A job began using ``devices`` at ``t_s``."""
        ...

    def job_ended(self, job_id: str, t_s: float) -> None:
        """A job stopped at ``t_s``."""
        ...


@dataclass
class _Event:
    kind: str  # tick | start | end | stop
    t_s: float
    job: ActiveJob | None = None
    job_id: str = ""
    done: threading.Event | None = None


class Agent:
    """One host's agent. ``start()`` it, then ``stop()`` it (flushes everything it measured)."""

    def __init__(
        self,
        settings: Settings,
        sensors: Sequence[Sensor],
        *,
        gpu_processes: GpuProcesses | None = None,
        resolve_visible: Callable[[str, Sequence[DeviceInfo]], list[str]] | None = None,
        workload_hook: WorkloadHook | None = None,
        clock: Callable[[], float] = time.time,
        serve_socket: bool = True,
    ) -> None:
        self.settings = settings
        self.host = settings.host or socket.gethostname()
        self.sampler = Sampler(sensors)
        self.registry = JobRegistry()
        self.spool = Spool(settings.home / "spool.db")
        agent_id = self.spool.meta("agent_id")
        if agent_id is None:
            agent_id = uuid.uuid4().hex
            self.spool.set_meta("agent_id", agent_id)
        self.agent_id = agent_id
        self.pusher = Pusher(self.spool, settings.collector_url, token=settings.token)
        self._gpu_processes = gpu_processes
        self._resolve_visible = resolve_visible
        self._hook = workload_hook
        self._clock = clock
        self._cpu = CpuTimeMeter()
        self._events: queue.Queue[_Event] = queue.Queue()
        self._enqueue_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending_intervals: list[wire.Interval] = []
        self._pending_jobs: list[wire.Job] = []
        self._pending_queries: list[wire.Query] = []
        self._worker = threading.Thread(target=self._work, name="wattwatch-sampler", daemon=True)
        self._scheduler = BackgroundScheduler(daemon=True)
        self._api = LocalApi(settings.socket_path, self.handle) if serve_socket else None
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Take the first reading, start the worker, the schedule and the local API."""
        self.sampler.sample(self._shares)  # baseline: intervals start here
        self._worker.start()
        self._scheduler.add_job(
            self._enqueue_tick,
            "interval",
            seconds=self.settings.interval_s,
            id="tick",
            max_instances=1,
            coalesce=True,
        )
        self._scheduler.add_job(
            self.flush,
            "interval",
            seconds=self.settings.push_interval_s,
            id="push",
            max_instances=1,
            coalesce=True,
        )
        self._scheduler.start()
        if self._api is not None:
            self._api.start()
        log.info(
            "agent %s on %s measuring %s; pushing to %s",
            self.agent_id[:8],
            self.host,
            ", ".join(self.sampler.devices) or "nothing",
            self.settings.collector_url,
        )

    def stop(self, flush_timeout_s: float = 10.0) -> None:
        """Close the last intervals, spool them and push what the collector will take; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._api is not None:
            self._api.stop()
        self._scheduler.shutdown(wait=True)
        done = threading.Event()
        self._put(_Event("stop", self._clock(), done=done))
        done.wait(timeout=flush_timeout_s)
        self.seal()
        deadline = time.monotonic() + flush_timeout_s
        while self.spool.pending() and time.monotonic() < deadline:
            if not self.pusher.push_pending(force=True):
                time.sleep(0.2)
        left = self.spool.pending()
        if left:
            log.warning(
                "%d batches not yet accepted by the collector stay in %s for the next start", left, self.spool.path
            )
        self.pusher.close()
        for sensor in self.sampler.sensors:
            sensor.close()
        self.spool.close()

    # -- local API -----------------------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one local-API request (see ``agent.local_api``)."""
        op = msg.get("op")
        if op == "ping":
            return {"ok": True, "host": self.host, "agent_id": self.agent_id}
        if op == "job_start":
            return self.job_start(msg)
        if op == "job_end":
            return self.job_end(str(msg.get("id", "")))
        if op == "query":
            self.add_query(msg)
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}; expected ping, job_start, job_end or query"}

    def job_start(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Register a job; the boundary reading is taken asynchronously at the returned ``t_s``."""
        job_id = str(msg.get("id") or uuid.uuid4().hex)
        if not _JOB_ID.match(job_id):
            raise ConfigError(f"job id {job_id!r} may only contain letters, digits and _.:@/- (max 200)")
        name = str(msg.get("name") or job_id)[:200]
        kind = msg.get("kind") or "other"
        if kind not in JOB_KINDS:
            raise ConfigError(f"job kind {kind!r} is not one of {', '.join(JOB_KINDS)}")
        labels = msg.get("labels") or {}
        if not isinstance(labels, dict):
            raise ConfigError("labels must be an object of strings")
        pid = msg.get("pid")
        cvd = msg.get("cuda_visible_devices")
        warning = ""
        devices: list[str] = []
        gpus = [d for d in self.sampler.devices.values() if d.kind == "gpu"]
        if cvd is not None and gpus and self._resolve_visible is not None:
            try:
                devices = self._resolve_visible(str(cvd), gpus) if str(cvd).strip() else []
            except ConfigError as exc:
                warning = f"{exc}; the job is measured without GPUs"
        job = ActiveJob(
            id=job_id,
            name=name,
            kind=_as_kind(kind),
            started_at_s=0.0,
            labels={str(k): str(v) for k, v in labels.items()},
            devices=frozenset(devices),
            pids={int(pid)} if isinstance(pid, int) else set(),
            bind_by_process=cvd is None,
        )
        t_s = self._put(_Event("start", 0.0, job=job), hook=lambda t: self._hook_start(job, t))
        reply: dict[str, Any] = {"ok": True, "id": job_id, "t_s": t_s, "host": self.host, "devices": devices}
        if warning:
            reply["warning"] = warning
        return reply

    def job_end(self, job_id: str) -> dict[str, Any]:
        """End a job at now; the boundary reading is taken asynchronously at the returned ``t_s``."""
        if not job_id:
            raise ConfigError("job_end needs the job's id")
        hook = self._hook
        t_s = self._put(_Event("end", 0.0, job_id=job_id), hook=(lambda t: hook.job_ended(job_id, t)) if hook else None)
        return {"ok": True, "id": job_id, "t_s": t_s}

    def add_query(self, msg: dict[str, Any]) -> None:
        """Record one inference request span for its job."""
        job_id = str(msg.get("job") or "")
        if not _JOB_ID.match(job_id):
            raise ConfigError(f"query needs a valid job id, got {job_id!r}")
        query = wire.Query(
            job=job_id,
            t_start_s=float(msg["t_start_s"]),
            t_end_s=float(msg["t_end_s"]),
            tokens_in=int(msg.get("tokens_in") or 0),
            tokens_out=int(msg.get("tokens_out") or 0),
        )
        with self._pending_lock:
            self._pending_queries.append(query)

    # -- worker --------------------------------------------------------------------------------------

    def _hook_start(self, job: ActiveJob, t_s: float) -> None:
        if self._hook is not None:
            self._hook.job_started(job.id, job.kind, sorted(job.devices), min(job.pids, default=None), t_s)

    def _put(self, event: _Event, hook: Callable[[float], None] | None = None) -> float:
        # Time is taken under the lock so events enter the queue in time order.
        with self._enqueue_lock:
            event.t_s = self._clock() if event.t_s == 0.0 else event.t_s
            if event.job is not None:
                event.job.started_at_s = event.t_s
            if hook is not None:
                hook(event.t_s)
            self._events.put(event)
        return event.t_s

    def _enqueue_tick(self) -> None:
        self._put(_Event("tick", 0.0))

    def _work(self) -> None:
        while True:
            event = self._events.get()
            try:
                self._process(event)
            except Exception:
                log.exception("agent worker failed on a %s event; continuing", event.kind)
            finally:
                if event.done is not None:
                    event.done.set()
            if event.kind == "stop":
                return

    def _process(self, event: _Event) -> None:
        boundary = event.kind in ("start", "end")
        intervals = self.sampler.sample(self._shares, at_s=event.t_s if boundary else None)
        jobs: list[wire.Job] = []
        if event.kind == "start" and event.job is not None:
            active, _new = self.registry.start(event.job)
            jobs.append(active.to_wire())
        elif event.kind == "end":
            ended = self.registry.end(event.job_id)
            if ended is not None:
                jobs.append(ended.to_wire(ended_at_s=max(event.t_s, ended.started_at_s)))
        elif event.kind == "tick":
            jobs.extend(self._bind_by_process())
        with self._pending_lock:
            self._pending_intervals.extend(intervals)
            self._pending_jobs.extend(jobs)

    def _shares(self, device: DeviceInfo, interval_s: float) -> tuple[dict[str, float], float]:
        if device.kind == "gpu":
            return gpu_shares(self.registry.holders(), device.key), 0.0
        if device.kind == "cpu":
            return self._cpu.shares(self.registry.snapshot(), interval_s)
        return {}, 0.0  # DRAM: split by memory use comes with per-process attribution

    def _bind_by_process(self) -> list[wire.Job]:
        """Bind jobs without CUDA_VISIBLE_DEVICES to the GPUs where NVML lists one of their processes."""
        if self._gpu_processes is None:
            return []
        changed: list[wire.Job] = []
        gpu_keys = [d.key for d in self.sampler.devices.values() if d.kind == "gpu"]
        for job in self.registry.snapshot():
            if not job.bind_by_process:
                continue
            tree = process_tree(job.pids)
            found = [k for k in gpu_keys if self._gpu_processes.running_pids(k) & tree]
            if found and self.registry.bind(job.id, found, "NVML lists its process"):
                bound = self.registry.get(job.id)
                if bound is not None:
                    changed.append(bound.to_wire())
        return changed

    # -- batches -------------------------------------------------------------------------------------

    def seal(self) -> int | None:
        """Move everything measured so far into one durable batch; returns its seq (None if empty)."""
        with self._pending_lock:
            if not (self._pending_intervals or self._pending_jobs or self._pending_queries):
                return None
            intervals, jobs, queries = self._pending_intervals, self._pending_jobs, self._pending_queries
            self._pending_intervals, self._pending_jobs, self._pending_queries = [], [], []
        seq = self.spool.next_seq()
        batch = wire.Batch(
            agent_id=self.agent_id,
            seq=seq,
            host=self.host,
            sent_at_s=self._clock(),
            devices=self.sampler.wire_devices(),
            intervals=intervals,
            jobs=jobs,
            queries=queries,
        )
        self.spool.put(seq, wire.encode(batch), created_s=batch.sent_at_s)
        return seq

    def flush(self) -> None:
        """Seal pending measurements and push the spool (the periodic push job)."""
        self.seal()
        self.pusher.push_pending()


def _as_kind(kind: str) -> JobKind:
    for k in JOB_KINDS:
        if k == kind:
            return k
    return "other"
