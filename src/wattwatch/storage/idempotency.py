"""Idempotency keys that belong to one agent, and that tell a retry from a different body.

A batch's key is ``(agent_id, seq)``. The agent id is bound to the first host that pushes it (table
``agents``), so another host can neither collide with nor pre-empt that host's keys: a second agent
presenting the same id from another host (a cloned spool, e.g. a copied VM image) is refused. Each
key is stored with the SHA-256 of what was stored under it: the same key with the same hash is a
retry (a duplicate, answered 200), the same key with another hash a conflict (409) - never a silent drop.

Span posts over HTTP carry an optional ``Idempotency-Key``, scoped to the job and the posting host.
Batch keys are claimed by ``storage.group_ingest`` (many batches at once); span-post keys here. These run
inside the caller's write transaction: a refusal rolls everything back.
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from wattwatch.storage.dialect import upsert
from wattwatch.storage.tables import span_posts


class AgentIdTaken(Exception):
    """The agent id belongs to another host (a cloned spool)."""

    def __init__(self, agent_id: str, owner: str, host: str) -> None:
        super().__init__(
            f"agent_id {agent_id!r} belongs to host {owner!r}, but this batch comes from host {host!r}: cloned spool? "
            f"on {host!r}, stop the agent, delete $WATTWATCH_HOME/spool.db (it holds the agent id; its unsent "
            "batches are the other host's copy) and start it again for a new id"
        )
        self.agent_id = agent_id
        self.owner = owner
        self.host = host


class KeyReused(Exception):
    """An idempotency key stored before with other content."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def claim_span_post(
    conn: Connection, job_id: str, host: str | None, key: str, body_sha256: str, n_spans: int, received_at_s: float
) -> bool:
    """Store a span post's idempotency key; True when new, False for a retry. Raises KeyReused."""
    stored = conn.execute(
        upsert(conn, span_posts)
        .values(
            job_id=job_id,
            host=host or "",
            key=key,
            body_sha256=body_sha256,
            n_spans=n_spans,
            received_at_s=received_at_s,
        )
        .on_conflict_do_nothing()
        .returning(span_posts.c.key)
    )
    if stored.first() is not None:
        return True
    sp = span_posts
    before = conn.execute(
        select(sp.c.body_sha256).where(sp.c.job_id == job_id, sp.c.host == (host or ""), sp.c.key == key)
    ).scalar_one()
    if before != body_sha256:
        raise KeyReused(
            f"Idempotency-Key {key!r} was used before for other spans of job {job_id!r}; use a new key per post",
            "Idempotency-Key",
        )
    return False
