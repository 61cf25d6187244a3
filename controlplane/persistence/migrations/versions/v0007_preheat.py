"""Preheats and warm pools: ``preheats`` and ``deployments.warm_pool`` (``controlplane.staging``).

A preheat stages a ready version on the nodes its selector matches, without switching, until it is
deleted; a warm pool (a deployment's node selector) keeps that deployment's stable and canary
versions staged on the nodes it matches. Both start empty: nothing changes for existing fleets.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Create ``preheats``; add ``deployments.warm_pool`` (nullable JSON)."""
    op.create_table(
        "preheats",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("deployment", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("version", sa.String(length=200), nullable=False),
        sa.Column("selector", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(["deployment"], ["deployments.name"]),
        sa.ForeignKeyConstraint(["digest"], ["versions.digest"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_preheats_deployment", "preheats", ["deployment"])
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("warm_pool", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop ``preheats`` and ``deployments.warm_pool``: nodes stop staging; what they hold ages out."""
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("warm_pool")
    op.drop_index("ix_preheats_deployment", table_name="preheats")
    op.drop_table("preheats")
