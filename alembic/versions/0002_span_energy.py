"""Per-span energy: span kinds, per-span joules, count windows, job ticks, the work queue and results.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01

Existing rows stay valid: every stored span becomes a ``query`` (the only kind 0001 knew) with no
energy yet, and the new totals start at zero. Jobs measured before this revision have no ticks, so
their spans get energy only from data ingested after the upgrade.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER only


def upgrade() -> None:
    """Add the span-energy columns and tables."""
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("max_tick_s", sa.Float(), nullable=False, server_default="0"))
    with op.batch_alter_table("queries") as batch:
        batch.add_column(sa.Column("kind", sa.String(8), nullable=False, server_default="query"))
        batch.add_column(sa.Column("energy_j", sa.Float(), nullable=True))
        batch.drop_index("ix_queries_job_id_t_start_s")
        batch.create_index("ix_queries_job_id_kind_t_start_s", ["job_id", "kind", "t_start_s"])
    with op.batch_alter_table("job_query_totals") as batch:
        for name in ("steps", "epochs", "counted_queries", "counted_tokens_in", "counted_tokens_out"):
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=False, server_default="0"))
    op.create_table(
        "query_counts",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=True),
        sa.Column("t_start_s", sa.Float(), nullable=False),
        sa.Column("t_end_s", sa.Float(), nullable=False),
        sa.Column("queries", sa.BigInteger(), nullable=False),
        sa.Column("tokens_in", sa.BigInteger(), nullable=False),
        sa.Column("tokens_out", sa.BigInteger(), nullable=False),
        sa.Column("energy_j", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_query_counts"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_query_counts_job_id_jobs", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"], name="fk_query_counts_host_id_hosts", ondelete="SET NULL"),
    )
    op.create_index("ix_query_counts_job_id_t_start_s", "query_counts", ["job_id", "t_start_s"])
    op.create_table(
        "job_ticks",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=True),
        sa.Column("t_start_s", sa.Float(), nullable=False),
        sa.Column("t_end_s", sa.Float(), nullable=False),
        sa.Column("ticks", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_job_ticks"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_job_ticks_job_id_jobs", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"], name="fk_job_ticks_host_id_hosts", ondelete="SET NULL"),
    )
    op.create_index("ix_job_ticks_job_id_t_start_s", "job_ticks", ["job_id", "t_start_s"])
    op.create_table(
        "span_dirty",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("t_s", sa.Float(), nullable=False),
        sa.Column("max_tick_s", sa.Float(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("id", name="pk_span_dirty"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_span_dirty_job_id_jobs", ondelete="CASCADE"),
    )
    op.create_index("ix_span_dirty_job_id", "span_dirty", ["job_id"])
    op.create_table(
        "span_stats",
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("max_span_s", sa.Float(), nullable=False),
        sa.Column("settled_spans", sa.BigInteger(), nullable=False),
        sa.Column("settled_queries", sa.BigInteger(), nullable=False),
        sa.Column("settled_tokens", sa.BigInteger(), nullable=False),
        sa.Column("settled_energy_j", sa.Float(), nullable=False),
        sa.Column("waiting_energy_j", sa.Float(), nullable=False),
        sa.Column("sketch", sa.JSON(), nullable=True),
        sa.Column("p50_j", sa.Float(), nullable=True),
        sa.Column("p95_j", sa.Float(), nullable=True),
        sa.Column("computed_to_s", sa.Float(), nullable=True),
        sa.Column("computed_at_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("job_id", "kind", name="pk_span_stats"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_span_stats_job_id_jobs", ondelete="CASCADE"),
    )
    op.create_table(
        "span_waiting",
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("bucket_s", sa.Float(), nullable=False),
        sa.Column("energy_j", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "kind", "bucket_s", name="pk_span_waiting"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_span_waiting_job_id_jobs", ondelete="CASCADE"),
    )


def downgrade() -> None:
    """Back to 0001: drop the new tables and columns (computed energies are lost; spans keep)."""
    for name in ("span_waiting", "span_stats", "span_dirty", "job_ticks", "query_counts"):
        op.drop_table(name)
    with op.batch_alter_table("job_query_totals") as batch:
        for name in ("steps", "epochs", "counted_queries", "counted_tokens_in", "counted_tokens_out"):
            batch.drop_column(name)
    with op.batch_alter_table("queries") as batch:
        batch.drop_index("ix_queries_job_id_kind_t_start_s")
        batch.create_index("ix_queries_job_id_t_start_s", ["job_id", "t_start_s"])
        batch.drop_column("energy_j")
        batch.drop_column("kind")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("max_tick_s")
