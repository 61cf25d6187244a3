"""Shared, change-driven snapshots of what desired-state long-polls read: pointers and nodes.

A parked long-poll must cost nothing while nothing changes, and a change must cost one
database read per process, not one per node. So each process keeps:

- **deployment snapshots**: the pointer row of every deployment some node asked about, read once
  and re-read (one query for all of them) only when the change feed (``controlplane.notify``)
  announces ``deployments`` or ``resync``, or every ``RECHECK_SECONDS`` while polls are parked
  (the backstop for a notification lost in transit or a write that bypassed the API);
- **node identities**: a node's name and deployment list, read on its first desired-state read
  and again whenever it asks without ``after`` (an agent that just started or re-registered does;
  such a plain read re-reads its deployments too, so it always shows what is committed);
- **waiters**: for each deployment, the futures of the long-polls parked on it. A refresh that
  finds a deployment's pointer changed resolves exactly that deployment's futures; those polls
  recompute their desired state in memory and answer if their revision moved (a node outside a
  canary subset that did not move goes back to waiting). Polls on other deployments never wake.
  The futures are resolved a batch per event-loop turn (``controlplane.pacing``), so a change
  that wakes thousands of polls does not hold up the requests waiting behind it;
- **staging** (``controlplane.staging``): every preheat and warm pool, read on the first poll that
  needs it and re-read on ``staging`` (and, while a warm pool exists, ``deployments``), plus each
  node's labels and role (read with its identity). A refresh that changes the view wakes exactly
  the parked polls of nodes whose ``stage`` it changed.

Rows only move forward: a read that started before a change and lands after it (older epoch) is
dropped, and a first read overlapping any announced change is repeated, so a snapshot never
goes back to a pointer older than one it has seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from controlplane.notify import DEPLOYMENTS, RESYNC, STAGING
from controlplane.pacing import Waker
from controlplane.persistence.rows import DeploymentRow, NodeRow
from controlplane.staging import StagingView, read_view
from weightship.errors import NotFoundError
from weightship.logs import event
from weightship.schemas import StagedVersion

__all__ = [
    "MAX_DEPLOYMENTS",
    "MAX_NODES",
    "RECHECK_SECONDS",
    "NodeIdentity",
    "Snapshots",
    "unknown_node",
]

log = logging.getLogger(__name__)

#: while polls are parked, the snapshots re-read what they watch this often (lost notifications)
RECHECK_SECONDS = 5.0
#: beyond these sizes the caches drop what nobody waits on (node names come from agents)
MAX_DEPLOYMENTS = 10_000
MAX_NODES = 200_000

#: a node's name and the deployments it serves, in its registration's order
NodeIdentity = tuple[str, tuple[str, ...]]
#: a node's labels and role: what staging selectors look at
Placement = tuple[dict[str, str], str]


def _pointer(row: DeploymentRow | None) -> tuple[Any, ...] | None:
    if row is None:
        return None
    return (row.model, row.stable, row.previous_stable, row.canary, row.canary_share, row.epoch)


def _read_deployments(sessions: sessionmaker[Session], names: Sequence[str]) -> dict[str, DeploymentRow]:
    with sessions() as session:
        rows = session.scalars(select(DeploymentRow).where(DeploymentRow.name.in_(names)))
        return {row.name: row for row in rows}


def unknown_node(node_id: str) -> NotFoundError:
    """The error for a node id that is not registered."""
    return NotFoundError(
        f"node {node_id!r} is not registered; register again with POST /v1/nodes/register",
        code="node_not_registered",
        fields={"node_id": node_id},
    )


def _read_node(sessions: sessionmaker[Session], node_id: str) -> tuple[NodeIdentity, Placement]:
    with sessions() as session:
        row = session.get(NodeRow, node_id)
        if row is None:
            raise unknown_node(node_id)
        return (row.name, tuple(row.deployments)), (dict(row.labels or {}), row.role)


class Snapshots:
    """This process's snapshots of deployment pointers and node identities, and who waits on them."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        #: None: asked about, but no such deployment (yet)
        self._rows: dict[str, DeploymentRow | None] = {}
        self._nodes: dict[str, NodeIdentity] = {}
        self._placements: dict[str, Placement] = {}
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        #: node id -> its parked polls, woken when a staging change moves that node's ``stage``
        self._node_waiters: dict[str, set[asyncio.Future[None]]] = {}
        #: None until a poll needs it
        self._staging: StagingView | None = None
        self._staging_dirty = False
        #: bumped by every announced change, so a first read overlapping one is repeated
        self._generation = 0
        self._dirty = False
        self._refreshing: asyncio.Task[None] | None = None
        #: set by ``drain``: the process is stopping and polls answer at once instead of parking
        self.draining = False
        #: resolves the futures of woken polls, a batch per event-loop turn (``controlplane.pacing``)
        self.waker = Waker()

    # --- what the desired-state route uses ----------------------------------------------------

    async def node(self, node_id: str, *, fresh: bool) -> NodeIdentity:
        """Name and deployments of node ``node_id``; ``fresh`` reads the database, else the snapshot if any."""
        found = None if fresh else self._nodes.get(node_id)
        if found is not None and node_id in self._placements:
            return found
        identity, placement = await run_in_threadpool(_read_node, self._sessions, node_id)
        if len(self._nodes) >= MAX_NODES:
            self._nodes.clear()
            self._placements.clear()
        self._nodes[node_id] = identity
        self._placements[node_id] = placement
        return identity

    async def ensure_staging(self, *, fresh: bool = False) -> None:
        """Make sure the staging view is held: read once per process (and on ``fresh``); the change feed keeps it current."""
        while fresh or self._staging is None:
            generation = self._generation
            view = await run_in_threadpool(read_view, self._sessions)
            if generation == self._generation:
                # read after every change announced so far: no re-read is owed any more
                self._staging_dirty = False
                self._store_staging(view)
                return
            # A change was announced while we read: the view may predate it; read again.

    def stage(self, node_id: str) -> tuple[StagedVersion, ...]:
        """What node ``node_id`` (asked about with ``node`` first) must stage, per the view held (after ``ensure_staging``)."""
        return () if self._staging is None else self._stage_of(self._staging, node_id)

    def _stage_of(self, view: StagingView, node_id: str) -> tuple[StagedVersion, ...]:
        placement = self._placements.get(node_id)
        return () if placement is None else view.stage_for(*placement)

    async def ensure(self, names: Iterable[str], *, fresh: bool = False) -> None:
        """Make sure the snapshot holds ``names`` (one read for all that are missing, or for all when ``fresh``)."""
        missing = [n for n in dict.fromkeys(names) if fresh or n not in self._rows]
        while missing:
            generation = self._generation
            rows = await run_in_threadpool(_read_deployments, self._sessions, missing)
            self._trim()
            for name in missing:
                self._store(name, rows.get(name))
            if generation == self._generation:
                return
            # A change was announced while we read: the rows may predate it; read them again.

    def rows(self, names: Iterable[str]) -> list[DeploymentRow]:
        """The snapshot's rows of those of ``names`` that exist."""
        return [row for row in (self._rows.get(n) for n in names) if row is not None]

    def watch(self, names: Iterable[str], node_id: str | None = None) -> asyncio.Future[None]:
        """A future resolved when the pointer of any of ``names`` (or ``node_id``'s stage) changes; ``unwatch`` it."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for name in names:
            self._waiters.setdefault(name, set()).add(future)
        if node_id is not None:
            self._node_waiters.setdefault(node_id, set()).add(future)
        return future

    def unwatch(self, names: Iterable[str], future: asyncio.Future[None], node_id: str | None = None) -> None:
        """Stop ``future`` waiting on ``names`` (and ``node_id``'s stage)."""
        if node_id is not None:
            by_node = self._node_waiters.get(node_id)
            if by_node is not None:
                by_node.discard(future)
                if not by_node:
                    del self._node_waiters[node_id]
        for name in names:
            waiting = self._waiters.get(name)
            if waiting is not None:
                waiting.discard(future)
                if not waiting:
                    del self._waiters[name]

    def drain(self) -> None:
        """The process is stopping: wake every parked poll (each answers what it has) and park no more.

        The server waits for open requests before it exits, and a parked poll would hold it up for
        the rest of its wait; answered now, its agent asks again and reaches another replica.
        """
        self.draining = True
        for waiting in (*self._waiters.values(), *self._node_waiters.values()):
            for future in waiting:
                if not future.done():
                    future.set_result(None)

    def parked(self) -> int:
        """How many (deployment, poll) waits are registered right now."""
        return sum(len(w) for w in self._waiters.values())

    # --- change handling -------------------------------------------------------------------------

    def on_change(self, topic: str) -> None:
        """Change-feed listener: pointers changed (or may have): re-read them, once per burst."""
        if topic == RESYNC:
            self._nodes.clear()
            self._staging_dirty = True
        elif topic == STAGING or (topic == DEPLOYMENTS and self._staging is not None and self._staging.pools):
            # a warm pool follows its deployment's pointer, so a pointer move may move the view too
            self._staging_dirty = True
        elif topic != DEPLOYMENTS:
            return
        self._generation += 1
        self.request_refresh()

    def request_refresh(self) -> None:
        """Re-read every snapshotted deployment soon; requests during a read cause one more read."""
        self._dirty = True
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_while_dirty())

    async def refresh(self) -> None:
        """Re-read every snapshotted deployment now, in one query, and wake the polls of those that moved."""
        names = list(self._rows)
        if names:
            rows = await run_in_threadpool(_read_deployments, self._sessions, names)
            for name in names:
                if name in self._rows:
                    self._store(name, rows.get(name))
        if self._staging_dirty and self._staging is not None:
            self._staging_dirty = False
            self._store_staging(await run_in_threadpool(read_view, self._sessions))

    def recheck(self) -> None:
        """Re-read what parked polls watch, if any are parked (call every ``RECHECK_SECONDS``)."""
        if self._waiters or self._node_waiters:
            self._staging_dirty = True
            self.request_refresh()

    def _store_staging(self, view: StagingView) -> None:
        old, self._staging = self._staging, view
        if old is None or old == view:
            return
        for node_id in list(self._node_waiters):
            if self._stage_of(old, node_id) != self._stage_of(view, node_id):
                self.waker.wake(self._node_waiters.pop(node_id, ()))

    async def _refresh_while_dirty(self) -> None:
        while self._dirty:
            self._dirty = False
            try:
                await self.refresh()
            except Exception as exc:  # why: polls keep their snapshot; the recheck retries
                event(log, "snapshot.refresh_failed", logging.WARNING, error=exc)
                return

    def _store(self, name: str, row: DeploymentRow | None) -> None:
        old = self._rows.get(name)
        if old is not None and (row is None or row.epoch < old.epoch):
            return  # read before a newer row we already hold; deployments are never deleted
        self._rows[name] = row
        if _pointer(old) != _pointer(row):
            self.waker.wake(self._waiters.pop(name, ()))

    def _trim(self) -> None:
        if len(self._rows) >= MAX_DEPLOYMENTS:
            self._rows = {n: r for n, r in self._rows.items() if n in self._waiters}
