"""Phases: a job record that is another job's setup or after phase (the process outside its jobs).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07

An agent sends the energy a process draws before its explicit job opens (model load, warm-up, the gap
since its previous job) and after the job ends (while it stays on the GPU) as jobs of their own, labelled
``wattwatch.io/phase`` and ``wattwatch.io/phase-of``. Ingest copies those labels into ``jobs.phase`` and
``jobs.phase_of`` so reports can hide such rows and fold their energy into the job they belong to.
Existing rows are ordinary jobs (NULL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the phase columns and the index reports look phases up by."""
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("phase", sa.String(8), nullable=True))
        batch.add_column(sa.Column("phase_of", sa.String(200), nullable=True))
        batch.create_index("ix_jobs_phase_of", ["phase_of"])


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_phase_of")
        batch.drop_column("phase_of")
        batch.drop_column("phase")
