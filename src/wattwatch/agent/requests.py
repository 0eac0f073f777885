"""Turns local-API messages (``agent.local_api``) into registry jobs and wire spans, with errors that say
what to fix. Pure functions: the agent decides what to do with the results."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from wattwatch import wire
from wattwatch.agent.jobs import DISCOVERED_BY, ActiveJob
from wattwatch.errors import ConfigError
from wattwatch.sensors.base import DeviceInfo
from wattwatch.units import JOB_KINDS, JobKind

JOB_ID = re.compile(r"^[A-Za-z0-9_.:@/-]{1,200}$")
SPAN_KINDS = ("query", "step", "epoch")
MAX_SPANS_PER_MESSAGE = 10_000
_VIA = re.compile(r"^[a-z0-9_.-]{1,40}$")

ResolveVisible = Callable[[str, Sequence[DeviceInfo]], list[str]]


def parse_job_start(
    msg: Mapping[str, Any], gpus: Sequence[DeviceInfo], resolve_visible: ResolveVisible | None
) -> tuple[ActiveJob, list[str], str]:
    """(job, its GPU keys, a warning or "") from a ``job_start`` message; raises ConfigError.

    ``via`` names the client (``sdk`` by default; ``wattwatch run`` may say ``run``) and becomes the
    job's ``wattwatch.io/discovered-by`` label: explicit jobs record their reason like discovered ones.
    """
    job_id = str(msg.get("id") or uuid.uuid4().hex)
    if not JOB_ID.match(job_id):
        raise ConfigError(f"job id {job_id!r} may only contain letters, digits and _.:@/- (max 200)")
    name = str(msg.get("name") or job_id)[:200]
    kind = as_kind(msg.get("kind") or "other")
    labels = msg.get("labels") or {}
    if not isinstance(labels, dict):
        raise ConfigError("labels must be an object of strings")
    via = str(msg.get("via") or "sdk")
    if not _VIA.match(via):
        raise ConfigError(f"via {via!r} must be a short lowercase word such as sdk or run")
    pid = msg.get("pid")
    cvd = msg.get("cuda_visible_devices")
    warning = ""
    devices: list[str] = []
    if cvd is not None and gpus and resolve_visible is not None:
        try:
            devices = resolve_visible(str(cvd), gpus) if str(cvd).strip() else []
        except ConfigError as exc:
            warning = f"{exc}; the job is measured without GPUs"
    job = ActiveJob(
        id=job_id,
        name=name,
        kind=kind,
        started_at_s=0.0,
        labels={**{str(k): str(v) for k, v in labels.items()}, DISCOVERED_BY: via},
        devices=frozenset(devices),
        pids={int(pid)} if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else set(),
        bind_by_process=cvd is None,
    )
    return job, devices, warning


def as_kind(kind: object) -> JobKind:
    """A job kind, or ConfigError listing the valid ones."""
    for k in JOB_KINDS:
        if k == kind:
            return k
    raise ConfigError(f"job kind {kind!r} is not one of {', '.join(JOB_KINDS)}")


def parse_span(msg: Mapping[str, Any], default_job: str | None = None) -> wire.Query:
    """One span (``query``, ``step`` or ``epoch``) from a message; raises ConfigError naming the field."""
    job_id = str(msg.get("job") or default_job or "")
    if not JOB_ID.match(job_id):
        raise ConfigError(f"a span needs a valid job id, got {job_id!r}")
    kind = msg.get("kind") or "query"
    if kind not in SPAN_KINDS:
        raise ConfigError(f"span kind {kind!r} is not one of {', '.join(SPAN_KINDS)}")
    try:
        t_start_s = float(msg["t_start_s"])
        t_end_s = float(msg["t_end_s"])
        tokens_in = int(msg.get("tokens_in") or 0)
        tokens_out = int(msg.get("tokens_out") or 0)
    except KeyError as exc:
        raise ConfigError(f"a span needs {exc.args[0]}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"a span's times and token counts must be numbers ({exc})") from None
    if not (math.isfinite(t_start_s) and math.isfinite(t_end_s)) or t_start_s <= 0:
        raise ConfigError("a span's t_start_s and t_end_s must be Unix times in seconds")
    if t_end_s < t_start_s:
        raise ConfigError(f"a span ends ({t_end_s}) before it starts ({t_start_s})")
    if tokens_in < 0 or tokens_out < 0:
        raise ConfigError("token counts must not be negative")
    return wire.Query(
        job=job_id,
        t_start_s=t_start_s,
        t_end_s=t_end_s,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        kind="step" if kind == "step" else "epoch" if kind == "epoch" else "query",
    )


def parse_spans(msg: Mapping[str, Any]) -> tuple[list[wire.Query], list[str]]:
    """The spans of a ``queries`` message and an error per rejected span (the good ones are kept)."""
    spans = msg.get("spans")
    if not isinstance(spans, list):
        raise ConfigError('queries needs "spans": a list of span objects')
    if len(spans) > MAX_SPANS_PER_MESSAGE:
        raise ConfigError(f"at most {MAX_SPANS_PER_MESSAGE} spans per message; send several messages")
    default_job = msg.get("job")
    good: list[wire.Query] = []
    errors: list[str] = []
    for i, span in enumerate(spans):
        if not isinstance(span, dict):
            errors.append(f"spans[{i}]: not an object")
            continue
        try:
            good.append(parse_span(span, default_job=str(default_job) if default_job else None))
        except ConfigError as exc:
            errors.append(f"spans[{i}]: {exc}")
    return good, errors
