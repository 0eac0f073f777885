"""Group commit: concurrent ingest requests are stored together, in one transaction per group.

Request threads hand their decoded batch to ``GroupCommitter.submit`` and wait. Writer threads take
everything queued (up to a bound), store it with ``storage.group_ingest.ingest_many`` and answer each
request. Under load a group holds many batches, so statements, round trips and commits are shared; with
one request at a time a group is that one batch, so nothing waits for company.

Each batch stays all-or-nothing: a batch refused for its identity (409) is refused alone inside the group.
When the group's transaction fails (a database error), every batch of it is stored again on its own, so
only a batch that fails by itself gets the error and the others are stored. Deadlocks and serialization
failures between collectors retry the group first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from wattwatch.protocol import wire
from wattwatch.storage.group_ingest import IngestResult, Outcome, Pending, ingest_many
from wattwatch.storage.ingest_cache import DeviceCache

log = logging.getLogger(__name__)

# A group's bound: enough to share the overhead, small enough that one transaction stays short.
MAX_GROUP_BATCHES = 64
MAX_GROUP_INTERVALS = 40_000
# PostgreSQL's deadlock_detected and serialization_failure: another collector won; the group is retried.
RETRY_SQLSTATES = frozenset({"40P01", "40001"})
RETRIES = 3
# Batches waiting for a writer at most: a queue beyond it is a database that cannot keep up, and each
# waiting batch is held in memory. Over it a batch is refused (QueueFull: 503 with Retry-After) and the
# agent, which keeps it spooled, sends it again after the wait.
MAX_QUEUED_BATCHES = 2048


class QueueFull(Exception):
    """The ingest queue holds ``MAX_QUEUED_BATCHES``: the batch was not queued."""


@dataclass
class _Request:
    pending: Pending
    future: Future[IngestResult] | None = None
    # Instead of the future: called on the writer thread with the outcome (an IngestResult or the exception).
    answer: Callable[[IngestResult | Exception], None] | None = None


class GroupCommitter:
    """Stores submitted batches in groups on ``writers`` threads (started on first use)."""

    def __init__(self, engine: Engine, *, writers: int | None = None) -> None:
        self._engine = engine
        # SQLite takes one writer at a time anyway; on PostgreSQL a second writer collects the next group
        # while the first commits.
        self._writers = writers if writers is not None else (2 if engine.dialect.name == "postgresql" else 1)
        self._queue: deque[_Request] = deque()
        self.max_queued = MAX_QUEUED_BATCHES
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.groups = 0  # transactions committed (for tests and the curious)
        # One for every writer thread (it stages each thread's running transaction apart).
        self._device_cache = DeviceCache()

    def submit(self, batch: wire.Batch, received_at_s: float) -> IngestResult:
        """Store ``batch`` (with the others queued now); raise what refused it (AgentIdTaken, KeyReused,
        a database error)."""
        return self.submit_future(Pending(batch, received_at_s)).result()

    def submit_future(self, pending: Pending) -> Future[IngestResult]:
        """Queue a batch; the future holds its IngestResult or what refused it."""
        future: Future[IngestResult] = Future()
        self._queue_request(_Request(pending, future=future))
        return future

    async def store(self, pending: Pending) -> IngestResult:
        """Queue a batch and wait for it in the running event loop; raise what refused it.

        The writer hands the outcome to the loop with one ``call_soon_threadsafe``: waiting on a
        concurrent.futures.Future through asyncio.wrap_future chained two futures and several callbacks
        per batch (a few percent of the collector's CPU under load)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[IngestResult] = loop.create_future()

        def answer(outcome: IngestResult | Exception) -> None:
            loop.call_soon_threadsafe(_settle, waiter, outcome)

        self._queue_request(_Request(pending, answer=answer))
        return await waiter

    def _queue_request(self, request: _Request) -> None:
        with self._cond:
            if not self._threads:
                self._start()
            if len(self._queue) >= self.max_queued:
                raise QueueFull(f"{len(self._queue)} batches are waiting for the database")
            self._queue.append(request)
            self._cond.notify()

    def stop(self) -> None:
        """Finish what is queued, then stop the writer threads (a later ``submit`` starts them again)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            threads, self._threads = self._threads, []
        for t in threads:
            t.join(timeout=30)
        with self._cond:
            self._stopping = False

    def _start(self) -> None:
        for i in range(self._writers):
            t = threading.Thread(target=self._loop, name=f"wattwatch-writer-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _take(self) -> list[_Request] | None:
        with self._cond:
            while not self._queue:
                if self._stopping:
                    return None
                self._cond.wait()
            group = [self._queue.popleft()]
            n = len(group[0].pending.batch.intervals)
            while self._queue and len(group) < MAX_GROUP_BATCHES:
                size = len(self._queue[0].pending.batch.intervals)
                if n + size > MAX_GROUP_INTERVALS:
                    break
                group.append(self._queue.popleft())
                n += size
            return group

    def _loop(self) -> None:
        while (group := self._take()) is not None:
            try:
                outcomes = self.store_group([r.pending for r in group])
            except BaseException as exc:  # never leave a request waiting
                outcomes = [exc if isinstance(exc, Exception) else RuntimeError(str(exc))] * len(group)
            for request, outcome in zip(group, outcomes, strict=True):
                if request.answer is not None:
                    try:
                        request.answer(outcome)
                    except RuntimeError:  # its event loop is closed: nobody waits any more
                        log.debug("an answer's event loop is closed")
                elif request.future is not None:
                    if isinstance(outcome, Exception):
                        request.future.set_exception(outcome)
                    else:
                        request.future.set_result(outcome)

    def store_group(self, group: list[Pending]) -> list[Outcome | Exception]:
        """Store ``group`` in one transaction; when that fails, each batch alone. One outcome per batch: an
        IngestResult, or what refused it (AgentIdTaken, KeyReused, the database's error)."""
        for attempt in range(RETRIES + 1):
            try:
                outcomes: list[Outcome | Exception] = list(ingest_many(self._engine, group, self._device_cache))
            except DBAPIError as exc:
                sqlstate = getattr(exc.orig, "sqlstate", None)
                if sqlstate in RETRY_SQLSTATES and attempt < RETRIES:
                    log.info("group of %d batches retried after %s", len(group), sqlstate)
                    continue
                return self._isolate(group, exc)
            except Exception as exc:  # anything else: find the batch that fails alone
                return self._isolate(group, exc)
            self.groups += 1
            return outcomes
        raise AssertionError("unreachable")

    def _isolate(self, group: list[Pending], exc: Exception) -> list[Outcome | Exception]:
        if len(group) == 1:
            return [exc]
        log.warning("a group of %d batches failed (%s); storing each alone", len(group), exc)
        return [self.store_group([pending])[0] for pending in group]


def _settle(waiter: asyncio.Future[IngestResult], outcome: IngestResult | Exception) -> None:
    """In the waiter's event loop: its result or exception (unless the request was cancelled meanwhile)."""
    if waiter.done():
        return
    if isinstance(outcome, Exception):
        waiter.set_exception(outcome)
    else:
        waiter.set_result(outcome)
