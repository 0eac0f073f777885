"""Identity: API tokens, agent ids bound to their host, and idempotency keys that detect other content.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-08

``api_tokens`` holds the collector's bearer tokens (SHA-256 of each, never the token), with a role
(admin, agent, reader), an agent token's host, and when it was created, last used and revoked.
``agents`` binds an agent id to the first host that pushed it: another host presenting the same id (a
cloned spool) is refused. ``ingested_batches.body_sha256`` tells a retried batch (same key, same
content) from a different batch under a reused key. ``span_posts`` keeps the idempotency keys of span
posts over HTTP. Existing batches have no hash (taken as duplicates when re-sent); agent ids are bound
by their next batch.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the identity tables and add the batch hash."""
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("role", sa.String(8), nullable=False),
        sa.Column("host", sa.String(200), nullable=True),
        sa.Column("created_at_s", sa.Float, nullable=False),
        sa.Column("last_used_s", sa.Float, nullable=True),
        sa.Column("revoked_at_s", sa.Float, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
        sa.UniqueConstraint("sha256", name="uq_api_tokens_sha256"),
    )
    op.create_index("ix_api_tokens_prefix", "api_tokens", ["prefix"])
    op.create_table(
        "agents",
        sa.Column("agent_id", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("first_seen_s", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("agent_id", name="pk_agents"),
    )
    op.create_table(
        "span_posts",
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("body_sha256", sa.String(64), nullable=False),
        sa.Column("n_spans", sa.Integer, nullable=False),
        sa.Column("received_at_s", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("job_id", "host", "key", name="pk_span_posts"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_span_posts_job_id_jobs", ondelete="CASCADE"),
    )
    with op.batch_alter_table("ingested_batches") as batch:
        batch.add_column(sa.Column("body_sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("ingested_batches") as batch:
        batch.drop_column("body_sha256")
    op.drop_table("span_posts")
    op.drop_table("agents")
    op.drop_index("ix_api_tokens_prefix", table_name="api_tokens")
    op.drop_table("api_tokens")
