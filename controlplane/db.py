"""The control plane's persisted schema (SQLAlchemy 2), and engine/session setup.

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
- ``tokens``: API tokens, only the SHA-256 of the secret is stored.
- ``nodes``: registered agents, their labels and their last heartbeat report.

Schema changes go through Alembic migrations in ``controlplane/migrations``; the models here
must match the newest migration (a test checks).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
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
    create_engine,
    event,
)
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

__all__ = [
    "Base",
    "DeploymentRow",
    "LabelRow",
    "ModelRow",
    "NodeRow",
    "PointerEventRow",
    "QueryCounter",
    "TokenRow",
    "UploadSessionRow",
    "VersionRow",
    "make_engine",
    "make_sessionmaker",
    "query_count",
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
            raise ValueError("naive datetime given to a UTCDateTime column; use controlplane.db.utcnow()")
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


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL and a busy timeout so concurrent writers queue."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        _count_queries(engine)
        return engine
    # No pool_pre_ping: it costs a round trip per checkout (a second transaction per request). TCP
    # keepalives find dead peers instead, and the first error on a dead connection invalidates the
    # whole pool (SQLAlchemy's disconnect handling), so a database restart costs one failed request.
    engine = create_engine(
        url,
        pool_size=10,
        max_overflow=20,
        pool_recycle=1800,
        connect_args={"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3},
    )
    _count_queries(engine)
    return engine


class QueryCounter(Collector):
    """``weightship_db_queries_total``: statements this process sent to its database."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[CounterMetricFamily]:
        """The count so far."""
        family = CounterMetricFamily("weightship_db_queries", "SQL statements sent to the database by this process")
        family.add_metric([], query_count(self._engine))
        yield family


def query_count(engine: Engine) -> int:
    """How many statements ``engine`` has executed since it was made."""
    return _TALLIES[engine].value


@dataclass
class _Tally:
    value: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_TALLIES: weakref.WeakKeyDictionary[Engine, _Tally] = weakref.WeakKeyDictionary()


def _count_queries(engine: Engine) -> None:
    tally = _TALLIES[engine] = _Tally()

    @event.listens_for(engine, "before_cursor_execute")
    def _counted(*_args: Any) -> None:
        with tally.lock:
            tally.value += 1


def make_sessionmaker(engine: Engine) -> sessionmaker[Any]:
    """Session factory; objects stay usable after commit."""
    return sessionmaker(engine, expire_on_commit=False)
