"""The control plane's application state: every long-lived part a request may need, by name.

One ``AppState`` per application, built at start-up by ``AppState.open`` and reached by routes
through ``controlplane.http.state_of(request)``. Each part is a named, typed field: the settings,
the database engine and its sessions, the origin store, the metrics, the change feed, the
desired-state snapshots, the token cache, the clock publish sessions expire by, and the fleet's
per-process memos. Domain functions take the ``AppState`` (or just the part they need); nothing
looks parts up by a string key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from controlplane.auth import Principal
from controlplane.authcache import TokenCache
from controlplane.metrics import ControlPlaneMetrics, create_metrics
from controlplane.notify import ChangeFeed
from controlplane.persistence.batch import GroupCommit
from controlplane.persistence.engine import make_sessionmaker
from controlplane.persistence.heartbeats import HeartbeatWrite, store_heartbeats
from controlplane.persistence.rows import utcnow
from controlplane.persistence.store import OriginStore
from controlplane.settings import Settings
from controlplane.snapshot import Snapshots

if TYPE_CHECKING:  # the type only: the driver is a domain service built on this state by the app
    from controlplane.rollout_driver import FleetRolloutDriver

__all__ = ["AnswerKey", "AppState", "CorruptOrigin", "FleetMemos", "SigningKeys"]

#: what a node's desired answer depends on, per deployment: name, model, stable, previous stable,
#: canary, canary share, epoch, and whether the node is in the canary subset
AnswerKey = tuple[tuple[str, str, str | None, str | None, str | None, float, int, bool], ...]
#: a corrupt chunk a node reported: (blob sha256, source, chunk index)
CorruptOrigin = tuple[str, str | None, int | None]


@dataclass(frozen=True, slots=True)
class SigningKeys:
    """The key tickets are signed with now, and every published public key (key id -> key)."""

    kid: str
    private: Ed25519PrivateKey
    public: dict[str, str]
    read_at: float


@dataclass
class FleetMemos:
    """What this process remembers of the fleet to save work (``controlplane.fleet``)."""

    #: node id -> (hash of the report last written, when)
    reports_written: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: desired answers computed once and shared by every poll asking the same
    desired_answers: dict[AnswerKey, tuple[str, bytes]] = field(default_factory=dict)
    #: node name -> the corrupt origins already logged for it
    corrupt_origins_logged: dict[str, set[CorruptOrigin]] = field(default_factory=dict)


@dataclass
class AppState:
    """What every route reaches through ``controlplane.http.state_of(request)``."""

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    store: OriginStore
    #: the Prometheus registry ``/metrics`` exports
    metrics_registry: CollectorRegistry
    metrics: ControlPlaneMetrics
    changes: ChangeFeed
    snapshots: Snapshots
    tokens: TokenCache[Principal]
    #: the one writer of heartbeats, a batch per transaction (``controlplane.persistence.batch``)
    heartbeats: GroupCommit[HeartbeatWrite, bool]
    #: the clock publish sessions expire by (tests replace it)
    clock: Callable[[], datetime] = utcnow
    #: pointer changes this process announced
    pointer_generation: int = 0
    fleet: FleetMemos = field(default_factory=FleetMemos)
    #: the ticket signing keys this process read last (``controlplane.tickets``)
    ticket_keys: SigningKeys | None = None
    #: the fleet rollout driver, set by the application's lifespan (``controlplane.app``)
    rollouts: FleetRolloutDriver | None = None

    @classmethod
    def open(cls, settings: Settings, engine: Engine, store: OriginStore) -> AppState:
        """The state of an application on ``engine`` and ``store``; the caches listen to the change feed."""
        sessions = make_sessionmaker(engine)
        registry = CollectorRegistry()
        changes = ChangeFeed(engine)
        snapshots = Snapshots(sessions)
        tokens: TokenCache[Principal] = TokenCache()
        changes.subscribe(tokens.on_change)
        changes.subscribe(snapshots.on_change)
        return cls(
            settings=settings,
            engine=engine,
            sessions=sessions,
            store=store,
            metrics_registry=registry,
            metrics=create_metrics(registry, sessions, settings.node_stale_seconds),
            changes=changes,
            snapshots=snapshots,
            tokens=tokens,
            heartbeats=GroupCommit(engine, store_heartbeats, "storing heartbeats"),
        )
