"""Who ended a job, when it was not the job itself: a restarted agent, or the collector for a silent agent.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07

``jobs.ended_by`` is null for a job whose process or client ended it. ``agent-restart``: the agent came
back after a crash and found the job's processes gone, so it ended the job when it was last seen.
``process-gone``: a job the restarted agent re-adopted ended without telling it. ``collector-silent-agent``:
no host running the job had pushed for ``host_silent_after_s``, so the collector ended it at its last
measured instant; an end the agent sends later replaces that one. Existing rows stay null.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add jobs.ended_by."""
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("ended_by", sa.String(40), nullable=True))


def downgrade() -> None:
    """Drop it."""
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("ended_by")
