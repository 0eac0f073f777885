"""Raw intervals as one row per batch (``raw_batches``), with their shares, instead of a row per interval.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

Why: ``energy_intervals`` took a row per interval, the collector's highest-rate write (COPY formatting in
the collector, a heap tuple and an index entry per interval in the database), yet held no job shares, so
nothing could be rebuilt or audited from it. ``raw_batches`` keeps each batch's intervals, shares
included, compressed in one row (``storage.raw_batches`` documents the encoding): rollups can be
recomputed from it, and it costs one row per batch. ``energy_intervals`` stays for the rows written before
this revision; retention empties it like any raw data, and nothing writes it any more.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create ``raw_batches`` and its two indexes (host and start; end, for retention)."""
    op.create_table(
        "raw_batches",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("host_id", sa.Integer, nullable=False),
        sa.Column("agent_id", sa.String(200), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("received_at_s", sa.Float, nullable=False),
        sa.Column("t_start_s", sa.Float, nullable=False),
        sa.Column("t_end_s", sa.Float, nullable=False),
        sa.Column("n_intervals", sa.Integer, nullable=False),
        sa.Column("energy_j", sa.Float, nullable=False),
        sa.Column("format", sa.Integer, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_raw_batches"),
    )
    op.create_index("ix_raw_batches_host_id_t_start_s", "raw_batches", ["host_id", "t_start_s"])
    op.create_index("ix_raw_batches_t_end_s", "raw_batches", ["t_end_s"])


def downgrade() -> None:
    """Drop ``raw_batches`` (its raw data goes with it)."""
    op.drop_table("raw_batches")
