"""Serving samples: the fleet's per-version serving counters at moments, for analysis windows.

One row per sample (every few seconds, by each control-plane replica); the built-in rollout
provider and the autoscaling gauges compare now with the sample at a window's start. Rows older
than the retention are deleted by the sampler. No foreign keys: node ids inside ``data`` may name
nodes removed since.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Create ``serve_samples``."""
    op.create_table(
        "serve_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_serve_samples_at", "serve_samples", ["at"])


def downgrade() -> None:
    """Drop ``serve_samples``: analysis windows then start from the next samples taken."""
    op.drop_index("ix_serve_samples_at", table_name="serve_samples")
    op.drop_table("serve_samples")
