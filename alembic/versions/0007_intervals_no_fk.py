"""Drop the foreign key from energy_intervals to devices: it cost more than half of each raw row's insert.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

Why: ``energy_intervals`` takes every raw interval an agent pushes, the collector's highest-rate write.
Profiled under load (benchmarks/load.py), PostgreSQL checked the foreign key once per row (a lookup
of the device's primary key from a trigger): about 5 of the 9 microseconds each COPYed row cost, and a
group of 2,400 rows went from 57 to 45 ms without it. The check guards nothing in practice: the collector
writes ``device_id`` from the devices it upserted in the same transaction, and nothing deletes devices (so
the ON DELETE CASCADE never fired). The column keeps its index; the other tables keep their keys.

SQLite recreates the table to drop a constraint (Alembic batch mode): a one-time copy of the rows.
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

FK_NAME = "fk_energy_intervals_device_id_devices"


def upgrade() -> None:
    """Drop energy_intervals.device_id's foreign key."""
    with op.batch_alter_table("energy_intervals") as batch:
        batch.drop_constraint(FK_NAME, type_="foreignkey")


def downgrade() -> None:
    """Restore the foreign key (every row must name an existing device)."""
    with op.batch_alter_table("energy_intervals") as batch:
        batch.create_foreign_key(FK_NAME, "devices", ["device_id"], ["id"], ondelete="CASCADE")
