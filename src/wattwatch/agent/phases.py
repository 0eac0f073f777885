"""The GPU processes explicit jobs have owned, and their phases outside those jobs (``agent.tracker`` says
when a phase starts and ends; this module keeps the books).

A process that has opened a job is never again an anonymous job: outside its jobs it is in a phase of
them, a job of its own on the wire (``proc-HOST-PID-START.N``) labelled ``after`` the job that owned it
last (``wire.PHASE_LABEL``, ``wire.PHASE_OF_LABEL``); the tracker relabels it ``setup`` of the next job the
process opens. A claim lives while its process does (same pid and start time).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from wattwatch.agent.discover import Discovered
from wattwatch.agent.jobs import DISCOVERED_BY, ActiveJob
from wattwatch.protocol import wire
from wattwatch.protocol.units import JobKind

_BAD_ID_CHARS = re.compile(r"[^A-Za-z0-9_.:@/-]")


@dataclass
class Claim:
    """A process an explicit job owned: which job last, and its phase job while it is outside its jobs."""

    start_ticks: int
    job_id: str
    job_name: str
    job_kind: JobKind
    phases: int = 0  # phase jobs made for it so far (they number the phase ids)
    phase_id: str | None = None


class PhaseBook:
    """Claims by pid, and the running phase jobs by id. Used from the agent's worker thread only."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._claims: dict[int, Claim] = {}
        self._phases: dict[str, Discovered] = {}

    def remember(self, pid: int, start_ticks: int, job: ActiveJob) -> Claim:
        """Explicit ``job`` owns process ``pid`` now: a phase it was in is over (its count stays)."""
        claim = self._claims.get(pid)
        if claim is None or claim.start_ticks != start_ticks:
            claim = self._claims[pid] = Claim(start_ticks, job.id, job.name, job.kind)
        else:
            claim.job_id, claim.job_name, claim.job_kind = job.id, job.name, job.kind
            claim.phase_id = None
        return claim

    def running(self, pid: int, start_ticks: int) -> Discovered | None:
        """The phase process ``pid`` is in now, if any."""
        claim = self._claims.get(pid)
        if claim is None or claim.start_ticks != start_ticks or claim.phase_id is None:
            return None
        return self._phases.get(claim.phase_id)

    def phase_of(self, pid: int, start_ticks: int) -> Discovered | None:
        """The phase of a claimed process found outside any explicit job (a new one if it is in none);
        None for a process no explicit job ever owned."""
        claim = self._claims.get(pid)
        if claim is None or claim.start_ticks != start_ticks:
            return None
        return self.running(pid, start_ticks) or self.new_phase(pid, claim)

    def new_phase(self, pid: int, claim: Claim) -> Discovered:
        """A new ``after`` phase of the job that owned ``pid`` last."""
        claim.phases += 1
        phase_id = _BAD_ID_CHARS.sub("-", f"proc-{self.host}-{pid}-{claim.start_ticks}.{claim.phases}")[-200:]
        reason = f"after:{claim.job_id}"
        labels = {DISCOVERED_BY: reason, wire.PHASE_LABEL: "after", wire.PHASE_OF_LABEL: claim.job_id}
        info = Discovered(phase_id, f"after {claim.job_name}"[:200], claim.job_kind, reason, pid, labels)
        claim.phase_id = phase_id
        self._phases[phase_id] = info
        return info

    def forget(
        self, running_ids: Collection[str], listed: Mapping[int, object], alive: Callable[[int, int], bool]
    ) -> None:
        """Drop phases no longer running (``running_ids``: the discovered jobs held now), and the claims of
        processes that exited (``alive(pid, start_ticks)``, asked only for those NVML no longer ``listed``)."""
        for phase_id in [p for p in self._phases if p not in running_ids]:
            del self._phases[phase_id]
        for pid, claim in list(self._claims.items()):
            if claim.phase_id is not None and claim.phase_id not in self._phases:
                claim.phase_id = None
            if pid not in listed and not alive(pid, claim.start_ticks):
                del self._claims[pid]

    def ended(self, phase_id: str) -> None:
        """Phase ``phase_id`` is over (its process opened a job)."""
        self._phases.pop(phase_id, None)
