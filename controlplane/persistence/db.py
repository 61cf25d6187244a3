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
must match the newest migration (a test checks).
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

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
    exc,
    false,
)
from sqlalchemy.engine import Dialect, Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from weightship.errors import DatabaseUnavailable

__all__ = [
    "Base",
    "BlobChunksRow",
    "DatabaseFileGuard",
    "DeploymentRow",
    "LabelRow",
    "ModelRow",
    "NodeRow",
    "PointerEventRow",
    "PreheatRow",
    "QueryCounter",
    "RolloutRow",
    "TicketKeyRow",
    "TokenRow",
    "UploadSessionRow",
    "VersionRow",
    "database_errors",
    "make_engine",
    "make_sessionmaker",
    "query_count",
    "utcnow",
]

log = logging.getLogger(__name__)

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
            raise ValueError("naive datetime given to a UTCDateTime column; use controlplane.persistence.db.utcnow()")
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


#: defaults of ``make_engine``'s bounds, the same as ``Settings``' (seconds, connections)
LOCK_TIMEOUT = 2.0
POOL_TIMEOUT = 3.0
POOL_SIZE = 10
STATEMENT_TIMEOUT = 30.0


class DatabaseFileGuard:
    """The identity (device, inode) of the SQLite file an engine opened, checked on every use.

    SQLite keeps writing to a file that was deleted or replaced under it (its open descriptors
    still point at the old inode), so without this check writes would be acknowledged and then
    lost on the next start. Every connection checkout and every commit compare the path's
    identity with the one recorded at start: a missing or different file raises
    ``DatabaseUnavailable`` (503), so ``/readyz`` fails and nothing more is acknowledged.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.identity = self._stat()
        if self.identity is None:
            raise DatabaseUnavailable(f"SQLite database {path} could not be created; check the directory")

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def check(self) -> None:
        """Raise ``DatabaseUnavailable`` unless the path still names the file opened at start."""
        now = self._stat()
        if now == self.identity:
            return
        what = "was deleted" if now is None else "was replaced by another file"
        log.error("database_file_lost path=%s change=%s", self.path, "deleted" if now is None else "replaced")
        raise DatabaseUnavailable(
            f"SQLite database {self.path} {what} while the control plane was running; nothing more is written to "
            "it: restore the database file (from a backup) and restart the control plane",
            delay=30.0,
        )


def _sqlite_engine(url: str, lock_timeout: float, pool_timeout: float, pool_size: int) -> Engine:
    database = make_url(url).database
    in_memory = not database or database == ":memory:" or database.startswith("file:")
    guard: DatabaseFileGuard | None = None
    if not in_memory:
        path = Path(database or "").resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        sqlite3.connect(path).close()  # create it now: later connections only open an existing file
        guard = DatabaseFileGuard(path)
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": lock_timeout},
        pool_timeout=pool_timeout,
        **({} if in_memory else {"pool_size": pool_size, "max_overflow": pool_size}),
    )

    if guard is not None:
        file_guard = guard
        uri = f"file:{quote(str(file_guard.path))}?mode=rw"

        @event.listens_for(engine, "do_connect")
        def _open_existing_only(_dialect: Any, _record: Any, cargs: list[Any], cparams: dict[str, Any]) -> None:
            # mode=rw: a deleted file is an error, never silently a new empty database
            file_guard.check()
            cargs[:] = [uri]
            cparams["uri"] = True

        @event.listens_for(engine, "checkout")
        def _check_file_on_checkout(_dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
            file_guard.check()

        @event.listens_for(engine, "commit")
        def _check_file_on_commit(_conn: Any) -> None:
            file_guard.check()

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


def make_engine(
    url: str,
    *,
    lock_timeout: float = LOCK_TIMEOUT,
    pool_timeout: float = POOL_TIMEOUT,
    pool_size: int = POOL_SIZE,
    statement_timeout: float = STATEMENT_TIMEOUT,
) -> Engine:
    """An engine for ``url`` whose every wait is bounded, so a busy database answers 503 fast.

    - ``lock_timeout``: SQLite's busy timeout, PostgreSQL's ``lock_timeout``; a write waiting
      longer for another writer fails (``OperationalError``, mapped to 503 + Retry-After).
    - ``pool_timeout``: the longest wait for a pooled connection.
    - ``statement_timeout``: PostgreSQL's ``statement_timeout``.

    A SQLite file is created here if missing, then guarded (``DatabaseFileGuard``); SQLite runs
    in WAL mode so readers never wait for the writer.
    """
    if url.startswith("sqlite"):
        engine = _sqlite_engine(url, lock_timeout, pool_timeout, pool_size)
        _count_queries(engine)
        return engine
    # No pool_pre_ping: it costs a round trip per checkout (a second transaction per request). TCP
    # keepalives find dead peers instead, and the first error on a dead connection invalidates the
    # whole pool (SQLAlchemy's disconnect handling), so a database restart costs one failed request.
    options = f"-c lock_timeout={int(lock_timeout * 1000)} -c statement_timeout={int(statement_timeout * 1000)}"
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=pool_timeout,
        pool_recycle=1800,
        connect_args={
            "options": options,
            "connect_timeout": max(2, math.ceil(pool_timeout)),
            "keepalives": 1,
            "keepalives_idle": 30,
            "keepalives_interval": 10,
            "keepalives_count": 3,
        },
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


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Session factory; objects stay usable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def database_errors(what: str) -> Iterator[None]:
    """Map SQLAlchemy's connection-level failures of ``what`` (locked, timed out, unreachable) to 503."""
    try:
        yield
    except (exc.OperationalError, exc.InterfaceError) as err:
        raise DatabaseUnavailable(
            f"{what}: the database is unavailable or busy ({type(err.orig).__name__}: {err.orig}); retry shortly"
        ) from None
    except exc.TimeoutError:
        raise DatabaseUnavailable(
            f"{what}: every database connection is in use (pool timeout); the control plane is overloaded, retry shortly"
        ) from None
