"""What the agent measured since its last batch, and the sealing of it into one durable, numbered batch.

Every thread adds here (the worker its intervals and job records, the local API its spans, the scraper
its counts); the periodic push seals whatever is there into the spool under the next sequence number,
which is what makes a batch idempotent at the collector.

A sealed batch is decoded once as the collector will decode it: a record outside ``wattwatch.limits`` (a
counter glitch's absurd energy, a scraped count beyond 2**31 - 1) is left out alone and counted, rather
than sent to cost the whole batch its place at the collector.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping

from wattwatch import wire
from wattwatch.agent.restore import Checkpoint, DeviceMark, JobMark
from wattwatch.agent.spool import Spool
from wattwatch.limits import BoundError

log = logging.getLogger(__name__)

# A record of a batch's lists, as a decoding error names it: ``intervals[3].energy_j``.
_RECORD = re.compile(r"^(intervals|jobs|queries|query_counts)\[(\d+)\]")
# A batch with more bad records than this goes as it is (the collector's refusal names the first).
MAX_LEFT_OUT = 1000


class Outbox:
    """Pending wire records of one agent; thread-safe."""

    def __init__(
        self,
        spool: Spool,
        agent_id: str,
        host: str,
        devices: Callable[[], list[wire.Device]],
        clock: Callable[[], float],
        boot_id: str | None = None,
        refused: Callable[[list[BoundError]], None] | None = None,
    ) -> None:
        self.spool = spool
        self.agent_id = agent_id
        self.host = host
        self._devices = devices
        self._clock = clock
        self._refused = refused
        self._lock = threading.Lock()
        self._seal_lock = threading.Lock()
        self._intervals: list[wire.Interval] = []
        self._jobs: list[wire.Job] = []
        self._queries: list[wire.Query] = []
        self._counts: list[wire.QueryCount] = []
        # The restart checkpoint as of what was added so far: per device the reading where its last added
        # interval ends, and the open jobs as of the last worker event.
        self._boot_id = boot_id
        self._marks: dict[str, DeviceMark] = {}
        self._open_jobs: list[JobMark] | None = None
        self._open_at_s = 0.0

    def add(
        self,
        *,
        intervals: Iterable[wire.Interval] = (),
        jobs: Iterable[wire.Job] = (),
        queries: Iterable[wire.Query] = (),
        counts: Iterable[wire.QueryCount] = (),
        marks: Mapping[str, DeviceMark] | None = None,
        open_jobs: tuple[float, list[JobMark]] | None = None,
    ) -> None:
        """Queue records for the next batch. ``marks`` (the readings where ``intervals`` end) and
        ``open_jobs`` (the jobs open from a time on) update the checkpoint sealed with them."""
        with self._lock:
            self._intervals.extend(intervals)
            self._jobs.extend(jobs)
            self._queries.extend(queries)
            self._counts.extend(counts)
            if marks:
                for key, mark in marks.items():
                    known = self._marks.get(key)
                    if known is None or mark.t_s >= known.t_s:
                        self._marks[key] = mark
            if open_jobs is not None and open_jobs[0] >= self._open_at_s:
                self._open_at_s, self._open_jobs = open_jobs

    def seal(self) -> int | None:
        """Move everything pending into one durable batch; returns its seq (None when nothing was pending)."""
        # One seal at a time (the push job's and the worker's): the spool must store checkpoints in the
        # order of their batches, or a restart would bridge from a reading some batch already covers.
        with self._seal_lock:
            return self._seal()

    def _seal(self) -> int | None:
        with self._lock:
            if not (self._intervals or self._jobs or self._queries or self._counts):
                return None
            intervals, jobs, queries, counts = self._intervals, self._jobs, self._queries, self._counts
            self._intervals, self._jobs, self._queries, self._counts = [], [], [], []
            checkpoint = None
            if self._open_jobs is not None:
                checkpoint = Checkpoint(self._open_at_s, self._boot_id, dict(self._marks), list(self._open_jobs))
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
        self.spool.put(
            seq, self._fitted(batch), created_s=batch.sent_at_s, checkpoint=checkpoint.to_json() if checkpoint else None
        )
        return seq

    def _fitted(self, batch: wire.Batch) -> bytes:
        """The batch encoded, less each record the collector's decoding would refuse (logged and counted)."""
        left_out: list[BoundError] = []
        while True:
            body = wire.encode(batch)
            try:
                wire.decode_batch(body)
                break
            except BoundError as exc:
                record = _RECORD.match(exc.field)
                if record is None or len(left_out) >= MAX_LEFT_OUT:
                    break  # not one record's fault: the collector's answer will say what
                del getattr(batch, record[1])[int(record[2])]
                left_out.append(exc)
        if left_out:
            more = f" (and {len(left_out) - 1} more)" if len(left_out) > 1 else ""
            log.warning("batch %d: left out a record outside the bounds: %s%s", batch.seq, left_out[0], more)
            if self._refused is not None:
                self._refused(left_out)
        return body
