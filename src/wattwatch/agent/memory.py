"""How a DRAM interval is shared: by the memory each job's processes hold, the rest to idle.

DRAM has no per-process energy counter, so this is an attribution rule, not a measurement: a job's
share of a DRAM interval is the memory its process trees hold over the host's installed memory
(``MemTotal`` in ``/proc/meminfo``); what no job holds (other processes, the page cache, free memory,
all of which the DIMMs keep refreshed) is the host's idle. A job's memory is the sum over its
processes of their proportional set size (``Pss`` in ``/proc/PID/smaps_rollup``: a page shared by n
processes counts 1/n to each, so forked workers are not counted n times over), or, where that file is
not readable (another user's process, a kernel before 4.14), the resident set (``/proc/PID/statm``).

Occupancy, not traffic: a job streaming through little memory draws more DRAM power than its share
says. Without per-process memory-bandwidth counters that is not visible, and sharing by the memory
held keeps every job's figure reproducible and energy conserved (jobs + idle == the interval's
energy). Every DRAM device of the host (one per package) is shared the same way.

Reading ``smaps_rollup`` walks the process's page tables (milliseconds for a process holding tens of
GiB), so a job's memory is re-read at most every ``refresh_s`` (and the installed memory with it, not every
tick); memory held changes slowly.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from wattwatch.agent.jobs import ActiveJob
from wattwatch.agent.procfs import ProcFs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Held:
    read_at: float  # monotonic
    roots: frozenset[int]
    memory_b: float


class MemoryShareMeter:
    """Per-job memory held (bytes) against the host's installed memory, for sharing DRAM intervals."""

    def __init__(
        self,
        procfs: ProcFs | None = None,
        *,
        refresh_s: float = 5.0,
        page_size_b: int | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._procfs = procfs or ProcFs()
        self._refresh_s = refresh_s
        self._page_size_b = page_size_b or _page_size_b()
        self._monotonic = monotonic
        self._held: dict[str, _Held] = {}
        self._memo: tuple[float, tuple[dict[str, float], float]] | None = None
        self._warned = False
        self._installed: tuple[float, float | None] | None = None  # (read at, MemTotal): re-read now and then

    def shares(self, jobs: Iterable[ActiveJob], *, at_s: float | None = None) -> tuple[dict[str, float], float]:
        """(job id -> bytes held, idle bytes: installed memory no job holds) for a DRAM interval.

        Jobs holding nothing on this host are left out. When the installed memory cannot be read there
        is no share to give: everything is idle (said once, at WARNING). With ``at_s`` (the interval's
        end), several DRAM devices closed at the same instant share one reading.
        """
        if at_s is not None and self._memo is not None and self._memo[0] == at_s:
            return self._memo[1]
        now = self._monotonic()
        if self._installed is None or now - self._installed[0] >= self._refresh_s:
            self._installed = (now, self.installed_b())  # re-read with the jobs' memory, not every tick
        total_b = self._installed[1]
        result: tuple[dict[str, float], float]
        if total_b is None:
            if not self._warned:
                self._warned = True
                log.warning("%s/meminfo has no MemTotal: DRAM energy is all the host's idle", self._procfs.root)
            result = {}, 0.0
        else:
            held: dict[str, float] = {}
            seen: set[str] = set()
            for job in jobs:
                seen.add(job.id)
                memory_b = self._job_memory_b(job)
                if memory_b > 0:
                    held[job.id] = memory_b
            for gone in set(self._held) - seen:
                del self._held[gone]
            # Resident sets can add up to more than is installed (shared pages, where Pss is unreadable):
            # idle never goes negative, the jobs then split the interval among themselves.
            result = held, max(total_b - sum(held.values()), 0.0)
        if at_s is not None:
            self._memo = (at_s, result)
        return result

    def installed_b(self) -> float | None:
        """``MemTotal`` in bytes, or None when ``meminfo`` cannot be read."""
        try:
            text = (self._procfs.root / "meminfo").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("MemTotal:"):
                return _kib_field(line)
        return None

    def process_memory_b(self, pid: int) -> float:
        """Memory process ``pid`` holds: its Pss, else its resident set; 0 when gone or unreadable."""
        root = self._procfs.root / str(pid)
        try:
            for line in (root / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss = _kib_field(line)
                    if pss is not None:
                        return pss
        except OSError:
            pass  # not ours to read, or gone: the resident set, if statm is readable
        try:
            fields = (root / "statm").read_text().split()
            return float(int(fields[1]) * self._page_size_b)
        except (OSError, IndexError, ValueError):
            return 0.0

    def _job_memory_b(self, job: ActiveJob) -> float:
        roots = frozenset(job.all_pids)
        now = self._monotonic()
        cached = self._held.get(job.id)
        if cached is not None and cached.roots == roots and now - cached.read_at < self._refresh_s:
            return cached.memory_b
        memory_b = sum(self.process_memory_b(pid) for pid in self._procfs.descendants(roots))
        self._held[job.id] = _Held(now, roots, memory_b)
        return memory_b


def _kib_field(line: str) -> float | None:
    """Bytes from a ``Name:   123 kB`` line of meminfo or smaps_rollup."""
    parts = line.split()
    try:
        return float(int(parts[1]) * 1024)
    except (IndexError, ValueError):
        return None


def _page_size_b() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 4096
