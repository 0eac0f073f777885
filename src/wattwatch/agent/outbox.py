"""What the agent measured since its last batch, staged tick by tick and sealed into one numbered batch.

Every thread adds here (the worker its intervals and job records, the local API its spans, the scraper
its counts). Each scheduled tick stages what was added since the last one (``stage``): durable in the
spool at once, as a part of the next batch, under that batch's reserved sequence number. The push (every
push interval, and at once on a job's start or end) seals the parts into one batch (``seal``): a fleet
sends one batch per push interval, not one per tick, and a crash loses nothing that was staged: the next
start seals a crash's parts (``recover``). The sequence number is what makes a batch idempotent at the
collector.

A sealed batch is decoded once as the collector will decode it: a record outside ``wattwatch.protocol.limits`` (a
counter glitch's absurd energy, a scraped count beyond 2**31 - 1) is left out alone and counted, rather
than sent to cost the whole batch its place at the collector.

A stage or seal that cannot write (a full disk: ``spool.disk_full``) puts its records back where they
were, in order, and they wait in memory for the next write (``agent.held``: bounded; the time it had to
drop goes out as ``gap`` intervals). The threads that stage and seal catch the error and tell
``spool_unwritable``: one WARNING when the spool becomes unwritable, one INFO when a write succeeds again.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from wattwatch.agent import held
from wattwatch.agent.restore import Checkpoint, DeviceMark, JobMark
from wattwatch.agent.spool import Spool
from wattwatch.protocol import wire
from wattwatch.protocol.limits import BoundError

log = logging.getLogger(__name__)

# A record of a batch's lists, as a decoding error names it: ``intervals[3].energy_j``.
_RECORD = re.compile(r"^(intervals|jobs|queries|query_counts)\[(\d+)\]")
# A batch with more bad records than this goes as it is (the collector's refusal names the first).
MAX_LEFT_OUT = 1000
_LISTS = ("intervals", "jobs", "queries", "query_counts")


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
        grid_region: str | None = None,
        max_held_intervals: int | None = None,
        max_held_spans: int | None = None,
    ) -> None:
        self.spool = spool
        self.agent_id = agent_id
        self.host = host
        # Sent with every batch (the collector keeps the latest per host); None: left out of the batch.
        self.grid_region = grid_region
        self._devices = devices
        self._clock = clock
        self._refused = refused
        self._lock = threading.Lock()
        self._seal_lock = threading.Lock()
        # Added, not yet staged (under _lock).
        self._intervals: list[wire.Interval] = []
        self._jobs: list[wire.Job] = []
        self._queries: list[wire.Query] = []
        self._counts: list[wire.QueryCount] = []
        # While the spool cannot be written, what was added waits here, up to these bounds (agent.held).
        self.max_held_intervals = held.MAX_HELD_INTERVALS if max_held_intervals is None else max_held_intervals
        self.max_held_spans = held.MAX_HELD_SPANS if max_held_spans is None else max_held_spans
        self.dropped = held.Dropped()  # under _lock
        self.dropped_spans = 0  # spans and counts dropped since the agent started
        # Why the spool cannot be written now ("": it can), and what was dropped since it could not.
        self.unwritable = ""
        self._outage_dropped = (0, 0)  # (intervals, spans) dropped when the spool became unwritable
        # Staged in the spool as parts of the batch ``_draft_seq`` (under _seal_lock).
        self._draft_seq: int | None = None
        self._draft_created_s = 0.0
        self._staged = _Records()
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
            self._bound()
            if marks:
                for key, mark in marks.items():
                    known = self._marks.get(key)
                    if known is None or mark.t_s >= known.t_s:
                        self._marks[key] = mark
            if open_jobs is not None and open_jobs[0] >= self._open_at_s:
                self._open_at_s, self._open_jobs = open_jobs

    def stage(self) -> int | None:
        """Make what was added since the last stage durable, as a part of the next batch (with the checkpoint
        as of it); returns that batch's seq (None when nothing was added)."""
        with self._seal_lock:
            seq, added = self._stage()
            self._wrote(added)
            return seq

    def seal(self) -> int | None:
        """Move everything staged and added so far into one durable batch, queued for the push; returns its
        seq (None when there was nothing)."""
        # One seal or stage at a time (the push's and the worker's): the spool must store checkpoints in
        # the order of their records, or a restart would bridge from a reading some batch already covers.
        with self._seal_lock:
            added, checkpoint = self._take()
            if added is None and self._draft_seq is None:
                return None
            records = self._staged
            if added is not None:
                # What came since the last stage goes straight into the batch: one write, not a stage and a seal.
                staged = records
                records = _Records()
                records.extend(staged.intervals, staged.jobs, staged.queries, staged.counts)
                records.extend(added.intervals, added.jobs, added.queries, added.counts)
            created_s = self._draft_created_s if self._draft_seq is not None else self._clock()
            try:
                # Checked once, as a whole, here (not tick by tick: decoding is most of a stage's cost).
                seq = self.spool.seal(
                    self._draft_seq,
                    lambda seq: self._fitted(self._batch(seq, records)),
                    created_s=created_s,
                    checkpoint=checkpoint.to_json() if checkpoint is not None and added is not None else None,
                )
            except BaseException:
                # Rolled back: the staged parts are still in the spool, what was added goes back to wait.
                self._put_back(added)
                raise
            self._staged, self._draft_seq = _Records(), None
            self._wrote(added if added is not None else _Records())
            return seq

    def recover(self) -> list[int]:
        """Seal the batches a crash left staged, each from its parts; returns their seqs. Run before the
        agent stages anything (it does so when it starts)."""
        sealed: list[int] = []
        with self._seal_lock:
            for seq, parts in self.spool.staged().items():
                # Parts are read as plain JSON: a record outside the bounds is left out by _fitted, alone.
                merged: dict[str, Any] = {name: [] for name in _LISTS}
                devices: dict[str, Any] = {}
                created_s = 0.0
                for body in parts:
                    try:
                        part = msgspec.json.decode(body)
                        for name in _LISTS:
                            merged[name].extend(part.get(name) or [])
                        devices.update((d["key"], d) for d in part.get("devices") or [])
                        created_s = created_s or float(part.get("sent_at_s") or 0.0)
                    except (msgspec.DecodeError, AttributeError, TypeError, KeyError, ValueError) as exc:
                        log.warning("batch %d: left out a staged part that does not read (%s)", seq, exc)
                now_s = self._clock()
                batch = {"agent_id": self.agent_id, "seq": seq, "host": self.host, "sent_at_s": now_s, **merged}
                batch["devices"] = list(devices.values())
                if self.grid_region:
                    batch["grid_region"] = self.grid_region
                self.spool.seal_staged(seq, self._fitted(batch), created_s=created_s or now_s)
                log.info("batch %d: sealed from %d part(s) staged before the agent stopped", seq, len(parts))
                sealed.append(seq)
        return sealed

    def _take(self) -> tuple[_Records | None, Checkpoint | None]:
        """What was added since the last stage (None: nothing) and the checkpoint as of it, taken out."""
        with self._lock:
            if not (self._intervals or self._jobs or self._queries or self._counts or self.dropped):
                return None, None
            # The time dropped while the spool could not be written goes first, as gap intervals.
            added = _Records(self.dropped.take() + self._intervals, self._jobs, self._queries, self._counts)
            self._intervals, self._jobs, self._queries, self._counts = [], [], [], []
            checkpoint = None
            if self._open_jobs is not None:
                checkpoint = Checkpoint(self._open_at_s, self._boot_id, dict(self._marks), list(self._open_jobs))
        return added, checkpoint

    def _stage(self) -> tuple[int | None, _Records | None]:
        """Stage what was added (``stage``); the batch's seq and the records written (None: nothing)."""
        added, checkpoint = self._take()
        if added is None:
            return self._draft_seq, None
        checkpoint_json = checkpoint.to_json() if checkpoint else None
        try:
            if self._draft_seq is None:
                # The batch's first part: its seq is reserved in the transaction that stages it.
                created_s = self._clock()

                def first_part(seq: int) -> tuple[bytes, float]:
                    part = self._batch(seq, added)
                    return wire.encode(part), part.sent_at_s

                self._draft_seq = self.spool.stage_new(first_part, checkpoint=checkpoint_json)
                self._draft_created_s = created_s
            else:
                part = self._batch(self._draft_seq, added)
                self.spool.stage(
                    self._draft_seq, wire.encode(part), created_s=part.sent_at_s, checkpoint=checkpoint_json
                )
        except BaseException:
            self._put_back(added)  # not written: it waits for the next stage or seal
            raise
        self._staged.extend(added.intervals, added.jobs, added.queries, added.counts)
        return self._draft_seq, added

    def _put_back(self, added: _Records | None) -> None:
        """Return records a failed write took to the front of what waits, in their order, within the bounds."""
        if added is None:
            return
        with self._lock:
            self._intervals[:0] = added.intervals
            self._jobs[:0] = added.jobs
            self._queries[:0] = added.queries
            self._counts[:0] = added.counts
            self._bound()

    def _bound(self) -> None:
        """Drop the oldest intervals, spans and counts past the bounds (under ``_lock``). Jobs are never
        dropped: a few per job, and a job's start and end are what its energy is attributed by."""
        excess = len(self._intervals) - self.max_held_intervals
        if excess > 0:
            self.dropped.add(self._intervals[:excess])
            del self._intervals[:excess]
        excess = len(self._queries) + len(self._counts) - self.max_held_spans
        if excess > 0:
            from_queries = min(excess, len(self._queries))
            del self._queries[:from_queries]
            del self._counts[: excess - from_queries]
            self.dropped_spans += excess

    def held(self) -> tuple[int, int]:
        """(intervals, spans and counts) added and not yet written: while the spool cannot be written, what
        waits in memory."""
        with self._lock:
            return len(self._intervals), len(self._queries) + len(self._counts)

    def spool_unwritable(self, exc: BaseException) -> None:
        """A stage or seal could not write (a full disk, ``spool.disk_full``): what it took waits in memory.
        Says so at WARNING once, when the spool becomes unwritable, with what to do."""
        why = str(exc) or type(exc).__name__
        with self._lock:
            was, self.unwritable = self.unwritable, why
            if was:
                return
            self._outage_dropped = (self.dropped.intervals, self.dropped_spans)
        log.warning(
            "agent spool %s cannot be written (%s): measuring on, holding up to %d intervals in memory, then "
            "dropping the oldest and sending their time as gap intervals; free space on its disk (or give "
            "another --home) and the agent writes what it holds by itself",
            self.spool.path,
            why,
            self.max_held_intervals,
        )

    def _wrote(self, added: _Records | None) -> None:
        """A stage or seal wrote ``added`` (None: it wrote nothing): after an outage, say once at INFO what
        was kept and what dropped."""
        if added is None:
            return
        with self._lock:
            if not self.unwritable:
                return
            self.unwritable = ""
            intervals = self.dropped.intervals - self._outage_dropped[0]
            spans = self.dropped_spans - self._outage_dropped[1]
        kept = sum(1 for iv in added.intervals if held.GAP not in iv.flags)
        lost = f" and {spans} request span(s) or count(s)" if spans else ""
        log.info(
            "agent spool %s is writable again: wrote the %d interval(s) held in memory; %d interval(s)%s were "
            "dropped (their time is sent as gap intervals: reports show it as not measured)",
            self.spool.path,
            kept,
            intervals,
            lost,
        )

    def _batch(self, seq: int, records: _Records) -> wire.Batch:
        return wire.Batch(
            agent_id=self.agent_id,
            seq=seq,
            host=self.host,
            sent_at_s=self._clock(),
            devices=self._devices(),
            intervals=records.intervals,
            jobs=records.jobs,
            queries=records.queries,
            query_counts=records.counts,
            grid_region=self.grid_region or msgspec.UNSET,
        )

    def _fitted(self, batch: wire.Batch | dict[str, Any]) -> bytes:
        """The batch (a wire.Batch, or its plain JSON form) encoded, less each record the collector's
        decoding would refuse (logged and counted)."""
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
                records = batch[record[1]] if isinstance(batch, dict) else getattr(batch, record[1])
                del records[int(record[2])]
                left_out.append(exc)
        if left_out:
            more = f" (and {len(left_out) - 1} more)" if len(left_out) > 1 else ""
            seq = batch["seq"] if isinstance(batch, dict) else batch.seq
            log.warning("batch %d: left out a record outside the bounds: %s%s", seq, left_out[0], more)
            if self._refused is not None:
                self._refused(left_out)
        return body


class _Records:
    """The record lists of a batch (or of a part of one)."""

    def __init__(
        self,
        intervals: list[wire.Interval] | None = None,
        jobs: list[wire.Job] | None = None,
        queries: list[wire.Query] | None = None,
        counts: list[wire.QueryCount] | None = None,
    ) -> None:
        self.intervals = intervals if intervals is not None else []
        self.jobs = jobs if jobs is not None else []
        self.queries = queries if queries is not None else []
        self.counts = counts if counts is not None else []

    def extend(
        self,
        intervals: Iterable[wire.Interval],
        jobs: Iterable[wire.Job],
        queries: Iterable[wire.Query],
        counts: Iterable[wire.QueryCount],
    ) -> None:
        """Append records."""
        self.intervals.extend(intervals)
        self.jobs.extend(jobs)
        self.queries.extend(queries)
        self.counts.extend(counts)
