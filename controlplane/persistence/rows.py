"""The control plane's persisted schema (SQLAlchemy 2): one ORM row class per table.

Tables and what they promise:

- ``models``: one row per model name; ``allow_pickle`` is the per-model opt-in for pickle files.
- ``versions``: one row per published manifest, keyed by its digest. Rows are only inserted
  once every blob has been verified and the manifest written to the store, so a row means
  "ready". Never updated, never deleted while referenced.
- ``labels``: ``(model, label) -> digest``. Inserted once; never updated (labels never move).
- ``upload_sessions``: an open publish; holds the manifest bytes and the store's multipart ids.
- ``deployments``: the serving pointer. ``epoch`` only grows; every update is a compare-and-swap
  ``UPDATE ... WHERE name = :name AND epoch = :expected``.
- ``pointer_events``: audit, one row per epoch per deployment (unique), who/why/from/to.
- ``tokens``: API tokens, only the SHA-256 of the secret is stored; a node token names its node
  (``node_id``), at most one active per node.
- ``nodes``: registered agents, their labels and their last heartbeat report.
- ``blob_chunks``: ``(blob sha256, chunk size) -> chunk digests``, inserted only once the control
  plane (or a store checksum covering exactly those digests) verified every byte of the blob under
  that geometry; never updated. A manifest naming a known blob at a known chunk size must state
  exactly this list.
- ``rollouts``: one row per rollout (spec, engine status with every measurement, the fleet as the
  driver last saw it); ``active_deployment`` is the deployment's name while the rollout is active,
  else NULL, and UNIQUE: one active rollout per deployment. ``lease_holder``/``lease_expires_at``
  name the process that drives it; ``row_version`` fences status writes (compare-and-swap).
- ``preheats``: standing preheats (a version staged on the nodes a selector matches) until deleted;
  ``deployments.warm_pool`` is a deployment's warm-pool selector (``controlplane.staging``).
- ``ticket_keys``: the ed25519 keys that sign entitlement tickets (``controlplane.tickets``); the
  newest not retired signs, all not retired are published. Shared by every replica.

Schema changes go through Alembic migrations in ``controlplane/persistence/migrations``; the models here
must match the newest migration (a test checks). Engines and sessions: ``controlplane.persistence.engine``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "Base",
    "BlobChunksRow",
    "DeploymentRow",
    "LabelRow",
    "ModelRow",
    "NodeRow",
    "PointerEventRow",
    "PreheatRow",
    "RolloutRow",
    "ServeSampleRow",
    "TicketKeyRow",
    "TokenRow",
    "UploadSessionRow",
    "VersionRow",
    "utcnow",
]

DIGEST = String(71)  # "sha256:" + 64 hex


def utcnow() -> datetime:
    """Timezone-aware now, the only clock the schema uses."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Stored as timezone-aware; SQLite hands back naive values, so reattach UTC on the way out."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTCDateTime column; use controlplane.persistence.rows.utcnow()")
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    """Declarative base of every table."""


class ModelRow(Base):
    """A model name."""

    __tablename__ = "models"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    allow_pickle: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class VersionRow(Base):
    """A ready, immutable version."""

    __tablename__ = "versions"
    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    model: Mapped[str] = mapped_column(ForeignKey("models.name"), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    files: Mapped[int] = mapped_column(Integer)
    manifest_size: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="ready")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))


class LabelRow(Base):
    """A label of a version; unique per model, never moved."""

    __tablename__ = "labels"
    model: Mapped[str] = mapped_column(ForeignKey("models.name"), primary_key=True)
    label: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(ForeignKey("versions.digest"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))


class UploadSessionRow(Base):
    """An open, committed or aborted publish session."""

    __tablename__ = "upload_sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), index=True)
    digest: Mapped[str] = mapped_column(DIGEST, index=True)
    manifest: Mapped[bytes] = mapped_column(LargeBinary)
    labels: Mapped[list[str]] = mapped_column(JSON, default=list)
    allow_pickle: Mapped[bool] = mapped_column(Boolean, default=False)
    #: blob sha256 -> the store's multipart upload id (S3) or staging id (local)
    uploads: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    state: Mapped[str] = mapped_column(String(16), default="open")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    created_by: Mapped[str] = mapped_column(String(128))


