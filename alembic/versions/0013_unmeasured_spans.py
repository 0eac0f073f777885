"""Time a device was not measured, kept at ingest for reports.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06

An agent sends time no reading covers as zero-energy intervals flagged ``gap`` (its spool's disk was full
and it dropped intervals) or ``restart_gap`` (it was down and no counter bridged the time). Those flags were
kept only in the raw batches, which no report reads, so a report under-counted such a job without saying
so. ``unmeasured_spans`` holds one row per such interval (``storage.unmeasured``), and reports give each
job the seconds of its window it covers (``unmeasured_s``). Batches stored before this revision are not
read back into it: decoding every raw batch of the retention window would make the upgrade as long as a
rebuild.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create ``unmeasured_spans``."""
    op.create_table(
        "unmeasured_spans",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("device_id", sa.Integer, nullable=False),
        sa.Column("t_start_s", sa.Float, nullable=False),
        sa.Column("t_end_s", sa.Float, nullable=False),
        sa.Column("flag", sa.String(24), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_unmeasured_spans"),
        sa.ForeignKeyConstraint(
            ["device_id"], ["devices.id"], name="fk_unmeasured_spans_device_id_devices", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_unmeasured_spans_device_id_t_start_s", "unmeasured_spans", ["device_id", "t_start_s"])


def downgrade() -> None:
    """Drop ``unmeasured_spans`` (the raw batches still hold the flagged intervals)."""
    op.drop_table("unmeasured_spans")
