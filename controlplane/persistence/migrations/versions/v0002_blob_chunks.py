"""Blob chunk lists: the verified chunk digests of each stored blob, per chunk size.

A frozen snapshot of ``db.BlobChunksRow`` as first released (plain SQLAlchemy types, no model
imports). Rows are inserted only after verification and never updated; an empty table is safe
(every blob is then re-verified the first time a manifest names it), so there is nothing to
backfill.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Create ``blob_chunks``."""
    op.create_table(
        "blob_chunks",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("chunk_size", sa.BigInteger(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("chunks", sa.JSON(), nullable=False),
        sa.Column("verified_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", "chunk_size"),
    )


def downgrade() -> None:
    """Drop ``blob_chunks``."""
    op.drop_table("blob_chunks")
