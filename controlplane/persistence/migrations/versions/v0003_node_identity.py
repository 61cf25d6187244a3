"""Node identity: a token may name the node it acts for (``tokens.node_id``).

Enrolment (``POST /v1/nodes/enrol``) mints a node token bound to the node it registers; heartbeats,
desired state and re-registration then only accept that node's own token. Existing tokens keep
``node_id`` NULL: agent tokens become enrolment tokens, so agents enrol on their next start.

Revision ID: 0003
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Add ``tokens.node_id`` (nullable, indexed, references ``nodes.id``)."""
    # batch mode: SQLite cannot add a foreign key to an existing table, so Alembic rebuilds it there.
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("node_id", sa.String(length=64), nullable=True))
        batch.create_index("ix_tokens_node_id", ["node_id"])
        batch.create_foreign_key("fk_tokens_node_id_nodes", "nodes", ["node_id"], ["id"])


def downgrade() -> None:
    """Drop ``tokens.node_id``; node tokens become plain agent tokens again (revoke them first)."""
    with op.batch_alter_table("tokens") as batch:
        batch.drop_constraint("fk_tokens_node_id_nodes", type_="foreignkey")
        batch.drop_index("ix_tokens_node_id")
        batch.drop_column("node_id")
