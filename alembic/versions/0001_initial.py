"""Initial schema: hosts, devices, jobs, raw intervals, rollups, queries, batch keys.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Written out column by column (not ``metadata.create_all``) so this revision stays what it was when
``tables.py`` moves on.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER only


def upgrade() -> None:
    """Create every table of schema version 0001."""
    op.create_table(
        "hosts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("agent_id", sa.String(200), nullable=True),
        sa.Column("first_seen_s", sa.Float(), nullable=False),
        sa.Column("last_seen_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_hosts"),
        sa.UniqueConstraint("name", name="uq_hosts_name"),
    )
    op.create_table(
        "devices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("uuid", sa.String(200), nullable=True),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("power_limit_w", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_devices"),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"], name="fk_devices_host_id_hosts", ondelete="CASCADE"),
        sa.UniqueConstraint("host_id", "key", name="uq_devices_host_id_key"),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(200), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("started_at_s", sa.Float(), nullable=False),
        sa.Column("ended_at_s", sa.Float(), nullable=True),
        sa.Column("created_at_s", sa.Float(), nullable=False),
        sa.Column("placeholder", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_index("ix_jobs_started_at_s", "jobs", ["started_at_s"])
    op.create_index("ix_jobs_ended_at_s", "jobs", ["ended_at_s"])
    op.create_table(
        "energy_intervals",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("t_start_s", sa.Float(), nullable=False),
        sa.Column("t_end_s", sa.Float(), nullable=False),
        sa.Column("energy_j", sa.Float(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("flags", sa.String(200), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_energy_intervals"),
        sa.ForeignKeyConstraint(
            ["device_id"], ["devices.id"], name="fk_energy_intervals_device_id_devices", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_energy_intervals_device_id_t_start_s", "energy_intervals", ["device_id", "t_start_s"])
    op.create_table(
        "job_device_energy",
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("energy_j", sa.Float(), nullable=False),
        sa.Column("sources", sa.String(200), nullable=False),
        sa.Column("max_power_w", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "device_id", name="pk_job_device_energy"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_job_device_energy_job_id_jobs", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["device_id"], ["devices.id"], name="fk_job_device_energy_device_id_devices", ondelete="CASCADE"
        ),
    )
    op.create_table(
        "job_hosts",
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("peak_power_w", sa.Float(), nullable=False),
        sa.Column("first_s", sa.Float(), nullable=False),
        sa.Column("last_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "host_id", name="pk_job_hosts"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_job_hosts_job_id_jobs", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"], name="fk_job_hosts_host_id_hosts", ondelete="CASCADE"),
    )
    op.create_table(
        "idle_energy",
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("hour_s", sa.Float(), nullable=False),
        sa.Column("energy_j", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("device_id", "hour_s", name="pk_idle_energy"),
        sa.ForeignKeyConstraint(
            ["device_id"], ["devices.id"], name="fk_idle_energy_device_id_devices", ondelete="CASCADE"
        ),
    )
    op.create_table(
        "queries",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=True),
        sa.Column("t_start_s", sa.Float(), nullable=False),
        sa.Column("t_end_s", sa.Float(), nullable=False),
        sa.Column("tokens_in", sa.Integer(), nullable=False),
        sa.Column("tokens_out", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_queries"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_queries_job_id_jobs", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"], name="fk_queries_host_id_hosts", ondelete="SET NULL"),
    )
    op.create_index("ix_queries_job_id_t_start_s", "queries", ["job_id", "t_start_s"])
    op.create_table(
        "job_query_totals",
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("queries", sa.BigInteger(), nullable=False),
        sa.Column("tokens_in", sa.BigInteger(), nullable=False),
        sa.Column("tokens_out", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name="pk_job_query_totals"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_job_query_totals_job_id_jobs", ondelete="CASCADE"),
    )
    op.create_table(
        "ingested_batches",
        sa.Column("agent_id", sa.String(200), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("received_at_s", sa.Float(), nullable=False),
        sa.Column("n_intervals", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("agent_id", "seq", name="pk_ingested_batches"),
    )


def downgrade() -> None:
    """Drop every table, children first."""
    for name in (
        "ingested_batches",
        "job_query_totals",
        "queries",
        "idle_energy",
        "job_hosts",
        "job_device_energy",
        "energy_intervals",
        "jobs",
        "devices",
        "hosts",
    ):
        op.drop_table(name)
