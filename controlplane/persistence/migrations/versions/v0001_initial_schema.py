"""Initial schema: models, versions, labels, upload sessions, deployments, pointer events, tokens, nodes.

A frozen snapshot of the schema (now ``controlplane/persistence/rows.py``) as first released: it spells out plain SQLAlchemy
types instead of importing the models, so later edits to ``rows.py`` never change what this
revision creates. Timestamps are ``TIMESTAMP WITH TIME ZONE`` (``rows.UTCDateTime``); defaults are
applied by the application, so no server defaults are declared.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

_DIGEST = sa.String(length=71)
_NAME = sa.String(length=128)


def _timestamp() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    """Create every table of the first schema."""
    op.create_table(
        "models",
        sa.Column("name", _NAME, nullable=False),
        sa.Column("allow_pickle", sa.Boolean(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "versions",
        sa.Column("digest", _DIGEST, nullable=False),
        sa.Column("model", _NAME, nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("manifest_size", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("created_by", _NAME, nullable=False),
        sa.ForeignKeyConstraint(["model"], ["models.name"]),
        sa.PrimaryKeyConstraint("digest"),
    )
    op.create_index("ix_versions_model", "versions", ["model"])
    op.create_table(
        "labels",
        sa.Column("model", _NAME, nullable=False),
        sa.Column("label", _NAME, nullable=False),
        sa.Column("digest", _DIGEST, nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("created_by", _NAME, nullable=False),
        sa.ForeignKeyConstraint(["digest"], ["versions.digest"]),
        sa.ForeignKeyConstraint(["model"], ["models.name"]),
        sa.PrimaryKeyConstraint("model", "label"),
    )
    op.create_index("ix_labels_digest", "labels", ["digest"])
    op.create_table(
        "upload_sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("model", _NAME, nullable=False),
        sa.Column("digest", _DIGEST, nullable=False),
        sa.Column("manifest", sa.LargeBinary(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("allow_pickle", sa.Boolean(), nullable=False),
        sa.Column("uploads", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("expires_at", _timestamp(), nullable=False),
        sa.Column("created_by", _NAME, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_upload_sessions_digest", "upload_sessions", ["digest"])
    op.create_index("ix_upload_sessions_model", "upload_sessions", ["model"])
    op.create_table(
        "deployments",
        sa.Column("name", _NAME, nullable=False),
        sa.Column("model", _NAME, nullable=False),
        sa.Column("stable", _DIGEST, nullable=True),
        sa.Column("previous_stable", _DIGEST, nullable=True),
        sa.Column("canary", _DIGEST, nullable=True),
        sa.Column("canary_share", sa.Float(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", _timestamp(), nullable=False),
        sa.ForeignKeyConstraint(["model"], ["models.name"]),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "pointer_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("deployment", _NAME, nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("actor", _NAME, nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("from_stable", _DIGEST, nullable=True),
        sa.Column("to_stable", _DIGEST, nullable=True),
        sa.Column("from_canary", _DIGEST, nullable=True),
        sa.Column("to_canary", _DIGEST, nullable=True),
        sa.Column("canary_share", sa.Float(), nullable=False),
        sa.Column("at", _timestamp(), nullable=False),
        sa.ForeignKeyConstraint(["deployment"], ["deployments.name"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("deployment", "epoch", name="uq_pointer_events_epoch"),
    )
    op.create_index("ix_pointer_events_deployment", "pointer_events", ["deployment"])
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", _NAME, nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("created_by", _NAME, nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("secret_hash"),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", _NAME, nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("address", sa.String(length=512), nullable=True),
        sa.Column("deployments", sa.JSON(), nullable=False),
        sa.Column("registered_at", _timestamp(), nullable=False),
        sa.Column("last_seen", _timestamp(), nullable=True),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )


def downgrade() -> None:
    """Drop every table, children before parents."""
    for table in (
        "nodes",
        "tokens",
        "pointer_events",
        "deployments",
        "upload_sessions",
        "labels",
        "versions",
        "models",
    ):
        op.drop_table(table)
