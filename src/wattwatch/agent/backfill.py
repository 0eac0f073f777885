"""GPU energy for jobs that NVML lists late: idle intervals held back, then given to the job found on them.

A job opened without ``CUDA_VISIBLE_DEVICES`` is bound to the GPUs NVML lists its processes on
(``tracker``). NVML may list a process some time after it is on the GPU (the simulator's
``process_delay_s`` flaw; the delay of a real driver is not known to us), so a job that opens before
its process is listed holds no GPU until the tick that sees it, and the energy its GPU drew meanwhile
went to idle: 92 % of a 1 s job lost at a 0.5-2 s delay (``benchmarks/timing_sweep.py``).

While such a job is waiting to be found, the intervals in which a GPU had no holder are held here
instead of sent. When a tick sees the job's process on a GPU, the held idle intervals of that GPU within
the job's window become the job's; intervals nobody claims go out as they were once no waiting job can
claim them any more (``wait_s`` after the job opened). A GPU's intervals leave in order: once one is
held, the ones after it wait behind it. A crash loses only what is held, and the checkpoint (which
advances with what is sent) bridges it by the counter on restart.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from wattwatch.protocol import wire

# How long after a job opens its GPU may still be found and given the energy since: longer than any
# process-list delay seen (the simulator's realistic flaws go to 2 s) plus a tick; bounded, so a job
# that never uses a GPU (a CPU-only job) holds the idle GPUs' intervals back no longer than this.
WAIT_S = 5.0


@dataclass
class _Waiting:
    job_id: str
    start_s: float
    pids: frozenset[int]
    end_s: float | None = None
    # The GPUs a tick found its processes on (None: not found yet). Kept until the job's wait is over:
    # an interval of its window may still reach ``take`` after that tick (the sampler holds a tick's
    # interval until the next reading).
    keys: frozenset[str] | None = None


class Backfill:
    """Holds idle GPU intervals while jobs that bind by process have not been seen on a GPU yet."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self.wait_s = wait_s
        self._waiting: dict[str, _Waiting] = {}
        self._queues: dict[str, deque[wire.Interval]] = {}

    @property
    def waiting(self) -> frozenset[str]:
        """Ids of the jobs that may still be given held energy."""
        return frozenset(self._waiting)

    def expect(self, job_id: str, start_s: float, pids: Iterable[int]) -> None:
        """Job ``job_id`` opened at ``start_s`` with root processes ``pids`` and holds no GPU yet."""
        pids = frozenset(pids)
        if pids:
            self._waiting[job_id] = _Waiting(job_id, start_s, pids)

    def ended(self, job_id: str, end_s: float) -> None:
        """The job ended at ``end_s``: only what it drew before that can still become its."""
        waiting = self._waiting.get(job_id)
        if waiting is not None:
            waiting.end_s = end_s

    def take(self, intervals: Iterable[wire.Interval], gpus: frozenset[str]) -> list[wire.Interval]:
        """The intervals to send now; the rest are held (idle GPU intervals a waiting job may claim, and
        whatever follows them on the same GPU). An idle interval of a found job's GPU within its window
        is given to it."""
        out: list[wire.Interval] = []
        for iv in intervals:
            if iv.device in gpus and not iv.shares:
                iv = self._give_found(iv)
            queue = self._queues.get(iv.device)
            if queue or (iv.device in gpus and not iv.shares and self._claimable(iv)):
                self._queues.setdefault(iv.device, deque()).append(iv)
            else:
                out.append(iv)
        return out

    def seen(
        self, lineages: Mapping[int, tuple[tuple[int, ...], frozenset[str]]], explicit: Mapping[int, str]
    ) -> list[str]:
        """A tick saw these processes (pid -> (its lineage, the GPUs NVML lists it on)); ``explicit`` maps the
        root pids of the running explicit jobs to their ids. A process belongs to the nearest root in its
        lineage, as the tracker decides (a job opened inside another job's process tree owns what runs
        under it): each waiting job found so is given its GPUs' held idle intervals within its window,
        and those still to come. Returns the ids of the jobs found."""
        roots = dict(explicit)
        for waiting in self._waiting.values():
            roots.update(dict.fromkeys(waiting.pids, waiting.job_id))  # an ended job's roots too
        keys_of: dict[str, set[str]] = {}
        for lineage, keys in lineages.values():
            nearest = next((roots[p] for p in lineage if p in roots), None)
            if nearest is not None:
                keys_of.setdefault(nearest, set()).update(keys)
        found: list[str] = []
        for waiting in self._waiting.values():
            found_on = keys_of.get(waiting.job_id)
            if waiting.keys is not None or not found_on:
                continue
            waiting.keys = frozenset(found_on)
            for key in found_on:
                queue = self._queues.get(key)
                if queue:
                    self._queues[key] = deque(_give(iv, waiting) for iv in queue)
            found.append(waiting.job_id)
        return found

    def release(self, now_s: float) -> list[wire.Interval]:
        """Drop jobs whose wait (``wait_s`` from their start) is over, then send every held interval no
        waiting job can claim (each GPU's in order, up to the first one that may still be claimed)."""
        for job_id in [j for j, w in self._waiting.items() if now_s - w.start_s > self.wait_s]:
            del self._waiting[job_id]
        out: list[wire.Interval] = []
        for queue in self._queues.values():
            while queue and not (not queue[0].shares and self._claimable(queue[0])):
                out.append(queue.popleft())
        self._queues = {k: q for k, q in self._queues.items() if q}
        return out

    def held_from_s(self) -> float | None:
        """Where the earliest interval held here starts (None: none is held)."""
        return min((q[0].t_start_s for q in self._queues.values() if q), default=None)

    def flush(self) -> list[wire.Interval]:
        """Everything held, as it is (the agent is stopping)."""
        out = [iv for queue in self._queues.values() for iv in queue]
        self._queues.clear()
        self._waiting.clear()
        return out

    def _claimable(self, iv: wire.Interval) -> bool:
        return any(w.keys is None and _within(iv, w) for w in self._waiting.values())

    def _give_found(self, iv: wire.Interval) -> wire.Interval:
        for waiting in self._waiting.values():
            if waiting.keys is not None and iv.device in waiting.keys and _within(iv, waiting):
                return _give(iv, waiting)
        return iv


def _give(iv: wire.Interval, waiting: _Waiting) -> wire.Interval:
    """``iv`` as the job's, when it is idle and in the job's window."""
    if iv.shares or not _within(iv, waiting):
        return iv
    return msgspec.structs.replace(iv, shares={waiting.job_id: 1.0}, idle_weight=0.0)


def _within(iv: wire.Interval, waiting: _Waiting) -> bool:
    """Whether ``iv`` lies in the job's window (its boundary reads split intervals at its start and end)."""
    end_s = waiting.end_s if waiting.end_s is not None else float("inf")
    return waiting.start_s <= iv.t_start_s and iv.t_end_s <= end_s
