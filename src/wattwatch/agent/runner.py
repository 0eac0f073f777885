"""Wires the agent: sensors -> sampler -> batches -> spool -> push, driven by APScheduler ticks and by
job boundaries from the local API; on every tick the process tracker (``agent.tracker``) follows the
GPUs' processes, and the scraper (``agent.scrape``) reads serving engines' counters on its own schedule.

Threads: one worker thread ticks (every ``interval_s``, on a fixed grid) and owns the sampler, the
tracker and the job registry's changes, so every reading is taken in event order and every interval is
closed with the job set that really held the device; the local API answers clients at once and never
waits for a reading. A push thread seals and pushes every ``push_interval_s`` (``--push-interval``), and
at once when a job starts or ends, so a fleet sends one batch per push interval instead of one per tick
while a job's start and end reach the collector without waiting. APScheduler runs the scrape. The
self-metrics server (``agent.metrics``, with ``--metrics-listen``) answers scrapes from its own threads,
reading thread-safe snapshots of the agent's state.

Each scheduled tick stages what it measured in the spool with a restart checkpoint (``agent.outbox``,
``agent.restore``), so a crash loses at most the tick in progress, whatever the push cadence; on start,
before the worker runs, the agent seals what a crash left staged and takes over from the one before it:
bridges the gap by the counters, re-adopts the jobs whose processes still run, ends the others when
last seen.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from apscheduler.schedulers.background import BackgroundScheduler

from wattwatch import grid, wire
from wattwatch.agent.backfill import Backfill
from wattwatch.agent.discover import ProcessClassifier
from wattwatch.agent.jobs import ActiveJob, CpuTimeMeter, JobRegistry
from wattwatch.agent.kubelet import KubeletPods, PodLookup
from wattwatch.agent.local_api import LocalApi
from wattwatch.agent.memory import MemoryShareMeter
from wattwatch.agent.metrics import DeviceTotals, MetricsServer, build_registry
from wattwatch.agent.options import AgentOptions
from wattwatch.agent.outbox import Outbox
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.push import Pusher
from wattwatch.agent.requests import Refusals, ResolveVisible, parse_job_start, parse_span, parse_spans
from wattwatch.agent.restore import (
    ENDED_AT_RESTART,
    ENDED_PROCESS_GONE,
    Checkpoint,
    JobMark,
    PidStarts,
    adopt,
    gap_intervals,
    gone,
    read_boot_id,
)
from wattwatch.agent.sampler import Sampler
from wattwatch.agent.scrape import Scraper
from wattwatch.agent.sharing import ShareSettler
from wattwatch.agent.sim_use import sim_gpu_use
from wattwatch.agent.spool import SPOOL_FILE, Spool
from wattwatch.agent.tracker import GpuProcesses, ProcessTracker, discovered_by
from wattwatch.config import Settings
from wattwatch.errors import ConfigError
from wattwatch.limits import BoundError, fit_labels, fit_text
from wattwatch.sensors.base import DeviceInfo, Sensor
from wattwatch.tls import client_verify

log = logging.getLogger(__name__)


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
    kind: str  # tick | fine | start | end | stop | sync
    t_s: float
    job: ActiveJob | None = None
    job_id: str = ""
    done: threading.Event | None = None
    listed: dict[str, set[int]] | None = None  # an end's: NVML's processes on the job's GPUs when it came
    scheduled: bool = False  # a tick of the schedule (stages what it measured), not one asked for


class _Inbox:
    """The worker's events in arrival order: ``put`` from any thread; ``get`` (the worker's) waits at most
    ``timeout_s`` (None: for ever) and returns None when nothing came. A ``queue.Queue`` raises ``Empty``
    instead, which the worker would raise and catch every tick."""

    def __init__(self) -> None:
        self._items: deque[_Event] = deque()
        self._ready = threading.Condition(threading.Lock())

    def put(self, event: _Event) -> None:
        """Queue ``event`` and wake the worker."""
        with self._ready:
            self._items.append(event)
            self._ready.notify()

    def get(self, timeout_s: float | None) -> _Event | None:
        """The oldest event, waiting at most ``timeout_s`` for one; None when none came."""
        with self._ready:
            if not self._items:
                self._ready.wait(timeout_s)
            return self._items.popleft() if self._items else None

    def empty(self) -> bool:
        """Whether no event is queued."""
        return not self._items


def _ended_at_restart(mark: JobMark, last_seen_s: float) -> wire.Job:
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


def _grid_region(settings: Settings) -> str | None:
    """The agent's grid region in canonical form (None: not set); ConfigError saying what to give.

    Reads codecarbon's data files where installed (not the package: no pandas on the agent), else checks
    only the form and leaves the rest to the collector.
    """
    if not settings.grid_region:
        return None
    try:
        return grid.check_region(settings.grid_region)
    except grid.UnknownRegion as exc:
        raise ConfigError(f"{exc} (--grid-region or WATTWATCH_GRID_REGION)") from None


def tick_interval_s(interval_s: float, sensors: Sequence[Sensor]) -> float:
    """The agent's tick: ``interval_s``, shortened to the smallest ``max_poll_interval_s`` of the sensors
    that have one (RAPL: a counter that wraps twice between two reads loses whole ranges of energy);
    says so once, at INFO."""
    tick_s, why = interval_s, ""
    for sensor in sensors:
        limit_s = getattr(sensor, "max_poll_interval_s", None)
        if not isinstance(limit_s, int | float) or not 0 < limit_s < tick_s:
            continue
        tick_s = float(limit_s)
        periods = getattr(sensor, "wrap_periods_s", None)
        wraps = periods() if callable(periods) else {}
        if wraps:
            key = min(wraps, key=wraps.__getitem__)
            why = f"{sensor.name} {key} wraps every {wraps[key]:.1f} s at full power"
        else:
            why = f"{sensor.name} must be read at least every {tick_s:.1f} s"
    if why:
        log.info("%s; ticking every %.1f s instead of every %g s", why, tick_s, interval_s)
    return tick_s


class Agent:
    """One host's agent. ``start()`` it, then ``stop()`` it (flushes everything it measured).

    ``gpu_processes`` (the NVML sensor) enables following GPU processes: binding explicit jobs by
    process, discovering untagged ones (``options.discover``) and splitting a shared GPU by SM
    utilisation when it offers ``process_utilization``. ``procfs`` and ``pods`` default to what
    ``options`` names (``/proc``, the kubelet URL).

    While jobs send query spans, intervals close every ``fine_interval_s`` (default
    ``options.fine_interval_s``; 0: off) until ``options.fine_tick_hold_s`` after the last one: a fine tick
    only reads the sensors and closes intervals (no process tracking), so per-query energy sees the
    power's shape within the normal tick.
    """

    def __init__(
        self,
        settings: Settings,
        sensors: Sequence[Sensor],
        *,
        gpu_processes: GpuProcesses | None = None,
        resolve_visible: ResolveVisible | None = None,
        workload_hook: WorkloadHook | None = None,
        clock: Callable[[], float] = time.time,
        serve_socket: bool = True,
        options: AgentOptions | None = None,
        procfs: ProcFs | None = None,
        pods: PodLookup | None = None,
        fine_interval_s: float | None = None,
    ) -> None:
        self.settings = settings
        self.options = options or AgentOptions()
        self.host = settings.host or socket.gethostname()
        self.grid_region = _grid_region(settings)  # checked before anything is opened
        # Self-metrics: energy and power per device are added up as intervals close; the rest is read
        # at scrape time. Served only with settings.metrics_listen (checked first: nothing is open yet).
        self.device_totals = DeviceTotals()
        self.refused = Refusals()  # what the local API refused, by reason (limits.REASONS)
        self.metrics_registry = build_registry(self)
        self._metrics: MetricsServer | None = None
        if settings.metrics_listen:
            self._metrics = MetricsServer(self.metrics_registry, settings.metrics_listen)
        self.sampler = Sampler(sensors)
        self.interval_s = tick_interval_s(settings.interval_s, self.sampler.sensors)
        fine_s = self.options.fine_interval_s if fine_interval_s is None else fine_interval_s
        # Off when it would not be finer than the normal tick.
        self.fine_interval_s = fine_s if 0 < fine_s < self.interval_s else 0.0
        self.fine_tick_hold_s = self.options.fine_tick_hold_s
        self.registry = JobRegistry()
        self.spool = Spool(settings.home / SPOOL_FILE)
        agent_id = self.spool.meta("agent_id")
        if agent_id is None:
            agent_id = uuid.uuid4().hex
            self.spool.set_meta("agent_id", agent_id)
        self.agent_id = agent_id
        self.pusher = Pusher(
            self.spool,
            settings.collector_url,
            token=settings.token,
            verify=client_verify(settings.ca_file),
            poison_after=self.options.poison_after,
        )
        self.procfs = procfs or ProcFs(self.options.proc_root)
        self._owned_pods: KubeletPods | None = None
        if pods is None and self.options.kubelet_url and gpu_processes is not None:
            self._owned_pods = pods = KubeletPods(
                self.options.kubelet_url,
                token_file=self.options.kubelet_token_file,
                verify=self.options.kubelet_verify,
            )
        self.tracker: ProcessTracker | None = None
        if gpu_processes is not None:
            classifier = ProcessClassifier(self.procfs, self.host, pods) if self.options.discover else None
            self.tracker = ProcessTracker(
                self.registry,
                self.procfs,
                classifier,
                gpu_processes,
                [d.key for d in self.sampler.devices.values() if d.kind == "gpu"],
                utilization=getattr(gpu_processes, "process_utilization", None),
            )
        self.scraper: Scraper | None = None
        if self.options.scrape:
            tracker = self.tracker
            self.scraper = Scraper(
                self.options.scrape,
                lambda counts: self.outbox.add(counts=counts),
                job_of_pid=tracker.job_of_pid if tracker is not None else lambda pid: None,
                candidate_pids=tracker.gpu_pids if tracker is not None else set,
                proc_root=self.options.proc_root,
            )
        self._resolve_visible = resolve_visible
        self._hook = workload_hook
        self._clock = clock
        self._cpu = CpuTimeMeter(procfs=self.procfs)
        self._memory = MemoryShareMeter(procfs=self.procfs)
        self._events = _Inbox()
        self._enqueue_lock = threading.Lock()
        # Restarts (agent.restore): the checkpoint goes into the spool with every batch.
        self._boot_id = read_boot_id(self.procfs.root)
        self._pid_starts = PidStarts(self.procfs)
        self._watch: dict[str, dict[int, int]] = {}  # re-adopted job -> pid -> start ticks, until they end
        # Job id -> end events queued and not yet processed (local-API threads add, the worker removes).
        self._ends_queued: dict[str, int] = {}
        self._ends_lock = threading.Lock()
        self.outbox = Outbox(
            self.spool,
            agent_id,
            self.host,
            self.sampler.wire_devices,
            clock,
            boot_id=self._boot_id,
            refused=self.refused.add,
            grid_region=self.grid_region,
        )
        self._settler: ShareSettler | None = None
        if self.tracker is not None and self.tracker.weighs_by_utilization:
            self._settler = ShareSettler(
                self.tracker.weigh, lambda ivs: self.outbox.add(intervals=ivs, marks=self.sampler.marks_at(ivs))
            )
        self._backfill = Backfill()
        self._gpu_holders: dict[str, list[str]] | None = None  # the registry's holders, as of this sample
        self._gpu_keys = frozenset(k for k, d in self.sampler.devices.items() if d.kind == "gpu")
        self._worker = threading.Thread(target=self._work, name="wattwatch-sampler", daemon=True)
        self._ticking = False  # the worker ticks on its own schedule once started
        if not 0 < settings.push_interval_s < math.inf:
            raise ConfigError(
                f"the push interval must be a positive number of seconds, not {settings.push_interval_s!r}"
            )
        self.push_interval_s = settings.push_interval_s
        self._push_wake = threading.Event()  # set: push now (the worker sealed a batch)
        self._sealed_at_s = time.monotonic()  # when a batch was last sealed (the push is due a push interval on)
        self._push_halt = threading.Event()
        self._push_thread = threading.Thread(target=self._push_loop, name="wattwatch-push", daemon=True)
        self._fine_until = 0.0  # time.monotonic() until which intervals close every fine_interval_s
        self._fine_wake = threading.Event()
        self._fine_halt = threading.Event()
        self._fine_queued = False  # one fine tick at a time: a slow read skips ticks instead of piling them up
        self._fine_thread: threading.Thread | None = None
        if self.fine_interval_s:
            self._fine_thread = threading.Thread(target=self._fine_ticks, name="wattwatch-fine-tick", daemon=True)
        self._scheduler = BackgroundScheduler(daemon=True)
        self._api = LocalApi(settings.socket_path, self.handle) if serve_socket else None
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve /metrics (with ``settings.metrics_listen``), take the first reading, start the worker,
        the schedule and the local API."""
        if self._metrics is not None:
            self._metrics.start()  # first: a taken port must fail before anything else runs
        try:
            self._start()
        except BaseException:
            if self._metrics is not None:
                self._metrics.stop()
            raise

    @property
    def metrics_url(self) -> str | None:
        """The URL of this agent's /metrics while it is served, else None."""
        return self._metrics.url if self._metrics is not None else None

    def _start(self) -> None:
        self.outbox.recover()  # batches a crash left staged, before anything new is staged
        self.sampler.sample(self._shares)  # baseline: intervals start here
        self._restore()
        self._ticking = True
        self._worker.start()
        self._push_thread.start()
        if self._fine_thread is not None:
            self._fine_thread.start()
        every = {"trigger": "interval", "max_instances": 1, "coalesce": True}
        if self.scraper is not None:
            # Off the worker thread: a slow metrics endpoint must never delay a reading.
            self._scheduler.add_job(self.scraper.scrape_once, seconds=self.settings.interval_s, id="scrape", **every)
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

    def stop(
        self,
        flush_timeout_s: float = 10.0,
        *,
        say: Callable[[str], None] | None = None,
        give_up: threading.Event | None = None,
    ) -> None:
        """Close the last intervals, end discovered jobs, spool them and push what the collector will take;
        idempotent.

        The spool is drained for at most ``flush_timeout_s``, and only while rounds make progress: a
        collector that is away or takes nothing leaves the batches in the spool for the next start at once
        (a Ctrl-C must not hang on it), as does ``give_up`` being set (a second Ctrl-C). ``say`` is told
        how many batches are left (default: the log)."""
        if self._stopped:
            return
        self._stopped = True
        if self._metrics is not None:
            self._metrics.stop()
        if self._api is not None:
            self._api.stop()
        self._scheduler.shutdown(wait=True)
        self._push_halt.set()
        self._push_wake.set()
        if self._push_thread.is_alive():
            self._push_thread.join(timeout=flush_timeout_s)
        self._fine_halt.set()
        self._fine_wake.set()
        if self._fine_thread is not None and self._fine_thread.is_alive():
            self._fine_thread.join(timeout=2.0)
        done = threading.Event()
        self._put(_Event("stop", self._clock(), done=done))
        done.wait(timeout=flush_timeout_s)
        if self._settler is not None:
            self._settler.close()  # already done by the stop event, unless the worker is stuck
        self.seal()
        self._drain(flush_timeout_s, say, give_up)
        self.pusher.close()
        if self.scraper is not None:
            self.scraper.close()
        if self._owned_pods is not None:
            self._owned_pods.close()
        for sensor in self.sampler.sensors:
            sensor.close()
        self.spool.close()

    def _drain(self, timeout_s: float, say: Callable[[str], None] | None, give_up: threading.Event | None) -> None:
        """Push the spool at shutdown while the collector takes batches (see ``stop``); say what is left."""
        tell = say or (lambda line: log.warning("%s", line))
        left = self.spool.pending()
        started = time.monotonic()
        told = started
        if left > 1:
            tell(f"pushing the {left} batches left in the spool to {self.settings.collector_url}")
        while left and time.monotonic() - started < timeout_s and not (give_up and give_up.is_set()):
            if self.pusher.push_pending(force=True):
                break  # what is left waits for its own retry (agent.poison): the next start tries it again
            now_left = self.spool.pending()
            if now_left >= left:
                break  # nothing landed: the collector is away or refusing; waiting would only delay the stop
            left = now_left
            if time.monotonic() - told >= 1.0:
                told = time.monotonic()
                tell(f"{left} batches left to push")
        left = self.spool.pending()
        if left:
            why = f" ({self.pusher.stats.last_error})" if self.pusher.stats.last_error else ""
            tell(
                f"{left} batches not yet accepted by the collector{why} stay in {self.spool.path} for the next "
                "start; nothing is lost"
            )
        elif time.monotonic() - started >= 1.0:
            tell("spool drained: the collector has every batch")

    # -- local API -----------------------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one local-API request (see ``agent.local_api``)."""
        op = msg.get("op")
        if op == "ping":
            # The collector it pushes to: `wattwatch top` reads it there.
            return {"ok": True, "host": self.host, "agent_id": self.agent_id, "collector": self.settings.collector_url}
        if op == "job_start":
            return self.job_start(msg)
        if op == "job_end":
            return self.job_end(str(msg.get("id", "")))
        if op == "query":
            try:
                span = parse_span(msg, now_s=self._clock())
            except BoundError as exc:
                self.refused.add([exc])
                return {"ok": False, "error": str(exc), "field": exc.field, "reason": exc.reason}
            self.add_spans([span])
            return {"ok": True}
        if op == "queries":
            spans, errors = parse_spans(msg, now_s=self._clock())
            self.refused.add(errors)
            self.add_spans(spans)
            reply: dict[str, Any] = {"ok": not errors, "accepted": len(spans), "rejected": len(errors)}
            if errors:
                named = [str(exc) for exc in errors[:5]]
                reply["error"] = "; ".join(named) + (f"; and {len(errors) - 5} more" if len(errors) > 5 else "")
            return reply
        if op == "jobs":
            return {"ok": True, "jobs": self.jobs()}
        if op == "sim_gpu_use":  # simulated GPUs only: a process on a GPU outside its jobs (agent.sim_use)
            gpus = [d for d in self.sampler.devices.values() if d.kind == "gpu"]
            return sim_gpu_use(msg, self._hook, gpus, self._resolve_visible, self._clock)
        return {"ok": False, "error": f"unknown op {op!r}; expected ping, job_start, job_end, query, queries or jobs"}

    def job_start(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Register a job; the boundary reading is taken asynchronously at the returned ``t_s``."""
        gpus = [d for d in self.sampler.devices.values() if d.kind == "gpu"]
        job, devices, warning, dropped = parse_job_start(msg, gpus, self._resolve_visible)
        self.refused.add(dropped)
        t_s = self._put(_Event("start", 0.0, job=job), hook=lambda t: self._hook_start(job, t))
        reply: dict[str, Any] = {"ok": True, "id": job.id, "t_s": t_s, "host": self.host, "devices": devices}
        # Where the job's figures land: `wattwatch run` asks there for its summary.
        reply["collector"] = self.settings.collector_url
        if warning:
            reply["warning"] = warning
        return reply

    def job_end(self, job_id: str) -> dict[str, Any]:
        """End a job at now; the boundary reading is taken asynchronously at the returned ``t_s``."""
        if not job_id:
            raise ConfigError("job_end needs the job's id")
        hook = self._hook
        # Who is on the job's GPUs as it ends, asked now: by the time the worker gets to this end (after
        # the boundary reads queued before it, each waiting up to a counter refresh) a process that stays
        # a moment, sharing the GPU with another job, may have left, and would get no after phase.
        listed = None
        ending = self.registry.get(job_id) if self.tracker is not None else None
        if self.tracker is not None and ending is not None:
            listed = self.tracker.listed(ending.held_devices)
        # Counted before it is queued, so before the reply lets the process exit (see _end_gone).
        with self._ends_lock:
            self._ends_queued[job_id] = self._ends_queued.get(job_id, 0) + 1
        event = _Event("end", 0.0, job_id=job_id, listed=listed)
        t_s = self._put(event, hook=(lambda t: hook.job_ended(job_id, t)) if hook else None)
        return {"ok": True, "id": job_id, "t_s": t_s}

    def add_spans(self, spans: Sequence[wire.Query]) -> None:
        """Queue request, step or epoch spans for the next batch; request spans start (or extend) the
        fine tick."""
        self.outbox.add(queries=spans)
        if self._fine_thread is not None and any(s.kind == "query" for s in spans):
            self._fine_until = time.monotonic() + self.fine_tick_hold_s
            self._fine_wake.set()

    @property
    def fine_ticking(self) -> bool:
        """Whether intervals close every ``fine_interval_s`` now (query spans arrived lately)."""
        return self._fine_thread is not None and time.monotonic() < self._fine_until

    def jobs(self) -> list[dict[str, Any]]:
        """The active jobs, their devices and why the agent attributes them (the ``jobs`` op)."""
        return [
            {
                "id": j.id,
                "name": j.name,
                "kind": j.kind,
                "started_at_s": j.started_at_s,
                "devices": sorted(j.held_devices),
                "pids": sorted(j.all_pids),
                "discovered_by": discovered_by(j),
            }
            for j in self.registry.snapshot()
        ]

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

    def _due_tick(self) -> _Event | None:
        """The schedule's tick, now due: returned to be handled at once when no event is queued (the usual
        case: no queue round trip, no wake-up of the worker by itself), else queued behind the events
        already there (None). Stamped under the enqueue lock, as ``_put`` stamps, so events stay in time
        order either way."""
        with self._enqueue_lock:
            event = _Event("tick", self._clock(), scheduled=True)
            if self._events.empty():
                return event
            self._events.put(event)
        return None

    def _fine_ticks(self) -> None:
        # Sleeps until spans arrive; then enqueues a fine tick every fine_interval_s (on a fixed grid, so
        # a late wake-up does not stretch the next interval) until the hold runs out.
        period_s = self.fine_interval_s
        while not self._fine_halt.is_set():
            self._fine_wake.wait()
            self._fine_wake.clear()
            next_s = time.monotonic()
            while time.monotonic() < self._fine_until:
                next_s = max(next_s + period_s, time.monotonic() - period_s)
                if self._fine_halt.wait(max(0.0, next_s - time.monotonic())):
                    return
                if not self._fine_queued:
                    self._fine_queued = True
                    self._put(_Event("fine", 0.0))

    def tick(self, wait_s: float = 10.0, *, stage: bool = False) -> bool:
        """Do now what the schedule does every interval (read, follow the GPUs' processes; with ``stage``,
        make it durable in the spool) and wait at most ``wait_s`` for it; True when it was done."""
        done = threading.Event()
        self._put(_Event("tick", 0.0, done=done, scheduled=stage))
        return done.wait(wait_s)

    def drain(self, wait_s: float = 10.0) -> bool:
        """Wait at most ``wait_s`` until every event queued before this call has been handled (a job's
        start or end answered on the socket is handled after its answer); True when they were."""
        done = threading.Event()
        self._put(_Event("sync", 0.0, done=done))
        return done.wait(wait_s)

    def _work(self) -> None:
        # The worker is its own clock: it enqueues the schedule's ticks when they are due (behind the events
        # already queued, in time order), on a fixed grid; a tick that comes due while one is still being
        # read is skipped, not piled up. Cheaper than a scheduler thread handing each tick over.
        period_s = self.interval_s
        next_tick = time.monotonic() + period_s
        while True:
            now = time.monotonic()
            event = None
            if now >= next_tick and self._ticking:
                event = self._due_tick()
                next_tick += period_s * (math.floor((now - next_tick) / period_s) + 1)
            if event is None:
                event = self._events.get(max(0.0, next_tick - now) if self._ticking else None)
            if event is None:
                continue  # the next tick is due
            try:
                # A fine tick with events queued behind it is dropped: read now, it would land after their
                # boundaries and move them onto its own (counter-stale) reading; the next one comes soon.
                if event.kind == "sync":
                    pass  # drain(): nothing to do but mark the events before it handled
                elif event.kind != "fine" or self._events.empty():
                    self._process(event)
            except Exception:
                log.exception("agent worker failed on a %s event; continuing", event.kind)
            finally:
                if event.kind == "fine":
                    self._fine_queued = False
                if event.kind == "end":
                    with self._ends_lock:
                        left = self._ends_queued.get(event.job_id, 0) - 1
                        if left > 0:
                            self._ends_queued[event.job_id] = left
                        else:
                            self._ends_queued.pop(event.job_id, None)
                if event.done is not None:
                    event.done.set()
            if event.kind == "stop":
                return

    def _process(self, event: _Event) -> None:
        boundary = event.kind in ("start", "end")
        # The intervals closed here belong to the jobs that held the devices until now: sample first,
        # then apply what this event changes.
        self._gpu_holders = None  # read once per sample, by the first GPU interval it closes
        sampled = self.sampler.sample(self._shares, at_s=event.t_s if boundary else None, final=event.kind == "stop")
        # The backfill first: what it holds on a GPU waits there in order, shared intervals behind it included
        # (else the settler would hand a later one over first, and move the GPU's checkpoint past it).
        intervals = self._hold_shared(self._backfill.take(sampled, self._gpu_keys))
        jobs: list[wire.Job] = []
        if boundary and self.tracker is not None:
            jobs.extend(self.tracker.prune(event.t_s))
        if event.kind == "start" and event.job is not None:
            active, _new = self.registry.start(event.job)
            if self.tracker is not None:
                # One owner per process: discovered jobs holding the job's processes end at this same read.
                jobs.extend(self.tracker.claim(active, event.t_s))
                held = self.registry.get(active.id)
                if held is not None and held.bind_by_process and held.explicit and not held.held_devices:
                    # Not on a GPU NVML lists yet: what its GPU draws until a tick finds it is held for it.
                    self._backfill.expect(held.id, event.t_s, held.all_pids)
            jobs.append(active.to_wire())
        elif event.kind == "end":
            ended = self.registry.end(event.job_id)
            if ended is not None:
                jobs.append(ended.to_wire(ended_at_s=max(event.t_s, ended.started_at_s)))
                self._backfill.ended(ended.id, max(event.t_s, ended.started_at_s))
                if self.tracker is not None:
                    # Its processes still on the GPU start their "after" phase here, not an anonymous job.
                    jobs.extend(self.tracker.release(ended, max(event.t_s, ended.started_at_s), event.listed))
        elif event.kind == "tick":
            # Discovered jobs start and end at the tick that sees their processes come and go.
            if self.tracker is not None:
                jobs.extend(self.tracker.tick(self.sampler.last_t_s or event.t_s))
                explicit = {pid: j.id for j in self.registry.snapshot() if j.explicit for pid in j.pids}
                for job_id in self._backfill.seen(self.tracker.gpu_lineages(), explicit):
                    log.info("job %s found on a GPU late; the energy since it opened is given to it", job_id)
            jobs.extend(self._end_gone(self.sampler.last_t_s or event.t_s))
        elif event.kind == "stop" and self.tracker is not None:
            jobs.extend(self.tracker.end_all(self.sampler.last_t_s or event.t_s))
        if event.kind == "stop":
            intervals += self._hold_shared(self._backfill.flush())
        else:
            intervals += self._hold_shared(self._backfill.release(self.sampler.last_t_s or event.t_s))
        self._hand_over(intervals, jobs)
        if boundary:
            self.seal()  # a job's start and end reach the spool, and the checkpoint, at once
            self._push_wake.set()  # and the collector: reports see a job's end without waiting for the push
        elif event.scheduled and time.monotonic() - self._sealed_at_s >= self.push_interval_s - self.interval_s / 2:
            # The push is due (half a tick early at most: the last seal came a few ms into its tick, and a
            # push interval of whole ticks must not wait a tick more): this tick's records go straight into
            # the batch the push thread sends (one spool write, where a stage and then its seal were two).
            self.seal()
            self._push_wake.set()
        elif event.scheduled:
            self.outbox.stage()  # what this tick measured survives a crash
        if event.kind == "stop" and self._settler is not None:
            self._settler.close()

    def _hold_shared(self, intervals: list[wire.Interval]) -> list[wire.Interval]:
        """Count every interval, give those of GPUs several jobs held to the settler, return the rest.

        Which are shared is read off each interval's own holders (its shares), not off the sample that
        handed it over: the sampler may return an interval a sample late (``Sampler.sample``), after the
        holders changed."""
        self.device_totals.add(intervals)  # all of them, before some wait for the settler
        if self._settler is None or self.tracker is None:
            return intervals
        shared = [iv for iv in intervals if iv.device in self._gpu_keys and len(iv.shares) > 1]
        if not shared:
            return intervals
        owners = self.tracker.owners()
        for iv in shared:
            self._settler.hold(iv, tuple(iv.shares), owners)
        return [iv for iv in intervals if not (iv.device in self._gpu_keys and len(iv.shares) > 1)]

    def _hand_over(self, intervals: list[wire.Interval], jobs: list[wire.Job]) -> None:
        """Queue the records for the next batch with the checkpoint they make true."""
        self.outbox.add(
            intervals=intervals,
            jobs=jobs,
            marks=self.sampler.marks_at(intervals),
            open_jobs=(self._settled_t_s(), self._pid_starts.marks(self.registry.snapshot())),
        )

    def _settled_t_s(self) -> float:
        """The time up to which every device's intervals are handed over: the checkpoint's jobs are open
        as of then, so a job a restart ends "when last seen" ends where its sent energy ends (an interval
        the sampler or the backfill still held is lost with the agent and bridged as idle)."""
        held_s = self._backfill.held_from_s()
        settled_s = self.sampler.settled_t_s
        return settled_s if held_s is None else min(settled_s, held_s)

    # -- restarts ------------------------------------------------------------------------------------

    def _restore(self) -> None:
        """Take over from the agent that ran before (``agent.restore``): bridge each device's gap by its
        counter when it is continuous, re-adopt the jobs whose processes still run, end the others when
        they were last seen. Runs once, before the worker and the local API start."""
        t_s = self.sampler.last_t_s or self._clock()
        now = self.sampler.marks()
        text = self.spool.checkpoint()
        checkpoint = Checkpoint.from_json(text) if text else None
        if checkpoint is None:
            self.outbox.add(marks=now, open_jobs=(t_s, []))
            return
        same_boot = None in (checkpoint.boot_id, self._boot_id) or checkpoint.boot_id == self._boot_id
        adoption = adopt(checkpoint.jobs, self.procfs, same_boot=same_boot)
        jobs: list[wire.Job] = []
        for job in adoption.readopt:
            active, _new = self.registry.start(job)
            # Announced again: a collector that ended it while this host was silent opens it again.
            jobs.append(active.to_wire())
            self._hook_start(active, t_s)
            log.info("job %s re-adopted after a restart: its processes still run", job.id)
        self._watch.update(adoption.watch)
        if self.tracker is not None:
            jobs.extend(self.tracker.tick(t_s))  # discovered jobs are found again by their processes
        open_ids = {j.id for j in self.registry.snapshot()}
        ended = adoption.ended + [m for m in checkpoint.jobs if not m.explicit and m.id not in open_ids]
        for mark in ended:
            jobs.append(_ended_at_restart(mark, checkpoint.t_s))
            if self._hook is not None and mark.explicit:
                # Simulated boards learn that the job's processes are gone (a real GPU shows it by itself).
                self._hook.job_started(mark.id, mark.kind, mark.devices, min(mark.pids, default=None), t_s)
                self._hook.job_ended(mark.id, t_s)
            log.info("job %s ended when last seen (%.1f s ago): its processes are gone", mark.id, t_s - checkpoint.t_s)
        # The gap is the jobs' that were open before it and still are; the rest of it is idle.
        carried = open_ids & {m.id for m in checkpoint.jobs}
        gpu_holders = {
            key: [j for j in ids if j in carried]
            for key, ids in self.registry.holders().items()
            if key in self.sampler.devices and self.sampler.devices[key].kind == "gpu"
        }
        self._cpu.shares(self.registry.snapshot(), 0.0)  # CPU time counts from here (unknown over the gap)
        intervals = gap_intervals(
            checkpoint, now, gpu_holders, same_boot=same_boot, max_gap_s=self.settings.restart_bridge_max_s
        )
        intervals = self._hold_shared(intervals)
        self.outbox.add(
            intervals=intervals,
            jobs=jobs,
            marks=now,
            open_jobs=(t_s, self._pid_starts.marks(self.registry.snapshot())),
        )
        self.seal()

    def _end_gone(self, t_s: float) -> list[wire.Job]:
        """End the re-adopted jobs whose processes all ended without telling this agent."""
        out: list[wire.Job] = []
        for job_id, pids in list(self._watch.items()):
            if self.registry.get(job_id) is None:
                del self._watch[job_id]  # ended the usual way
                continue
            if not gone(pids, self.procfs):
                continue
            with self._ends_lock:
                if self._ends_queued.get(job_id):
                    # It told us before exiting (its end is queued behind this tick, which was slow enough
                    # to see the exit): that end, at its own boundary read, is the job's end.
                    continue
            del self._watch[job_id]
            ended = None
            while ended is None and self.registry.get(job_id) is not None:
                ended = self.registry.end(job_id)
            if ended is not None:
                record = ended.to_wire(ended_at_s=max(t_s, ended.started_at_s))
                out.append(msgspec.structs.replace(record, ended_by=ENDED_PROCESS_GONE))
                if self._hook is not None:
                    self._hook.job_ended(job_id, t_s)
                log.info("job %s ended: its processes are gone", job_id)
        return out

    def _shares(self, device: DeviceInfo, t_start_s: float, t_end_s: float) -> tuple[dict[str, float], float]:
        if device.kind == "gpu":
            # Several holders: weighed a moment later, when NVML's utilisation samples cover the whole
            # interval (``_hold_shared``). The registry changes only on this thread, after the sample: one
            # look serves every GPU of it.
            holders = self._gpu_holders
            if holders is None:
                holders = self._gpu_holders = self.registry.holders()
            return dict.fromkeys(holders.get(device.key, ()), 1.0), 0.0
        if device.kind == "cpu":
            return self._cpu.shares(self.registry.snapshot(), t_end_s - t_start_s, at_s=t_end_s)
        if device.kind == "dram":
            return self._memory.shares(self.registry.snapshot(), at_s=t_end_s)
        return {}, 0.0

    # -- batches -------------------------------------------------------------------------------------

    def seal(self) -> int | None:
        """Move everything measured so far into one durable batch; returns its seq (None if empty)."""
        self._sealed_at_s = time.monotonic()
        return self.outbox.seal()

    def stage(self) -> int | None:
        """Make what was measured since the last stage durable as part of the next batch (what every
        scheduled tick does); returns that batch's seq (None if nothing was measured)."""
        return self.outbox.stage()

    def flush(self) -> None:
        """Seal pending measurements and push the spool (what the push thread does every push interval)."""
        self.seal()
        self.pusher.push_pending()

    def _push_loop(self) -> None:
        # Woken by the worker when it has sealed a batch: every push_interval_s (at the first scheduled tick
        # after it) and at once when a job starts or ends. Seals itself only when the worker has not for a
        # push interval and a tick more (it is not ticking, or stuck in a read).
        patience_s = self.push_interval_s + self.interval_s + 1.0
        while not self._push_halt.is_set():
            woken = self._push_wake.wait(patience_s)
            if self._push_halt.is_set():
                return
            self._push_wake.clear()
            try:
                if woken or time.monotonic() - self._sealed_at_s < self.push_interval_s:
                    self.pusher.push_pending()
                else:
                    self.flush()
            except Exception:
                log.exception("agent push failed; what it measured stays spooled for the next push")
