"""Per-device energy totals kept at ingest, and an index on idle_energy's hour: bounded reads.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

Why: /metrics exported each device's idle and total energy by summing every idle hour and every job's
energy ever stored: a scrape that grew with history. ``device_energy`` holds one row per device with
the running sums (ingest adds each batch's job and idle joules in the same transaction as the rollups),
so /metrics reads O(devices). The upgrade fills it from the rollups already stored.

``idle_energy`` is keyed (device, hour); a report's window ("the last 7 days") selects by hour across all
devices, which the primary key cannot serve: ``ix_idle_energy_hour_s`` can.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create device_energy (filled from the rollups) and the idle hour index."""
    op.create_table(
        "device_energy",
        sa.Column("device_id", sa.Integer, nullable=False),
        sa.Column("job_energy_j", sa.Float, nullable=False),
        sa.Column("idle_energy_j", sa.Float, nullable=False),
        sa.ForeignKeyConstraint(
            ["device_id"], ["devices.id"], name="fk_device_energy_device_id_devices", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("device_id", name="pk_device_energy"),
    )
    op.execute(
        """
        INSERT INTO device_energy (device_id, job_energy_j, idle_energy_j)
        SELECT d.id,
               COALESCE((SELECT SUM(j.energy_j) FROM job_device_energy j WHERE j.device_id = d.id), 0.0),
               COALESCE((SELECT SUM(i.energy_j) FROM idle_energy i WHERE i.device_id = d.id), 0.0)
        FROM devices d
        """
    )
    op.create_index("ix_idle_energy_hour_s", "idle_energy", ["hour_s"])


def downgrade() -> None:
    """Drop them (the rollups still hold every figure)."""
    op.drop_index("ix_idle_energy_hour_s", table_name="idle_energy")
    op.drop_table("device_energy")
