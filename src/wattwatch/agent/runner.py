"""Wires the agent: sensors -> sampler -> batches -> spool -> push, driven by a worker's ticks and by
job boundaries from the local API; on every tick the process tracker (``agent.tracker``) follows the
GPUs' processes, and the scraper (``agent.scrape``) reads serving engines' counters on its own schedule.

Threads: the worker (``agent.worker``) ticks every ``interval_s`` on a fixed grid and owns the sampler,
the tracker and the job registry's changes; the local API (``agent.local_api``, answered here) only
queues events (``agent.events``) and never waits for a reading. The push thread (``agent.push_cadence``)
pushes every ``push_interval_s`` and at once when a job starts or ends; the fine ticker
(``agent.fine_ticks``) closes intervals finely while query spans arrive. APScheduler runs the scrape.
The self-metrics server (``agent.metrics``, with ``--metrics-listen``) answers scrapes from its own
threads, reading thread-safe snapshots of the agent's state.

On start, before the worker runs, the agent seals what a crash left staged and takes over from the one
before it (``agent.restore``, ``agent.takeover``); on stop it closes the last intervals and drains the
spool while the collector takes batches.
"""

from __future__ import annotations

import logging
import math
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler

from wattwatch.agent.discover import ProcessClassifier
from wattwatch.agent.events import Event, Inbox, WorkloadHook
from wattwatch.agent.fine_ticks import FineTicker
from wattwatch.agent.jobs import JobRegistry
from wattwatch.agent.kubelet import KubeletPods, PodLookup
from wattwatch.agent.local_api import LocalApi
from wattwatch.agent.metrics import DeviceTotals, MetricsServer, build_registry
from wattwatch.agent.options import AgentOptions
from wattwatch.agent.outbox import Outbox
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.push import Pusher
from wattwatch.agent.push_cadence import PushCadence
from wattwatch.agent.requests import Refusals, ResolveVisible, parse_job_start, parse_span, parse_spans
from wattwatch.agent.restore import read_boot_id
from wattwatch.agent.sampler import Sampler
from wattwatch.agent.scrape import Scraper
from wattwatch.agent.sim_use import sim_gpu_use
from wattwatch.agent.spool import SPOOL_FILE, Spool, disk_full
from wattwatch.agent.takeover import ReadoptedJobs
from wattwatch.agent.tracker import GpuProcesses, ProcessTracker, discovered_by
from wattwatch.agent.worker import Worker
from wattwatch.carbon import grid
from wattwatch.config import Settings
from wattwatch.errors import ConfigError
from wattwatch.protocol import wire
from wattwatch.protocol.limits import BoundError
from wattwatch.sensors.base import Sensor
from wattwatch.tls import client_verify

