"""Idle energy per device and day, kept at ingest beside the hourly rows.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01

A 7-day report summed about 30,000 ``idle_energy`` rows at 64 hosts (two days of hours, then days): the
largest part of its first page (17-38 ms of 134 ms at 20,000 jobs). ``idle_energy_days`` holds the same
energy per device and UTC day, added to by ingest in the same transaction as the hours, so a day's row
always equals the sum of that day's hour rows (the prune pass's fold moves energy within a day only).
A report whose idle window is whole days, as every window reaching back past two days is, reads it.
Filled here from the existing rows.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create ``idle_energy_days`` and fill it from ``idle_energy``."""
    op.create_table(
        "idle_energy_days",
        sa.Column("device_id", sa.Integer, nullable=False),
        sa.Column("day_s", sa.Float, nullable=False),
        sa.Column("energy_j", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("device_id", "day_s", name="pk_idle_energy_days"),
        sa.ForeignKeyConstraint(
            ["device_id"], ["devices.id"], name="fk_idle_energy_days_device_id_devices", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_idle_energy_days_day_s", "idle_energy_days", ["day_s"])
    # Hours are positive epoch seconds: an integer cast truncates to the day on SQLite (which may lack
    # floor()); PostgreSQL's cast rounds, so it takes floor().
    day = "floor(hour_s / 86400)" if op.get_bind().dialect.name == "postgresql" else "CAST(hour_s / 86400 AS INTEGER)"
    op.execute(
        f"INSERT INTO idle_energy_days (device_id, day_s, energy_j) "
        f"SELECT device_id, {day} * 86400.0, sum(energy_j) FROM idle_energy GROUP BY device_id, {day}"
    )


def downgrade() -> None:
    """Drop ``idle_energy_days`` (the hours still hold its energy)."""
    op.drop_table("idle_energy_days")
