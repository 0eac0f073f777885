"""What the agent measured since its last batch, and the sealing of it into one durable, numbered batch.

Every thread adds here (the worker its intervals and job records, the local API its spans, the scraper
its counts); the periodic push seals whatever is there into the spool under the next sequence number,
which is what makes a batch idempotent at the collector.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from wattwatch import wire
from wattwatch.agent.spool import Spool


class Outbox:
    """Pending wire records of one agent; thread-safe."""

    def __init__(
        self,
        spool: Spool,
        agent_id: str,
        host: str,
        devices: Callable[[], list[wire.Device]],
        clock: Callable[[], float],
    ) -> None:
        self.spool = spool
        self.agent_id = agent_id
        self.host = host
        self._devices = devices
        self._clock = clock
        self._lock = threading.Lock()
        self._intervals: list[wire.Interval] = []
        self._jobs: list[wire.Job] = []
        self._queries: list[wire.Query] = []
        self._counts: list[wire.QueryCount] = []

    def add(
        self,
        *,
        intervals: Iterable[wire.Interval] = (),
        jobs: Iterable[wire.Job] = (),
        queries: Iterable[wire.Query] = (),
        counts: Iterable[wire.QueryCount] = (),
    ) -> None:
        """Queue records for the next batch."""
        with self._lock:
            self._intervals.extend(intervals)
            self._jobs.extend(jobs)
            self._queries.extend(queries)
            self._counts.extend(counts)

    def seal(self) -> int | None:
        """Move everything pending into one durable batch; returns its seq (None when nothing was pending)."""
        with self._lock:
            if not (self._intervals or self._jobs or self._queries or self._counts):
                return None
            intervals, jobs, queries, counts = self._intervals, self._jobs, self._queries, self._counts
            self._intervals, self._jobs, self._queries, self._counts = [], [], [], []
        seq = self.spool.next_seq()
        batch = wire.Batch(
            agent_id=self.agent_id,
            seq=seq,
            host=self.host,
            sent_at_s=self._clock(),
            devices=self._devices(),
            intervals=intervals,
            jobs=jobs,
            queries=queries,
            query_counts=counts,
        )
        self.spool.put(seq, wire.encode(batch), created_s=batch.sent_at_s)
        return seq
