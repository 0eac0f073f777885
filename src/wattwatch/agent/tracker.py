"""Follows the processes NVML lists on the GPUs, tick by tick: binds them to explicit jobs, starts and
ends discovered jobs, and weighs the jobs sharing a GPU by their processes' SM utilisation (when,
``agent.sharing`` decides).

Cheap on purpose (it runs on every tick): one NVML process list per GPU, one ``stat`` read per GPU
process, and the rest (ancestry, environment, cgroups, kubelet) only the first time a process is seen,
cached by (pid, start time) so a reused pid is never mistaken for the old process.

One owner per process at every instant. An inference server or a training script puts its model on the
GPU before it opens its job, so the tracker first finds it as a discovered (often anonymous) job. When
an explicit job starts (SDK, ``wattwatch run``, the integrations), ``claim`` runs at that same boundary
read: every GPU process in the job's process trees leaves the discovered job that held it, and a
discovered job left with no process ends there, relabelled as the new job's ``setup`` phase
(``wire.PHASE_LABEL``, ``wire.PHASE_OF_LABEL``). When the explicit job ends while its process stays on
the GPU, ``release`` starts that process's ``after`` phase at the end boundary; if the process opens
another job, the phase becomes that job's setup. So a process that has opened a job is never again an
anonymous job: between its jobs it is a phase of them (``agent.phases`` keeps those books). Phases are
ordinary jobs on the wire (energy is split and conserved exactly as for any job: jobs + idle =
measured); reports hide them and show their energy and time with the job they belong to
(``setup_energy_j``, ``after_energy_j``). A discovered job whose processes open several different jobs
becomes the setup of the last one to claim it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from wattwatch.agent.discover import Discovered, ProcessClassifier
from wattwatch.agent.jobs import DISCOVERED_BY, ActiveJob, JobRegistry
from wattwatch.agent.phases import PhaseBook
from wattwatch.agent.procfs import ProcFs
from wattwatch.errors import SensorError
from wattwatch.protocol import wire

log = logging.getLogger(__name__)


class GpuProcesses(Protocol):
    """What the agent needs from the NVML sensor to follow processes."""

    def running_pids(self, key: str) -> set[int]:
        """Pids NVML lists on GPU ``key``."""
        ...


# (GPU key, since_s, until_s) -> pid -> mean SM utilisation over the samples in (since_s, until_s]
UtilizationFn = Callable[[str, float, float | None], Mapping[int, float]]


@dataclass
class _Known:
    """A GPU process as first seen: its ancestry and (lazily) its discovered job."""

    start_ticks: int
    lineage: list[int]
    discovered: Discovered | None = None
    classified: bool = False


@dataclass
class _Found:
    info: Discovered
    pids: set[int] = field(default_factory=set)
    devices: set[str] = field(default_factory=set)


class ProcessTracker:
    """Per-tick view of GPU processes. Driven from the agent's worker thread; ``job_of_pid`` and
    ``gpu_pids`` may be read from other threads (they read immutable snapshots)."""

    def __init__(
        self,
        registry: JobRegistry,
        procfs: ProcFs,
        classifier: ProcessClassifier | None,
        gpu_processes: GpuProcesses,
        gpu_keys: Sequence[str],
        utilization: UtilizationFn | None = None,
    ) -> None:
        self.registry = registry
        self.procfs = procfs
        self.classifier = classifier
        self._gpu = gpu_processes
        self._gpu_keys = list(gpu_keys)
        self._utilization = utilization
        self._known: dict[int, _Known] = {}
        self._discovered: set[str] = set()  # ids this tracker holds a registry reference for
        self._owners: dict[int, str] = {}  # GPU pid -> job id, as of the last tick
        self._lineages: dict[int, tuple[int, ...]] = {}
        self._missing: dict[int, int] = {}  # pid NVML lists but /proc lacks -> ticks in a row
        self._keys_of: dict[int, frozenset[str]] = {}  # GPU pid -> the GPUs NVML listed it on, last tick
        self._listed: dict[int, frozenset[str]] = {}  # the same, with the pids /proc no longer has
        # Processes explicit jobs owned and their phases outside them (with discovery only: else such a
        # process is idle outside its jobs, like any process no job holds).
        self._book = PhaseBook(classifier.host) if classifier is not None else None
        self._seen_missing: set[int] = set()
        self._warned = False
        self._lock = threading.Lock()

    # -- per tick -------------------------------------------------------------------------------------

    def _running_pids(self, key: str) -> set[int]:
        """NVML's processes on GPU ``key``; none when the list cannot be read (that GPU is skipped this time)."""
        try:
            return self._gpu.running_pids(key)
        except SensorError as exc:
            log.debug("no process list for %s: %s", key, exc)
            return set()

    def tick(self, t_s: float) -> list[wire.Job]:
        """Look at the GPUs' processes now; returns the job records that changed (started, rebound, ended)."""
        explicit_jobs = {j.id: j for j in self.registry.snapshot() if j.explicit}
        explicit_roots = {pid: j.id for j in explicit_jobs.values() for pid in j.pids}
        owners: dict[int, str] = {}
        lineages: dict[int, tuple[int, ...]] = {}
        keys_of: dict[int, set[str]] = {}
        self._seen_missing = set()
        binds: dict[str, set[str]] = {}
        found: dict[str, _Found] = {}
        listed: dict[int, set[str]] = {}
        for key in self._gpu_keys:
            for pid in self._running_pids(key):
                listed.setdefault(pid, set()).add(key)
                known = self._lookup(pid)
                if known is None:
                    continue
                lineages[pid] = tuple(known.lineage)
                keys_of.setdefault(pid, set()).add(key)
                explicit = next((explicit_roots[p] for p in known.lineage if p in explicit_roots), None)
                if explicit is not None:
                    owners[pid] = explicit
                    binds.setdefault(explicit, set()).add(key)
                    if self._book is not None:
                        self._book.remember(pid, known.start_ticks, explicit_jobs[explicit])
                    continue
                # A process that has opened a job is in a phase of its jobs between them, never anonymous.
                phase = self._book.phase_of(pid, known.start_ticks) if self._book is not None else None
                info = phase or self._classify(pid, known)
                if info is None:
                    continue
                owners[pid] = info.job_id
                entry = found.setdefault(info.job_id, _Found(info))
                entry.pids.add(info.root_pid)
                entry.devices.add(key)
        for gone in set(self._known) - set(lineages):
            del self._known[gone]
        self._missing = {pid: n for pid, n in self._missing.items() if pid in self._seen_missing}
        self._keys_of = {pid: frozenset(keys) for pid, keys in keys_of.items()}
        self._listed = {pid: frozenset(keys) for pid, keys in listed.items()}
        with self._lock:
            self._owners, self._lineages = owners, lineages
        out = self._bind(binds) + self._apply(found, t_s)
        if self._book is not None:
            self._book.forget(self._discovered, lineages, self._alive)
        return out

    def gpu_lineages(self) -> dict[int, tuple[tuple[int, ...], frozenset[str]]]:
        """Every process NVML listed at the last tick: pid -> (its lineage up to init, the GPUs it is on).
        A process that has exited since (NVML may list it late) has only itself as its lineage."""
        with self._lock:
            lineages = self._lineages
        return {pid: (lineages.get(pid, (pid,)), keys) for pid, keys in self._listed.items()}

    def prune(self, t_s: float) -> list[wire.Job]:
        """End, at ``t_s`` (a job's boundary read), every discovered job or phase whose processes have all
        exited since the last tick: else it would hold its GPUs until that tick comes, sharing them with a
        job opening now (a process that exits as its job ends is in its ``after`` phase until then)."""
        out: list[wire.Job] = []
        for job in self.registry.snapshot():
            if job.id not in self._discovered or job.explicit or not job.proc_pids:
                continue
            if any(self._still_running(pid) for pid in job.proc_pids):
                continue
            self._discovered.discard(job.id)
            self.registry.set_discovered(job.id, (), ())
            ended = self.registry.end(job.id)
            if ended is not None:
                out.append(ended.to_wire(ended_at_s=max(t_s, ended.started_at_s)))
                log.info("job %s ended: its processes exited", job.id)
        if out:
            gone = {j.id for j in out}
            with self._lock:
                self._owners = {pid: owner for pid, owner in self._owners.items() if owner not in gone}
        return out

    def _still_running(self, pid: int) -> bool:
        known = self._known.get(pid)
        return known is None or self._alive(pid, known.start_ticks)

    def end_all(self, t_s: float) -> list[wire.Job]:
        """End every discovered job (the agent is stopping)."""
        return self._apply({}, t_s)

    # -- explicit job boundaries ----------------------------------------------------------------------

    def claim(self, job: ActiveJob, t_s: float) -> list[wire.Job]:
        """Explicit ``job`` started at ``t_s`` (its boundary read is taken): it takes, from the discovered
        jobs holding them as of the last tick, the GPU processes in its process trees; a discovered job
        left with none ends at ``t_s`` as ``job``'s setup phase. Binds ``job`` (when it binds by process)
        to those processes' GPUs at once. Returns the records that changed, not ``job``'s own."""
        roots = job.all_pids
        with self._lock:
            owners, lineages = self._owners, self._lineages
        taken: dict[str, set[int]] = {}
        for pid, owner in owners.items():
            if owner == job.id or owner not in self._discovered or not roots.intersection(lineages.get(pid, ())):
                continue
            holder = self.registry.get(owner)
            if holder is not None and not holder.explicit:  # an explicit job merged into it keeps it
                taken.setdefault(owner, set()).add(pid)
        if not taken:
            return []
        new_owners = dict(owners)
        keys: set[str] = set()
        out: list[wire.Job] = []
        for owner, pids in sorted(taken.items()):
            for pid in pids:
                new_owners[pid] = job.id
                keys |= self._keys_of.get(pid, frozenset())
                known = self._known.get(pid)
                if known is not None and self._book is not None:
                    self._book.remember(pid, known.start_ticks, job)
            left = [pid for pid, o in new_owners.items() if o == owner]
            if not left:
                out += self._end_as_phase(owner, "setup", job.id, t_s)
                continue
            left_keys = frozenset(k for pid in left for k in self._keys_of.get(pid, ()))
            if self.registry.set_discovered(owner, {self._root_of(pid) for pid in left}, left_keys):
                kept = self.registry.get(owner)
                if kept is not None:
                    out.append(kept.to_wire())
        with self._lock:
            self._owners = new_owners
        if job.bind_by_process and keys:
            self.registry.bind(job.id, keys, "NVML lists its process")
        return out

    def listed(self, keys: Iterable[str]) -> dict[str, set[int]]:
        """NVML's processes on each GPU of ``keys``, now (for ``release``: taken as a job ends). Safe from
        any thread."""
        return {key: self._running_pids(key) for key in keys if key in self._gpu_keys}

    def release(self, job: ActiveJob, t_s: float, listed: Mapping[str, set[int]] | None = None) -> list[wire.Job]:
        """Explicit ``job`` ended at ``t_s``: each of its processes NVML listed on its GPUs as it ended
        (``listed``, from ``listed``; else asked now) and still alive starts its ``after`` phase at ``t_s``,
        so it neither becomes an anonymous job at the next tick nor leaves its energy to idle or to a job
        sharing its GPU. Only with discovery on (else a process outside its jobs is idle)."""
        roots = job.all_pids
        book = self._book
        if book is None or not roots:
            return []
        explicit_roots = {pid for j in self.registry.snapshot() if j.explicit for pid in j.pids}
        # `wattwatch run` ends its job once its command has exited; its own process does none of the job's
        # GPU work and stays only to print the job's summary, so it gets no after phase (simulated GPUs
        # list that process for the job, having no real child to list).
        wrapper = set(job.pids) if job.labels.get(DISCOVERED_BY) == "run" else set()
        keys_of: dict[int, set[str]] = {}
        for key in sorted(job.held_devices):
            for pid in listed[key] if listed is not None and key in listed else self._running_pids(key):
                if pid in wrapper:
                    continue
                known = self._peek(pid)
                # The nearest root decides: a process still inside another explicit job stays that job's.
                nearest = next((p for p in known.lineage if p in roots or p in explicit_roots), None) if known else None
                if nearest is not None and nearest not in explicit_roots:
                    keys_of.setdefault(pid, set()).add(key)
        if not keys_of:
            return []
        with self._lock:
            new_owners, new_lineages = dict(self._owners), dict(self._lineages)
        out: list[wire.Job] = []
        for pid, keys in sorted(keys_of.items()):
            start_ticks = self._known[pid].start_ticks
            new_lineages[pid] = tuple(self._known[pid].lineage)  # a next job's claim looks it up before a tick
            if book.running(pid, start_ticks) is not None:
                continue  # still in the phase it was in before the job could claim it (no tick since)
            info = book.new_phase(pid, book.remember(pid, start_ticks, job))
            phase = ActiveJob(
                id=info.job_id,
                name=info.name,
                kind=info.kind,
                started_at_s=t_s,
                labels=dict(info.labels),
                bind_by_process=True,
                explicit=False,
                proc_pids=frozenset({pid}),
                proc_devices=frozenset(keys),
            )
            active, _new = self.registry.start(phase)
            self._discovered.add(info.job_id)
            new_owners[pid] = info.job_id
            out.append(active.to_wire())
        self._keys_of = {**self._keys_of, **{pid: frozenset(keys) for pid, keys in keys_of.items()}}
        with self._lock:
            self._owners, self._lineages = new_owners, new_lineages
        return out

    def _end_as_phase(self, job_id: str, phase: str, of: str, t_s: float) -> list[wire.Job]:
        """End discovered job ``job_id`` at ``t_s`` as the ``phase`` of job ``of``."""
        self._discovered.discard(job_id)
        if self._book is not None:
            self._book.ended(job_id)
        self.registry.set_discovered(job_id, (), ())
        ended = self.registry.end(job_id)
        if ended is None:
            return []
        ended.labels = {**ended.labels, wire.PHASE_LABEL: phase, wire.PHASE_OF_LABEL: of}
        log.info("job %s ended: its processes opened job %s; it is that job's %s", job_id, of, phase)
        return [ended.to_wire(ended_at_s=max(t_s, ended.started_at_s))]

    def _alive(self, pid: int, start_ticks: int) -> bool:
        st = self.procfs.stat(pid)
        return st is not None and st.start_ticks == start_ticks

    def _root_of(self, pid: int) -> int:
        known = self._known.get(pid)
        return known.discovered.root_pid if known is not None and known.discovered is not None else pid

    def _peek(self, pid: int) -> _Known | None:
        """Like ``_lookup`` between ticks: no missing-process bookkeeping."""
        st = self.procfs.stat(pid)
        if st is None:
            return None
        known = self._known.get(pid)
        if known is None or known.start_ticks != st.start_ticks:
            known = self._known[pid] = _Known(st.start_ticks, self.procfs.lineage(pid))
        return known

    def _lookup(self, pid: int) -> _Known | None:
        st = self.procfs.stat(pid)
        if st is None:
            # A process that just exited is still in NVML's list for a tick; one that stays missing
            # lives in a PID namespace the agent cannot see.
            self._seen_missing.add(pid)
            self._missing[pid] = self._missing.get(pid, 0) + 1
            if self._missing[pid] >= 3 and not self._warned:
                self._warned = True
                log.warning(
                    "NVML lists pid %d but %s/%d does not exist: the agent must see the host's processes "
                    "(Kubernetes: hostPID: true; Docker: --pid=host; or set WATTWATCH_PROC_ROOT to the "
                    "host's /proc) to attribute GPU processes",
                    pid,
                    self.procfs.root,
                    pid,
                )
            return None
        known = self._known.get(pid)
        if known is None or known.start_ticks != st.start_ticks:
            known = _Known(st.start_ticks, self.procfs.lineage(pid))
            self._known[pid] = known
        return known

    def _classify(self, pid: int, known: _Known) -> Discovered | None:
        if self.classifier is None:
            return None
        if not known.classified:
            known.discovered = self.classifier.classify(pid, known.lineage)
            known.classified = True
            if known.discovered is not None:
                d = known.discovered
                log.info("pid %d is job %s (%s, %s)", pid, d.job_id, d.kind, d.reason)
        return known.discovered

    def _bind(self, binds: Mapping[str, Iterable[str]]) -> list[wire.Job]:
        """Bind explicit jobs started without CUDA_VISIBLE_DEVICES to the GPUs NVML shows them on."""
        out: list[wire.Job] = []
        for job_id, keys in binds.items():
            job = self.registry.get(job_id)
            if job is None or not job.bind_by_process:
                continue
            if self.registry.bind(job_id, keys, "NVML lists its process"):
                bound = self.registry.get(job_id)
                if bound is not None:
                    out.append(bound.to_wire())
        return out

    def _apply(self, found: Mapping[str, _Found], t_s: float) -> list[wire.Job]:
        out: list[wire.Job] = []
        for job_id, entry in found.items():
            if job_id not in self._discovered:
                info = entry.info
                job = ActiveJob(
                    id=job_id,
                    name=info.name,
                    kind=info.kind,
                    started_at_s=t_s,
                    labels=dict(info.labels),
                    bind_by_process=True,  # neutral when an explicit start of the same id merges in
                    explicit=False,
                    proc_pids=frozenset(entry.pids),
                    proc_devices=frozenset(entry.devices),
                )
                active, new = self.registry.start(job)
                if not new:
                    self.registry.set_discovered(job_id, entry.pids, entry.devices)
                    active = self.registry.get(job_id) or active
                self._discovered.add(job_id)
                out.append(active.to_wire())
            elif self.registry.set_discovered(job_id, entry.pids, entry.devices):
                current = self.registry.get(job_id)
                if current is not None:
                    out.append(current.to_wire())
        for job_id in sorted(self._discovered - set(found)):
            self._discovered.discard(job_id)
            self.registry.set_discovered(job_id, (), ())
            ended = self.registry.end(job_id)
            if ended is not None:
                out.append(ended.to_wire(ended_at_s=max(t_s, ended.started_at_s)))
                log.info("job %s ended: its processes left the GPUs", job_id)
        return out

    # -- sharing --------------------------------------------------------------------------------------

    @property
    def weighs_by_utilization(self) -> bool:
        """Whether shared GPUs are split by per-process utilisation (else always equally)."""
        return self._utilization is not None

    def owners(self) -> Mapping[int, str]:
        """GPU pid -> job id as of the last tick (an immutable snapshot: keep it to weigh later)."""
        return self._owners

    def weigh(
        self,
        key: str,
        since_s: float,
        holders: Sequence[str],
        owners: Mapping[int, str] | None = None,
        until_s: float | None = None,
    ) -> dict[str, float]:
        """Weights of the jobs holding GPU ``key``: the summed SM utilisation of each job's processes in
        NVML's samples in ``(since_s, until_s]`` (None: up to now); equal weights when NVML has none."""
        if len(holders) <= 1 or self._utilization is None:
            return dict.fromkeys(holders, 1.0)
        try:
            util = self._utilization(key, since_s, until_s)
        except SensorError as exc:
            log.debug("no process utilisation for %s: %s", key, exc)
            util = {}
        if not util:
            return dict.fromkeys(holders, 1.0)
        weights = dict.fromkeys(holders, 0.0)
        owners = self._owners if owners is None else owners
        for pid, sm_percent in util.items():
            owner = owners.get(pid)
            if owner in weights and sm_percent > 0:
                weights[owner] += float(sm_percent)
        # All zero (NVML saw only processes we could not place): the collector splits equally.
        return weights

    # -- lookups for other threads --------------------------------------------------------------------

    def gpu_pids(self) -> set[int]:
        """GPU processes and their ancestors as of the last tick (where serving processes are)."""
        with self._lock:
            return {p for lineage in self._lineages.values() for p in lineage}

    def job_of_pid(self, pid: int) -> str | None:
        """The job of a GPU process or of an ancestor of one (a server whose engine runs in a child)."""
        with self._lock:
            owners, lineages = self._owners, self._lineages
        if pid in owners:
            return owners[pid]
        for gpu_pid, lineage in lineages.items():
            if pid in lineage and gpu_pid in owners:
                return owners[gpu_pid]
        return None


def discovered_by(job: ActiveJob) -> str:
    """How a job became known (``sdk``, ``environ:WATTWATCH_JOB``, ``slurm:…``, ``kubernetes:…``, ``heuristic:…``)."""
    return job.labels.get(DISCOVERED_BY, "sdk" if job.explicit else "")
