"""Idempotency keys that belong to one agent, and that tell a retry from a different body.

A batch's key is ``(agent_id, seq)``. The agent id is bound to the first host that pushes it (table
``agents``), so another host can neither collide with nor pre-empt that host's keys: a second agent
presenting the same id from another host (a cloned spool, e.g. a copied VM image) is refused. Each
key is stored with the SHA-256 of what was stored under it: the same key with the same hash is a
retry (a duplicate, answered 200), the same key with another hash a conflict (409) - never a silent drop.

Span posts over HTTP carry an optional ``Idempotency-Key``, scoped to the job and the posting host.
These functions run inside the caller's write transaction: a refusal rolls everything back.
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from wattwatch.storage.dialect import upsert
from wattwatch.storage.tables import agents, ingested_batches, span_posts


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


def claim_agent_id(conn: Connection, agent_id: str, host: str, now_s: float) -> None:
    """Bind ``agent_id`` to ``host`` unless it is bound already; raise AgentIdTaken if bound to another host."""
    conn.execute(
        upsert(conn, agents)
        .values(agent_id=agent_id, host=host, first_seen_s=now_s)
        .on_conflict_do_nothing(index_elements=[agents.c.agent_id])
    )
    # Read after the insert: under a race, PostgreSQL's ON CONFLICT waited for the other insert to commit.
    owner = conn.execute(select(agents.c.host).where(agents.c.agent_id == agent_id)).scalar_one()
    if owner != host:
        raise AgentIdTaken(agent_id, owner, host)


def claim_batch(
    conn: Connection, agent_id: str, seq: int, body_sha256: str, received_at_s: float, n_intervals: int
) -> bool:
    """Store the batch key; True when new, False for a retry of the same content. Raises KeyReused."""
    stored = conn.execute(
        upsert(conn, ingested_batches)
        .values(
            agent_id=agent_id, seq=seq, received_at_s=received_at_s, n_intervals=n_intervals, body_sha256=body_sha256
        )
        .on_conflict_do_nothing()
        # RETURNING, not rowcount: psycopg reports -1 for a skipped conflict.
        .returning(ingested_batches.c.seq)
    )
    if stored.first() is not None:
        return True
    ib = ingested_batches
    before = conn.execute(select(ib.c.body_sha256).where(ib.c.agent_id == agent_id, ib.c.seq == seq)).scalar_one()
    if before is not None and before != body_sha256:
        raise KeyReused(
            f"seq {seq} of agent_id {agent_id!r} was stored before with other content; an agent never reuses a "
            "seq, so two agents share this spool (cloned?): give each its own $WATTWATCH_HOME/spool.db",
            "seq",
        )
    return False


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
