"""Turns local-API messages (``agent.local_api``) into registry jobs and wire spans, with errors that say
what to fix, and counts what it refused. Values are checked against ``wattwatch.protocol.limits`` here, where the
caller still hears about it: a span the collector would refuse is dropped alone, with a reason, instead
of costing a whole batch later. Pure functions: the agent decides what to do with the results."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from wattwatch.agent.jobs import DISCOVERED_BY, ActiveJob
from wattwatch.errors import ConfigError
from wattwatch.protocol import wire
from wattwatch.protocol.limits import MAX_PID, REASON_MALFORMED, BoundError, check_span, fit_labels, fit_text
from wattwatch.protocol.units import JOB_KINDS, JobKind
from wattwatch.sensors.base import DeviceInfo

JOB_ID = re.compile(r"^[A-Za-z0-9_.:@/-]{1,200}$")
SPAN_KINDS = ("query", "step", "epoch")
MAX_SPANS_PER_MESSAGE = 10_000
_VIA = re.compile(r"^[a-z0-9_.-]{1,40}$")

ResolveVisible = Callable[[str, Sequence[DeviceInfo]], list[str]]


def parse_job_start(
    msg: Mapping[str, Any], gpus: Sequence[DeviceInfo], resolve_visible: ResolveVisible | None
) -> tuple[ActiveJob, list[str], str, list[BoundError]]:
    """(job, its GPU keys, a warning or "", the labels left out) from a ``job_start`` message; raises
    ConfigError.

    ``via`` names the client (``sdk`` by default; ``wattwatch run`` may say ``run``) and becomes the
    job's ``wattwatch.io/discovered-by`` label: explicit jobs record their reason like discovered ones.
    A label outside the bounds (``limits.fit_labels``) is left out and named in the warning; the job
    starts with the others.
    """
    job_id = str(msg.get("id") or uuid.uuid4().hex)
    if not JOB_ID.fullmatch(job_id):
        raise ConfigError(f"job id {job_id!r} may only contain letters, digits and _.:@/- (max 200)")
    name = fit_text(str(msg.get("name") or job_id)) or job_id
    kind = as_kind(msg.get("kind") or "other")
    labels = msg.get("labels") or {}
    if not isinstance(labels, dict):
        raise ConfigError("labels must be an object of strings")
    via = str(msg.get("via") or "sdk")
    if not _VIA.fullmatch(via):
        raise ConfigError(f"via {via!r} must be a short lowercase word such as sdk or run")
    pid = msg.get("pid")
    cvd = msg.get("cuda_visible_devices")
    given = {str(k): v if isinstance(v, str) else str(v) for k, v in labels.items()}
    fitted, dropped = fit_labels({**given, DISCOVERED_BY: via})
    warnings = [str(exc) for exc in dropped[:3]] + ([f"and {len(dropped) - 3} more"] if len(dropped) > 3 else [])
    devices: list[str] = []
    if cvd is not None and gpus and resolve_visible is not None:
        try:
            devices = resolve_visible(str(cvd), gpus) if str(cvd).strip() else []
        except ConfigError as exc:
            warnings.insert(0, f"{exc}; the job is measured without GPUs")
    job = ActiveJob(
        id=job_id,
        name=name,
        kind=kind,
        started_at_s=0.0,
        labels=fitted,
        devices=frozenset(devices),
        pids={int(pid)} if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= MAX_PID else set(),
        bind_by_process=cvd is None,
    )
    return job, devices, "; ".join(warnings), dropped


def as_kind(kind: object) -> JobKind:
    """A job kind, or ConfigError listing the valid ones."""
    for k in JOB_KINDS:
        if k == kind:
            return k
    raise ConfigError(f"job kind {kind!r} is not one of {', '.join(JOB_KINDS)}")


def parse_span(msg: Mapping[str, Any], default_job: str | None = None, *, now_s: float | None = None) -> wire.Query:
    """One span (``query``, ``step`` or ``epoch``) from a message, checked against ``wattwatch.protocol.limits`` as
    the collector will check it (times in the window around ``now_s``, default the clock now); raises
    ``limits.BoundError`` naming the field and the reason, so a span the collector would refuse never
    reaches a batch (where it would cost the whole batch)."""
    job_id = msg.get("job") or default_job or ""
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        raise BoundError("job", f"a span needs a valid job id, got {job_id!r}", REASON_MALFORMED)
    kind = msg.get("kind") or "query"
    if kind not in SPAN_KINDS:
        raise BoundError("kind", f"span kind {kind!r} is not one of {', '.join(SPAN_KINDS)}", REASON_MALFORMED)
    for name in ("t_start_s", "t_end_s"):
        if name not in msg:
            raise BoundError(name, f"a span needs {name}", REASON_MALFORMED)
    t_start_s, t_end_s, tokens_in, tokens_out = check_span(
        msg["t_start_s"],
        msg["t_end_s"],
        msg.get("tokens_in") or 0,
        msg.get("tokens_out") or 0,
        now_s=time.time() if now_s is None else now_s,
    )
    return wire.Query(
        job=job_id,
        t_start_s=t_start_s,
        t_end_s=t_end_s,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        kind="step" if kind == "step" else "epoch" if kind == "epoch" else "query",
    )


def parse_spans(msg: Mapping[str, Any], *, now_s: float | None = None) -> tuple[list[wire.Query], list[BoundError]]:
    """The spans of a ``queries`` message and an error per refused span (the good ones are kept)."""
    spans = msg.get("spans")
    if not isinstance(spans, list):
        raise ConfigError('queries needs "spans": a list of span objects')
    if len(spans) > MAX_SPANS_PER_MESSAGE:
        raise ConfigError(f"at most {MAX_SPANS_PER_MESSAGE} spans per message; send several messages")
    default_job = msg.get("job")
    now_s = time.time() if now_s is None else now_s
    good: list[wire.Query] = []
    errors: list[BoundError] = []
    for i, span in enumerate(spans):
        if not isinstance(span, dict):
            errors.append(BoundError(f"spans[{i}]", "not an object", REASON_MALFORMED))
            continue
        try:
            good.append(parse_span(span, default_job=str(default_job) if default_job else None, now_s=now_s))
        except BoundError as exc:
            errors.append(BoundError(f"spans[{i}].{exc.field}", exc.message, exc.reason))
    return good, errors


class Refusals:
    """What the agent refused as out of bounds, by reason (``limits.REASONS``): spans and labels at the local
    API, its own records at sealing (``agent.outbox``). The agent's ``wattwatch_agent_refused_total``.
    Counts only: whoever refuses tells the caller or the log. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, errors: Iterable[BoundError]) -> None:
        """Count each refusal under its reason."""
        with self._lock:
            for exc in errors:
                self._counts[exc.reason] = self._counts.get(exc.reason, 0) + 1

    def counts(self) -> dict[str, int]:
        """reason -> refusals since the agent started."""
        with self._lock:
            return dict(self._counts)
