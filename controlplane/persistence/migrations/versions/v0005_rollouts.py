"""Rollouts: one row per rollout of a version of a deployment, driven by one control plane at a time.

``rollouts`` holds the spec as created, the engine's status (with every analysis run and
measurement of the current attempt; earlier attempts' runs move to ``past_runs`` on retry) and
what the driver last saw of the fleet (``fleet``). ``active_deployment`` equals ``deployment``
while the rollout is active and is NULL otherwise; its UNIQUE constraint is how the database
guarantees one active rollout per deployment (NULLs never collide, on SQLite and PostgreSQL).
``lease_holder``/``lease_expires_at`` name the control-plane process that drives it and until
when; ``row_version`` is the compare-and-swap fence of status writes (driver and verbs).

``deployments.publisher_rollouts`` (NULL = no) lets publisher tokens start rollouts of a deployment.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Create ``rollouts``; add ``deployments.publisher_rollouts``."""
    op.create_table(
        "rollouts",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("deployment", sa.String(length=128), nullable=False),
        sa.Column("active_deployment", sa.String(length=128), nullable=True),
        sa.Column("version", sa.String(length=71), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("status", sa.JSON(), nullable=True),
        sa.Column("past_runs", sa.JSON(), nullable=False),
        sa.Column("fleet", sa.JSON(), nullable=False),
        sa.Column("row_version", sa.BigInteger(), nullable=False),
        sa.Column("lease_holder", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["deployment"], ["deployments.name"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("active_deployment", name="uq_rollouts_active_deployment"),
    )
    op.create_index("ix_rollouts_deployment", "rollouts", ["deployment"])
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("publisher_rollouts", sa.Boolean(), nullable=True))


def downgrade() -> None:
    """Drop ``rollouts`` (running rollouts stop where they are; the pointers stay) and the flag."""
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("publisher_rollouts")
    op.drop_index("ix_rollouts_deployment", table_name="rollouts")
    op.drop_table("rollouts")
