"""Power now: each job's power over its host's latest pushed ticks, for /metrics.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

``job_hosts.power_w`` is the job's power on the host over the last second of ticks the host pushed, and
``power_at_s`` the end of those ticks; /metrics shows it for running jobs whose host pushed lately, instead
of an average since the job started. Existing rows have neither until their host pushes again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the power-now columns."""
    with op.batch_alter_table("job_hosts") as batch:
        batch.add_column(sa.Column("power_w", sa.Float(), nullable=True))
        batch.add_column(sa.Column("power_at_s", sa.Float(), nullable=True))


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("job_hosts") as batch:
        batch.drop_column("power_at_s")
        batch.drop_column("power_w")