class DeploymentRow(Base):
    """The serving pointer of a deployment; ``epoch`` is the compare-and-swap fence."""

    __tablename__ = "deployments"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(ForeignKey("models.name"))
    stable: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    previous_stable: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    canary: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    canary_share: Mapped[float] = mapped_column(Float, default=0.0)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    #: whether publisher tokens may start rollouts of it (NULL: no)
    publisher_rollouts: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    #: the warm pool's node selector (label -> value), or NULL: no warm pool
    warm_pool: Mapped[dict[str, str] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    #: node-label selector of the nodes this deployment is assigned to (beside their enrolment scope)
    assign_selector: Mapped[dict[str, str] | None] = mapped_column(JSON(none_as_null=True), nullable=True)


class PreheatRow(Base):
    """A standing preheat: stage ``digest`` on the nodes ``selector`` matches until it is cancelled."""

    __tablename__ = "preheats"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    deployment: Mapped[str] = mapped_column(ForeignKey("deployments.name"), index=True)
    model: Mapped[str] = mapped_column(String(128))
    digest: Mapped[str] = mapped_column(ForeignKey("versions.digest"))
    #: the ref it was asked with (label or digest), for display
    version: Mapped[str] = mapped_column(String(200))
    selector: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))


class PointerEventRow(Base):
    """Audit of one pointer change."""

    __tablename__ = "pointer_events"
    __table_args__ = (UniqueConstraint("deployment", "epoch", name="uq_pointer_events_epoch"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment: Mapped[str] = mapped_column(ForeignKey("deployments.name"), index=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    action: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text, default="")
    from_stable: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    to_stable: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    from_canary: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    to_canary: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    canary_share: Mapped[float] = mapped_column(Float, default=0.0)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TokenRow(Base):
    """An API token; ``secret_hash`` is the SHA-256 of the secret."""

    __tablename__ = "tokens"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))
    #: the node a node token acts for; ``None`` for every other token (an ``agent`` token without
    #: a node is an enrolment token: it can only enrol a node)
    node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id"), nullable=True, index=True)
    #: an enrolment token's scope: the deployments the nodes it enrols are assigned; ``None``: all
    deployments: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    #: the role the nodes an enrolment token enrols get (``cache`` only from a token minted for it); ``None``: node
    node_role: Mapped[str | None] = mapped_column(String(16), nullable=True)


class NodeRow(Base):
    """A registered agent and its latest heartbeat."""

    __tablename__ = "nodes"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    role: Mapped[str] = mapped_column(String(16), default="node")
    address: Mapped[str | None] = mapped_column(String(512), nullable=True)
    deployments: Mapped[list[str]] = mapped_column(JSON, default=list)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    #: the last NodeHeartbeat body, as JSON
    report: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: the deployments an operator assigned the node (its enrolment token's scope); ``None``: all
    assigned: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    #: whether an enrolment fixed the node's role and labels (registration cannot change them)
    enrolled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class BlobChunksRow(Base):
    """The verified chunk digests of a stored blob under one chunk size."""

    __tablename__ = "blob_chunks"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    chunk_size: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    #: hex SHA-256 of each chunk, in order
    chunks: Mapped[list[str]] = mapped_column(JSON)
    verified_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TicketKeyRow(Base):
    """An ed25519 key that signs entitlement tickets (raw keys, base64url)."""

    __tablename__ = "ticket_keys"
    kid: Mapped[str] = mapped_column(String(32), primary_key=True)
    private_key: Mapped[str] = mapped_column(String(64))
    public_key: Mapped[str] = mapped_column(String(64))
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RolloutRow(Base):
    """A rollout: spec, engine status, fleet view, the lease of the process driving it."""

    __tablename__ = "rollouts"
    __table_args__ = (UniqueConstraint("active_deployment", name="uq_rollouts_active_deployment"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    deployment: Mapped[str] = mapped_column(ForeignKey("deployments.name"), index=True)
    #: ``deployment`` while the rollout is active, else NULL; unique: one active rollout per deployment
    active_deployment: Mapped[str | None] = mapped_column(String(128), nullable=True)
    version: Mapped[str] = mapped_column(DIGEST)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: the engine's ``RolloutStatus.to_dict()``; NULL until the first reconcile
    status: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: analysis runs of earlier attempts (a retry starts with none)
    past_runs: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    #: what the driver last observed: nodes per digest, staged and target nodes
    fleet: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    row_version: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_holder: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ServeSampleRow(Base):
    """The fleet's serving counters at one moment: where a rollout analysis window starts.

    ``data`` maps node id to ``{"since": ISO time, "v": [[deployment, digest, requests, errors,
    load_failures, validations_passed, validations_failed, [latency_le...]], ...]}``
    (``controlplane.traffic``). Rows are written every few seconds and deleted after a retention.
    """

    __tablename__ = "serve_samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
