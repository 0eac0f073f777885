"""Spans inside a job: ``query()`` per inference request, ``step()`` / ``epoch()`` for training, and
``record_span()`` for a span already timed. They never touch the socket on the workload's thread: they
go into the client's span buffer (``sdk.client``).

Spans are checked against ``wattwatch.protocol.limits`` as they are recorded, the way the collector will
check them: one that would be refused there is dropped here alone (``sdk.notices``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any, Literal

from wattwatch.protocol import limits
from wattwatch.sdk.client import AgentClient, shared_client
from wattwatch.sdk.jobs import current_job, newest_open_job
from wattwatch.sdk.notices import refuse, warn_once

SpanKind = Literal["query", "step", "epoch"]


def record_span(
    kind: SpanKind,
    t_start_s: float,
    t_end_s: float,
    *,
    tokens_in: int = 0,
    tokens_out: int = 0,
    job_id: str | None = None,
    client: AgentClient | None = None,
) -> None:
    """Queue one finished span (Unix seconds) for the current job; never blocks, never raises.

    A span out of bounds (``limits.check_span``) is dropped with a warning and counted in ``refused()``."""
    try:
        jid = job_id or current_job.get() or newest_open_job() or os.environ.get("WATTWATCH_JOB")
        if jid is None:
            warn_once(f"wattwatch.{kind}() outside any job; wrap the code in wattwatch.job() or `wattwatch run`")
            return
        try:
            start_s, end_s, n_in, n_out = limits.check_span(
                t_start_s, t_end_s, tokens_in, tokens_out, now_s=time.time()
            )
        except limits.BoundError as exc:
            refuse(f"a {kind} span was", exc)
            return
        span: dict[str, Any] = {"job": jid, "kind": kind, "t_start_s": start_s, "t_end_s": end_s}
        if n_in:
            span["tokens_in"] = n_in
        if n_out:
            span["tokens_out"] = n_out
        (client or shared_client()).spans.add(span)
    except Exception as exc:  # the workload comes first
        warn_once(f"could not record a span ({exc!r})")


@contextlib.contextmanager
def _span(
    kind: SpanKind, counts: dict[str, int], job_id: str | None, client: AgentClient | None
) -> Iterator[dict[str, int]]:
    t_start_s = time.time()
    try:
        yield counts
    finally:
        tokens_in, tokens_out = counts.get("tokens_in", 0), counts.get("tokens_out", 0)
        record_span(
            kind, t_start_s, time.time(), tokens_in=tokens_in, tokens_out=tokens_out, job_id=job_id, client=client
        )


def query(
    tokens_in: int = 0,
    tokens_out: int = 0,
    *,
    job_id: str | None = None,
    client: AgentClient | None = None,
) -> contextlib.AbstractContextManager[dict[str, int]]:
    """Record the enclosed block as one inference request of the current job.

    Token counts can be set inside the block through the yielded dict (``q["tokens_out"] = n``) when
    they are only known at the end. Example::

        with wattwatch.query(tokens_in=len(prompt_ids)) as q:
            out = model.generate(prompt_ids)
            q["tokens_out"] = len(out)
    """
    return _span("query", {"tokens_in": tokens_in, "tokens_out": tokens_out}, job_id, client)


def step(
    tokens: int = 0, *, job_id: str | None = None, client: AgentClient | None = None
) -> contextlib.AbstractContextManager[dict[str, int]]:
    """Record the enclosed block as one training step of the current job (energy per step in reports).

    ``tokens`` (or ``s["tokens_in"] = n`` inside) are the tokens the step trained on. Example::

        for batch in loader:
            with wattwatch.step(tokens=batch.numel()):
                loss = model(batch).loss; loss.backward(); opt.step()
    """
    return _span("step", {"tokens_in": tokens}, job_id, client)


def epoch(
    *, job_id: str | None = None, client: AgentClient | None = None
) -> contextlib.AbstractContextManager[dict[str, int]]:
    """Record the enclosed block as one training epoch of the current job. Example::

    for _ in range(epochs):
        with wattwatch.epoch():
            train_one_epoch()
    """
    return _span("epoch", {}, job_id, client)
