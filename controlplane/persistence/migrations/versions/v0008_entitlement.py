"""Entitlement from the control plane's truth: token scopes and what a node was assigned at enrolment.

- ``tokens.deployments``: for an enrolment token, the deployments the nodes it enrols are assigned
  (JSON list); ``NULL``: every deployment (the unscoped default, e.g. the chart's bootstrap token).
- ``tokens.node_role``: the node role the nodes it enrols get (``cache`` only from a token minted
  for caches); ``NULL``: ``node``.
- ``nodes.assigned``: the deployments a node was assigned (copied from its enrolment token, or
  set by an operator); ``NULL``: every deployment.
- ``deployments.assign_selector``: a node-label selector; the nodes it matches (labels fixed at
  enrolment) are assigned the deployment too. ``nodes.enrolled``: whether its role and labels were fixed by an
  enrolment (registration cannot change them).

Existing rows get ``NULL``/false: nodes enrolled before keep what they could fetch until they are
enrolled again with a scoped token.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Add ``tokens.deployments``, ``tokens.node_role``, ``nodes.assigned``, ``nodes.enrolled``, ``deployments.assign_selector``."""
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("deployments", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("node_role", sa.String(length=16), nullable=True))
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("assigned", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("enrolled", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("assign_selector", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    """Drop the columns: entitlement falls back to what nodes register."""
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("assign_selector")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("enrolled")
        batch.drop_column("assigned")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("node_role")
        batch.drop_column("deployments")
