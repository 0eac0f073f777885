"""Where each job's span-energy walk stands, so a window never restarts at a long span's start.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06

A window of the span-energy pass settles the spans wholly inside it. Without a carry, one in flight at
its end makes the next window start again at that span's start, so a span of days is walked over and
over (a window per 10 minutes, each from the span's start: quadratic in its length). ``span_stats.carry``
holds, per job and kind, the minute the last window reached and the energy each span in flight there
got before it (``storage.span_energy``), and the next window starts from there. Null (every row at the
upgrade) makes the next window look back for spans in flight.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add ``span_stats.carry``."""
    op.add_column("span_stats", sa.Column("carry", sa.JSON, nullable=True))


def downgrade() -> None:
    """Drop ``span_stats.carry`` (the next pass starts each job's window as it did before)."""
    with op.batch_alter_table("span_stats") as batch:
        batch.drop_column("carry")
