"""Hosts' grid region: where each host draws its power from, for its emissions.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

``hosts.grid_region`` holds the region the host's agent last sent (``--grid-region``: an ISO 3166 alpha-3
country code such as FRA, or a cloud provider:region such as gcp:europe-west9). Reports charge each
host's energy at that region's intensity from codecarbon's data (``wattwatch.carbon.policy``). Existing
hosts have none: they keep the collector's configured intensity until their agent sends one.

It follows 0008 (device totals), which was written beside it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the nullable ``hosts.grid_region``."""
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("grid_region", sa.String(64), nullable=True))


def downgrade() -> None:
    """Drop ``hosts.grid_region``."""
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("grid_region")