log = logging.getLogger(__name__)


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
        self._events = Inbox()
        # Restarts (agent.restore): the checkpoint goes into the spool with every batch.
        self._boot_id = read_boot_id(self.procfs.root)
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
        if not 0 < settings.push_interval_s < math.inf:
            raise ConfigError(
                f"the push interval must be a positive number of seconds, not {settings.push_interval_s!r}"
            )
        self.push_interval_s = settings.push_interval_s
        self._pushes = PushCadence(
            self.outbox, self.pusher, self.spool, settings.collector_url, self.push_interval_s, self.interval_s
        )
        self._readopted = ReadoptedJobs(self.registry, self.procfs, workload_hook)
        self._worker = Worker(
            sampler=self.sampler,
            registry=self.registry,
            tracker=self.tracker,
            outbox=self.outbox,
            pushes=self._pushes,
            events=self._events,
            device_totals=self.device_totals,
            procfs=self.procfs,
            readopted=self._readopted,
            hook=workload_hook,
            clock=clock,
            interval_s=self.interval_s,
        )
        self._fine: FineTicker | None = None
        if self.fine_interval_s:
            self._fine = FineTicker(self.fine_interval_s, self.fine_tick_hold_s, self._worker.put_fine)
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
        try:
            self.outbox.recover()  # batches a crash left staged, before anything new is staged
        except (sqlite3.OperationalError, OSError) as exc:
            if not disk_full(exc):
                raise
            self.outbox.spool_unwritable(exc)  # they stay staged, under their own seqs: the next start seals them
        self.sampler.sample(self._worker.shares)  # baseline: intervals start here
        self._worker.restore(self.spool, self._boot_id, self.settings.restart_bridge_max_s)
        self._worker.start()
        self._pushes.start()
        if self._fine is not None:
            self._fine.start()
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
        self._pushes.stop(flush_timeout_s)
        if self._fine is not None:
            self._fine.stop()
        self._worker.stop(flush_timeout_s)
        self.seal()
        held_intervals, _spans = self.outbox.held()
        if held_intervals:
            # The next start bridges the time from the spool's checkpoint on (agent.restore): flagged, not lost.
            log.warning(
                "%d interval(s) held in memory could not be written to the spool (%s) and go with the agent; "
                "the next start accounts for their time from the spool's checkpoint on",
                held_intervals,
                self.outbox.unwritable or "not writable",
            )
        self._pushes.drain(flush_timeout_s, say, give_up)
        self.pusher.close()
        if self.scraper is not None:
            self.scraper.close()
        if self._owned_pods is not None:
            self._owned_pods.close()
        for sensor in self.sampler.sensors:
            sensor.close()
        self.spool.close()

    # -- local API -----------------------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one local-API request (see ``agent.local_api``)."""
        op = msg.get("op")
        if op == "ping":
            # The collector it pushes to: `wattwatch top` reads it there.
            return {
                "ok": True,
                "host": self.host,
                "agent_id": self.agent_id,
                "collector": self.settings.collector_url,
                "spool": self.spool_state(),
            }
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

    def spool_state(self) -> dict[str, Any]:
        """The spool's writability as ``ping`` answers it (``wattwatch doctor`` shows it): why it cannot be
        written now ("" when it can), what waits in memory and what was dropped since the agent started."""
        held_intervals, held_spans = self.outbox.held()
        return {
            "path": str(self.spool.path),
            "unwritable": self.outbox.unwritable,
            "held_intervals": held_intervals,
            "held_spans": held_spans,
            "dropped_intervals": self.outbox.dropped.intervals,
            "dropped_spans": self.outbox.dropped_spans,
        }

    def job_start(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Register a job; the boundary reading is taken asynchronously at the returned ``t_s``."""
        gpus = [d for d in self.sampler.devices.values() if d.kind == "gpu"]
        job, devices, warning, dropped = parse_job_start(msg, gpus, self._resolve_visible)
        self.refused.add(dropped)
        t_s = self._worker.put(Event("start", 0.0, job=job), hook=lambda t: self._worker.hook_start(job, t))
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
        # Counted before it is queued, so before the reply lets the process exit (see ReadoptedJobs.end_gone).
        self._readopted.end_queued(job_id)
        event = Event("end", 0.0, job_id=job_id, listed=listed)
        t_s = self._worker.put(event, hook=(lambda t: hook.job_ended(job_id, t)) if hook else None)
        return {"ok": True, "id": job_id, "t_s": t_s}

    def add_spans(self, spans: Sequence[wire.Query]) -> None:
        """Queue request, step or epoch spans for the next batch; request spans start (or extend) the
        fine tick."""
        self.outbox.add(queries=spans)
        if self._fine is not None and any(s.kind == "query" for s in spans):
            self._fine.hold()

    @property
    def fine_ticking(self) -> bool:
        """Whether intervals close every ``fine_interval_s`` now (query spans arrived lately)."""
        return self._fine is not None and self._fine.ticking

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

    # -- worker ----------------------------------------------------------------------------------------

    def tick(self, wait_s: float = 10.0, *, stage: bool = False) -> bool:
        """Do now what the schedule does every interval (read, follow the GPUs' processes; with ``stage``,
        make it durable in the spool) and wait at most ``wait_s`` for it; True when it was done."""
        return self._worker.tick(wait_s, stage=stage)

    def drain(self, wait_s: float = 10.0) -> bool:
        """Wait at most ``wait_s`` until every event queued before this call has been handled (a job's
        start or end answered on the socket is handled after its answer); True when they were."""
        return self._worker.drain(wait_s)

    # -- batches -------------------------------------------------------------------------------------

    def seal(self) -> int | None:
        """Move everything measured so far into one durable batch; returns its seq (None if empty)."""
        return self._pushes.seal()

    def stage(self) -> int | None:
        """Make what was measured since the last stage durable as part of the next batch (what every
        scheduled tick does); returns that batch's seq (None if nothing was measured, or the spool's disk
        is full: it waits in memory)."""
        return self._pushes.stage()

    def flush(self) -> None:
        """Seal pending measurements and push the spool (what the push thread does every push interval)."""
        self._pushes.flush()
