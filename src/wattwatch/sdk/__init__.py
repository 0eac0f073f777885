"""The Python SDK: ``wattwatch.job()``, and spans inside it: ``query()`` per inference request,
``step()`` / ``epoch()`` for training.

They must never hurt the workload. ``job()`` talks to the agent's Unix socket
(``$WATTWATCH_HOME/agent.sock``) with a short timeout; spans never touch the socket on the workload's
thread: they are appended to a buffer that a background thread sends as one ``queries`` message every
``FLUSH_INTERVAL_S`` or ``FLUSH_SPANS`` spans, whichever comes first. Nothing here raises into the
workload; with no agent reachable everything is a no-op after a single warning, and the buffer drops its
oldest spans past ``MAX_BUFFERED_SPANS`` rather than grow without bound.

Spans and labels are checked against ``wattwatch.protocol.limits`` as they are recorded, the way the collector will
check them: one that would be refused there (a time in milliseconds, an end before its start, a token count
beyond 2**31 - 1, a label too long) is dropped here alone, with a warning the first time per reason and a
count in ``refused()``, and the rest flow on.
"""

from __future__ import annotations

from wattwatch.sdk.client import (
    CONNECT_TIMEOUT_S,
    FLUSH_INTERVAL_S,
    FLUSH_SPANS,
    MAX_BUFFERED_SPANS,
    MAX_SPANS_PER_MESSAGE,
    AgentClient,
    SpanBuffer,
)
from wattwatch.sdk.jobs import JobHandle, job, start_job
from wattwatch.sdk.notices import refused
from wattwatch.sdk.spans import SpanKind, epoch, query, record_span, step

__all__ = [
    "CONNECT_TIMEOUT_S",
    "FLUSH_INTERVAL_S",
    "FLUSH_SPANS",
    "MAX_BUFFERED_SPANS",
    "MAX_SPANS_PER_MESSAGE",
    "AgentClient",
    "JobHandle",
    "SpanBuffer",
    "SpanKind",
    "epoch",
    "job",
    "query",
    "record_span",
    "refused",
    "start_job",
    "step",
]
