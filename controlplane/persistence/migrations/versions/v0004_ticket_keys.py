"""Ticket signing keys: the control plane's ed25519 keys that sign entitlement tickets.

One row per key; the newest row that is not retired signs, every row that is not retired is
published (``GET /v1/tickets/keys``) so tickets signed just before a rotation still verify. The
private key is stored in the database (not a data directory) so every replica signs with the same
key. A plain table, no foreign keys; empty is fine (the first ticket request creates a key).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Create ``ticket_keys``."""
    op.create_table(
        "ticket_keys",
        sa.Column("kid", sa.String(length=32), nullable=False),
        sa.Column("private_key", sa.String(length=64), nullable=False),
        sa.Column("public_key", sa.String(length=64), nullable=False),
        sa.Column("retired", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("kid"),
    )


def downgrade() -> None:
    """Drop ``ticket_keys``: tickets already issued stop verifying once agents re-read the keys."""
    op.drop_table("ticket_keys")
