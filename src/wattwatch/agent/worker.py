"""The agent's worker thread: it ticks on a fixed grid (every ``interval_s``) and handles every event in
order, so every reading is taken in event order and every interval is closed with the job set that really
held the device. It owns the sampler, the process tracker and the job registry's changes; the local API
only queues events and never waits for a reading.

Each scheduled tick stages what it measured in the spool with a restart checkpoint (``agent.outbox``), so
a crash loses at most the tick in progress; on start, before the worker runs, ``restore`` takes over from
the agent before it (``agent.restore``, ``agent.takeover``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from wattwatch.agent.backfill import Backfill
from wattwatch.agent.events import Event, Inbox, WorkloadHook
from wattwatch.agent.jobs import ActiveJob, CpuTimeMeter, JobRegistry
from wattwatch.agent.memory import MemoryShareMeter
from wattwatch.agent.metrics import DeviceTotals
from wattwatch.agent.outbox import Outbox
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.push_cadence import PushCadence
from wattwatch.agent.restore import Checkpoint, PidStarts, adopt, gap_intervals
from wattwatch.agent.sampler import Sampler
from wattwatch.agent.sharing import ShareSettler
from wattwatch.agent.spool import Spool
from wattwatch.agent.takeover import ReadoptedJobs, ended_at_restart
from wattwatch.agent.tracker import ProcessTracker
from wattwatch.protocol import wire
from wattwatch.sensors.base import DeviceInfo

log = logging.getLogger(__name__)


class Worker:
    """Takes the readings and turns them, and the job boundaries, into records for the next batch."""

    def __init__(
        self,
        *,
        sampler: Sampler,
        registry: JobRegistry,
        tracker: ProcessTracker | None,
        outbox: Outbox,
        pushes: PushCadence,
        events: Inbox,
        device_totals: DeviceTotals,
        procfs: ProcFs,
        readopted: ReadoptedJobs,
        hook: WorkloadHook | None,
        clock: Callable[[], float],
        interval_s: float,
    ) -> None:
        self.sampler = sampler
        self.registry = registry
        self.tracker = tracker
        self.outbox = outbox
        self.pushes = pushes
        self.events = events
        self.device_totals = device_totals
        self.procfs = procfs
        self.readopted = readopted
        self.interval_s = interval_s
        self._hook = hook
        self._clock = clock
        self._cpu = CpuTimeMeter(procfs=procfs)
        self._memory = MemoryShareMeter(procfs=procfs)
        self._enqueue_lock = threading.Lock()
        # Restarts (agent.restore): the checkpoint goes into the spool with every batch.
        self.pid_starts = PidStarts(procfs)
        self.settler: ShareSettler | None = None
        if tracker is not None and tracker.weighs_by_utilization:
            self.settler = ShareSettler(
                tracker.weigh, lambda ivs: outbox.add(intervals=ivs, marks=sampler.marks_at(ivs))
            )
        self._backfill = Backfill()
        self._gpu_holders: dict[str, list[str]] | None = None  # the registry's holders, as of this sample
        self._gpu_keys = frozenset(k for k, d in sampler.devices.items() if d.kind == "gpu")
        self._thread = threading.Thread(target=self._run, name="wattwatch-sampler", daemon=True)
        self._ticking = False  # the worker ticks on its own schedule once started
        self._fine_queued = False  # one fine tick at a time: a slow read skips ticks instead of piling them up

    def start(self) -> None:
        """Start ticking on the schedule, on the worker's own thread."""
        self._ticking = True
        self._thread.start()

    # -- events in -----------------------------------------------------------------------------------

    def hook_start(self, job: ActiveJob, t_s: float) -> None:
        """Tell the workload hook (simulated GPUs) that ``job`` started at ``t_s``."""
        if self._hook is not None:
            self._hook.job_started(job.id, job.kind, sorted(job.devices), min(job.pids, default=None), t_s)

    def put(self, event: Event, hook: Callable[[float], None] | None = None) -> float:
        """Queue ``event``, stamped now unless it has a time (a start's job starts then); returns its time.
        ``hook`` is told the time before the event is queued."""
        # Time is taken under the lock so events enter the queue in time order.
        with self._enqueue_lock:
            event.t_s = self._clock() if event.t_s == 0.0 else event.t_s
            if event.job is not None:
                event.job.started_at_s = event.t_s
            if hook is not None:
                hook(event.t_s)
            self.events.put(event)
        return event.t_s

    def put_fine(self) -> None:
        """Queue a fine tick unless one is queued already."""
        if not self._fine_queued:
            self._fine_queued = True
            self.put(Event("fine", 0.0))

    def _due_tick(self) -> Event | None:
        """The schedule's tick, now due: returned to be handled at once when no event is queued (the usual
        case: no queue round trip, no wake-up of the worker by itself), else queued behind the events
        already there (None). Stamped under the enqueue lock, as ``put`` stamps, so events stay in time
        order either way."""
        with self._enqueue_lock:
            event = Event("tick", self._clock(), scheduled=True)
            if self.events.empty():
                return event
            self.events.put(event)
        return None

    def tick(self, wait_s: float = 10.0, *, stage: bool = False) -> bool:
        """Do now what the schedule does every interval (read, follow the GPUs' processes; with ``stage``,
        make it durable in the spool) and wait at most ``wait_s`` for it; True when it was done."""
        done = threading.Event()
        self.put(Event("tick", 0.0, done=done, scheduled=stage))
        return done.wait(wait_s)

    def drain(self, wait_s: float = 10.0) -> bool:
        """Wait at most ``wait_s`` until every event queued before this call has been handled; True when
        they were."""
        done = threading.Event()
        self.put(Event("sync", 0.0, done=done))
        return done.wait(wait_s)

    def stop(self, wait_s: float) -> None:
        """Close the last intervals (a final reading), end discovered jobs; waits at most ``wait_s``."""
        done = threading.Event()
        self.put(Event("stop", self._clock(), done=done))
        done.wait(timeout=wait_s)
        if self.settler is not None:
            self.settler.close()  # already done by the stop event, unless the worker is stuck

    # -- the loop ------------------------------------------------------------------------------------

    def _run(self) -> None:
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
                event = self.events.get(max(0.0, next_tick - now) if self._ticking else None)
            if event is None:
                continue  # the next tick is due
            try:
                # A fine tick with events queued behind it is dropped: read now, it would land after their
                # boundaries and move them onto its own (counter-stale) reading; the next one comes soon.
                if event.kind == "sync":
                    pass  # drain(): nothing to do but mark the events before it handled
                elif event.kind != "fine" or self.events.empty():
                    self._process(event)
            except Exception:
                log.exception("agent worker failed on a %s event; continuing", event.kind)
            finally:
                if event.kind == "fine":
                    self._fine_queued = False
                if event.kind == "end":
                    self.readopted.end_handled(event.job_id)
                if event.done is not None:
                    event.done.set()
            if event.kind == "stop":
                return

    def _process(self, event: Event) -> None:
        boundary = event.kind in ("start", "end")
        # The intervals closed here belong to the jobs that held the devices until now: sample first,
        # then apply what this event changes.
        self._gpu_holders = None  # read once per sample, by the first GPU interval it closes
        sampled = self.sampler.sample(self.shares, at_s=event.t_s if boundary else None, final=event.kind == "stop")
        # The backfill first: what it holds on a GPU waits there in order, shared intervals behind it included
        # (else the settler would hand a later one over first, and move the GPU's checkpoint past it).
        intervals = self.hold_shared(self._backfill.take(sampled, self._gpu_keys))
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
            jobs.extend(self.readopted.end_gone(self.sampler.last_t_s or event.t_s))
        elif event.kind == "stop" and self.tracker is not None:
            jobs.extend(self.tracker.end_all(self.sampler.last_t_s or event.t_s))
        if event.kind == "stop":
            intervals += self.hold_shared(self._backfill.flush())
        else:
            intervals += self.hold_shared(self._backfill.release(self.sampler.last_t_s or event.t_s))
        self._hand_over(intervals, jobs)
        if boundary:
            self.pushes.seal()  # a job's start and end reach the spool, and the checkpoint, at once
            self.pushes.push_soon()  # and the collector: reports see a job's end without waiting for the push
        elif event.scheduled and self.pushes.due():
            # The push is due: this tick's records go straight into the batch the push thread sends (one
            # spool write, where a stage and then its seal were two).
            self.pushes.seal()
            self.pushes.push_soon()
        elif event.scheduled:
            self.pushes.stage()  # what this tick measured survives a crash (or waits in memory: a full disk)
        if event.kind == "stop" and self.settler is not None:
            self.settler.close()

    # -- records out ---------------------------------------------------------------------------------

    def hold_shared(self, intervals: list[wire.Interval]) -> list[wire.Interval]:
        """Count every interval, give those of GPUs several jobs held to the settler, return the rest.

        Which are shared is read off each interval's own holders (its shares), not off the sample that
        handed it over: the sampler may return an interval a sample late (``Sampler.sample``), after the
        holders changed."""
        self.device_totals.add(intervals)  # all of them, before some wait for the settler
        if self.settler is None or self.tracker is None:
            return intervals
        shared = [iv for iv in intervals if iv.device in self._gpu_keys and len(iv.shares) > 1]
        if not shared:
            return intervals
        owners = self.tracker.owners()
        for iv in shared:
            self.settler.hold(iv, tuple(iv.shares), owners)
        return [iv for iv in intervals if not (iv.device in self._gpu_keys and len(iv.shares) > 1)]

    def _hand_over(self, intervals: list[wire.Interval], jobs: list[wire.Job]) -> None:
        """Queue the records for the next batch with the checkpoint they make true."""
        self.outbox.add(
            intervals=intervals,
            jobs=jobs,
            marks=self.sampler.marks_at(intervals),
            open_jobs=(self._settled_t_s(), self.pid_starts.marks(self.registry.snapshot())),
        )

    def _settled_t_s(self) -> float:
        """The time up to which every device's intervals are handed over: the checkpoint's jobs are open
        as of then, so a job a restart ends "when last seen" ends where its sent energy ends (an interval
        the sampler or the backfill still held is lost with the agent and bridged as idle)."""
        held_s = self._backfill.held_from_s()
        settled_s = self.sampler.settled_t_s
        return settled_s if held_s is None else min(settled_s, held_s)

    def shares(self, device: DeviceInfo, t_start_s: float, t_end_s: float) -> tuple[dict[str, float], float]:
        """Who held ``device`` over the interval, and how much each (the sampler's ``SharesFn``)."""
        if device.kind == "gpu":
            # Several holders: weighed a moment later, when NVML's utilisation samples cover the whole
            # interval (``hold_shared``). The registry changes only on this thread, after the sample: one
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

    # -- restarts ------------------------------------------------------------------------------------

    def restore(self, spool: Spool, boot_id: str | None, max_gap_s: float) -> None:
        """Take over from the agent that ran before (``agent.restore``): bridge each device's gap by its
        counter when it is continuous (up to ``max_gap_s``), re-adopt the jobs whose processes still run,
        end the others when they were last seen. Runs once, before the worker and the local API start."""
        t_s = self.sampler.last_t_s or self._clock()
        now = self.sampler.marks()
        text = spool.checkpoint()
        checkpoint = Checkpoint.from_json(text) if text else None
        if checkpoint is None:
            self.outbox.add(marks=now, open_jobs=(t_s, []))
            return
        same_boot = None in (checkpoint.boot_id, boot_id) or checkpoint.boot_id == boot_id
        adoption = adopt(checkpoint.jobs, self.procfs, same_boot=same_boot)
        jobs: list[wire.Job] = []
        for job in adoption.readopt:
            active, _new = self.registry.start(job)
            # Announced again: a collector that ended it while this host was silent opens it again.
            jobs.append(active.to_wire())
            self.hook_start(active, t_s)
            log.info("job %s re-adopted after a restart: its processes still run", job.id)
        self.readopted.watch(adoption.watch)
        if self.tracker is not None:
            jobs.extend(self.tracker.tick(t_s))  # discovered jobs are found again by their processes
        open_ids = {j.id for j in self.registry.snapshot()}
        ended = adoption.ended + [m for m in checkpoint.jobs if not m.explicit and m.id not in open_ids]
        for mark in ended:
            jobs.append(ended_at_restart(mark, checkpoint.t_s))
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
        intervals = gap_intervals(checkpoint, now, gpu_holders, same_boot=same_boot, max_gap_s=max_gap_s)
        intervals = self.hold_shared(intervals)
        self.outbox.add(
            intervals=intervals,
            jobs=jobs,
            marks=now,
            open_jobs=(t_s, self.pid_starts.marks(self.registry.snapshot())),
        )
        self.pushes.seal()
