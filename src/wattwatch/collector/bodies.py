"""Request bodies of the job routes that the wire format does not already define.

Decoded with msgspec like agent batches, so every 422 names its field the same way.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from wattwatch.protocol import wire


class JobStart(wire.Job, kw_only=True):
    """``POST /api/v1/jobs``: a job record plus the host that reports it."""

    host: wire.Name


class JobEnd(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /api/v1/jobs/{id}/end``: when it ended (default: when the collector receives this)."""

    ended_at_s: wire.Epoch_s | None = None


class QueryIn(msgspec.Struct, forbid_unknown_fields=True):
    """One completed span: a query by default, or a training ``step``/``epoch``; ``job`` may be left out
    since the path names the job."""

    t_start_s: wire.Epoch_s
    t_end_s: wire.SpanEndEpoch_s
    tokens_in: wire.Tokens = 0
    tokens_out: wire.Tokens = 0
    # The path's job, if given: the document says so in words and as ``x-equals-path`` (no JSON Schema
    # keyword can compare a body field with a path parameter).
    job: Annotated[
        wire.Key | None,
        msgspec.Meta(
            description="the job in the path, if given at all",
            extra_json_schema={"x-equals-path": "job_id"},
        ),
    ] = None
    kind: wire.SpanKind = "query"

    def __post_init__(self) -> None:
        if self.t_end_s < self.t_start_s:
            raise ValueError("@t_end_s: must not be earlier than t_start_s")


class QueriesIn(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /api/v1/jobs/{id}/queries``."""

    queries: list[QueryIn]
    host: wire.Name | None = None


OPENAPI_BODIES: dict[str, type] = {
    "Batch": wire.Batch,
    "JobStart": JobStart,
    "JobEnd": JobEnd,
    "QueriesIn": QueriesIn,
}
