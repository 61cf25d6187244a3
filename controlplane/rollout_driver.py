"""The fleet rollout driver: observe the fleet, run the engine, move the pointer, store the status.

One driver runs as a background task in every control-plane process (``controlplane.app``); each
tick it looks at the active rollouts and drives those whose **lease** it holds or can take. The
engine (``controlplane.rollouts.engine``) decides; this driver only translates, like the
Kubernetes driver (``controlplane.k8s.driver``) does for ReplicaSets.

**Lease.** A rollout row carries ``lease_holder`` and ``lease_expires_at``. A process takes or
renews it with one compare-and-swap ``UPDATE ... WHERE lease_holder IS NULL OR lease_holder = me OR
lease_expires_at < now``; only one process wins per rollout, and the lease lapses
``rollout_lease_seconds`` after its holder stops renewing it (killed, partitioned, stalled).
The lease is renewed at the start of each reconcile and again right before any pointer write.

**Fencing.** A lease alone cannot stop a holder that stalled past its expiry and then wakes up.
Every pointer write therefore goes through the deployment's compare-and-swap on the epoch the
engine observed (``controlplane.deployments.change_pointer``): if another driver (or an operator)
moved the pointer meanwhile, the write is refused (412) and this driver drops the reconcile
without storing anything. Status writes are fenced as well: ``WHERE row_version = :read AND
lease_holder = me``, so a deposed driver cannot overwrite its successor's status, and a verb
applied meanwhile is never lost (the driver reconciles again from what the verb wrote).

**Observations** come from the fleet's heartbeats (``controlplane.fleet.node_infos``): the target
nodes are the registered, not stale ``node``-role nodes serving the deployment; ``staged_nodes``
hold the canary ``ready`` (verified from bytes they hashed); ``canary_assigned`` are the target
nodes in the pointer's hashed canary subset and ``canary_serving`` those of them whose agent serves
the canary and whose model servers loaded it (validation passed; a node whose model servers report
nothing counts once its agent switched); ``canary_refused`` those whose model servers refused it
(every load failed or failed validation), which aborts the rollout; ``stage_failures`` are the nodes whose fetch of the canary reports a problem
(``node-3: disk_full: ...``). ``version_bytes`` is the version's size, and the fetch rate is the
median per-node download rate this driver measured between heartbeats.

**Actions.** ``SetPointer`` → ``change_pointer`` with actor ``rollout:<id>`` and a reason naming
the rollout, step and why; every move lands in the pointer history. ``StageVersion`` needs no
write of its own: the engine's pointer already names the canary (share 0 during prefetch), and a
pointer's canary is in every node's ``keep`` (``controlplane.fleet.desired_deployment``), so every
target node fetches and verifies it without serving it. An abort moves the pointer back to stable
at a new epoch; the canary nodes switch to the stable version already on their disk.
``MeasureMetric`` → the analysis providers (``controlplane.rollouts.providers``); the engine runs
again with the answers in the same reconcile.

A rollout stops being active (and its lease is released) once it is complete, or aborted with the
pointer back on stable.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import socket
import statistics
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import ColumnElement, or_, select, update
from sqlalchemy.engine import CursorResult

from controlplane.deployments import Pointer, change_pointer, notify_pointer_changed, pointer_action
from controlplane.fleet import canary_share_for, in_canary, node_infos
from controlplane.notify import RESYNC
from controlplane.persistence.rows import DeploymentRow, RolloutRow, VersionRow, utcnow
from controlplane.rollout_resources import ROLLOUTS
from controlplane.rollouts.actions import MeasureMetric, SetPointer
from controlplane.rollouts.engine import Reconciliation, reconcile
from controlplane.rollouts.observations import FleetObservation, MeasurementResult, Observations, PointerObservation
from controlplane.rollouts.providers import ProviderRegistry, RolloutContext
from controlplane.rollouts.spec import RolloutSpec, RolloutSpecError, SetWeightStep, parse_spec
from controlplane.rollouts.status import RolloutStatus, StatusError
from controlplane.rollouts.steps import SHARE_TOLERANCE, weight_at
from controlplane.state import AppState
from weightship.errors import PreconditionFailed, WeightshipError
from weightship.logs import event
from weightship.schemas import NodeInfo, VersionServeMetrics, VersionState

__all__ = ["FleetRolloutDriver", "Outcome", "default_holder"]

log = logging.getLogger(__name__)

#: a node's download counter older than this is not used to measure the fetch rate
_RATE_WINDOW = timedelta(minutes=10)


def default_holder() -> str:
    """This process's lease holder name: host, pid and a random suffix (a restarted pid is another holder)."""
    return f"{socket.gethostname()[:80]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Outcome:
    """What one ``drive`` did (for logs and tests)."""

    DRIVEN = "driven"
    LEASED_ELSEWHERE = "leased-elsewhere"
    DEPOSED = "deposed"
    CONFLICT = "conflict"
    INACTIVE = "inactive"
    BROKEN = "broken"


@dataclass(frozen=True)
class Snapshot:
    """One rollout as read for a reconcile: its row, the deployment's pointer, the fleet."""

    rollout_id: str
    deployment: str
    model: str
    spec: RolloutSpec
    status: RolloutStatus | None
    row_version: int
    pointer: Pointer
    epoch: int
    fleet: FleetObservation
    nodes: dict[str, int]
    version_bytes: int
    targets: tuple[str, ...] = ()
    #: the attempt, and each node's count of failed loads of the canary when that attempt began
    failures_before: tuple[int, dict[str, int]] = (1, {})

    def share_for(self, weight: float) -> float:
        """The pointer share written for a step's ``weight``: rounded up to whole nodes (see ``canary_share_for``)."""
        return canary_share_for(self.deployment, self.targets, weight)

    def engine_share(self, pointer: Pointer | None = None) -> float:
        """A pointer's share as the engine knows it: the step weight that a rounded-up share was written for."""
        pointer = pointer or self.pointer
        share = pointer.canary_share
        if pointer.canary != self.spec.version or share <= 0:
            return share
        weights = [s.weight / 100 for s in self.spec.steps if isinstance(s, SetWeightStep)]
        if self.status is not None:
            weights.insert(0, weight_at(self.spec, min(self.status.step_index, len(self.spec.steps) - 1)) / 100)
        for weight in weights:
            if weight > 0 and abs(self.share_for(weight) - share) <= SHARE_TOLERANCE:
                return weight
        return share

    def observations(self, rate: float | None, measurements: tuple[MeasurementResult, ...]) -> Observations:
        """What the engine is told."""
        pointer = PointerObservation(self.pointer.stable, self.pointer.canary, self.engine_share(), self.epoch)
        return Observations(pointer, self.fleet, self.version_bytes, rate, measurements)


@dataclass
class _RateMeter:
    """Per-node download rate between heartbeats, as this process saw the counters move."""

    last: dict[str, tuple[int, datetime]] = field(default_factory=dict)
    rates: dict[str, tuple[float, datetime]] = field(default_factory=dict)

    def see(self, node: str, downloaded: int, at: datetime | None) -> None:
        if at is None:
            return
        before = self.last.get(node)
        self.last[node] = (downloaded, at)
        if before is not None and downloaded > before[0] and at > before[1]:
            self.rates[node] = ((downloaded - before[0]) / (at - before[1]).total_seconds(), at)

    def rate(self, now: datetime) -> float | None:
        recent = [rate for rate, at in self.rates.values() if now - at <= _RATE_WINDOW]
        return statistics.median(recent) if recent else None


class FleetRolloutDriver:
    """Drives the active rollouts whose lease this process holds; see the module docstring."""

    def __init__(
        self,
        state: AppState,
        providers: ProviderRegistry,
        *,
        holder: str | None = None,
        clock: Callable[[], datetime] = utcnow,
        lease_clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.state = state
        self.providers = providers
        self.holder = holder or default_holder()
        #: the engine's ``now`` (tests inject a fake one); the lease runs on ``lease_clock``
        self.clock = clock
        self.lease_clock = lease_clock
        self.loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._rates = _RateMeter()

    def check_spec(self, spec: RolloutSpec) -> None:
        """Refuse a spec whose metrics this control plane cannot measure (raises ``RolloutSpecError``)."""
        self.providers.check_spec(spec)

    def wake(self) -> None:
        """Reconcile soon (from any thread)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._wake.set)

    def on_change(self, topic: str) -> None:
        """Change-feed listener: a rollout was created or acted on (in any process), or feeds resynced."""
        if topic in (ROLLOUTS, RESYNC):
            self._wake.set()

    async def run_forever(self, tick_seconds: float) -> None:
        """Tick every ``tick_seconds`` while it drives something, else every lease period; at once when woken.

        An idle process (no active rollout, or all leased by others) looks again after a lease
        period, so it takes over a dead holder's rollout within about two lease periods, and it
        is woken at once by the change feed when a rollout is created or acted on anywhere.
        """
        self.loop = asyncio.get_running_loop()
        self.state.changes.subscribe(self.on_change)
        idle_seconds = max(tick_seconds, self.state.settings.rollout_lease_seconds)
        event(log, "rollout.driver_started", holder=self.holder, tick_seconds=tick_seconds, idle_seconds=idle_seconds)
        while True:
            busy = False
            try:
                outcomes = await self.tick()
                busy = any(outcome != Outcome.LEASED_ELSEWHERE for outcome in outcomes.values())
            except WeightshipError as exc:  # a database outage: the next tick tries again
                event(log, "rollout.tick_failed", logging.WARNING, holder=self.holder, error=exc.message)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick_seconds if busy else idle_seconds)

    async def tick(self) -> dict[str, str]:
        """Drive every active rollout once; returns rollout id -> :class:`Outcome`."""
        ids = await asyncio.to_thread(self._active_ids)
        return {rollout_id: await self.drive(rollout_id) for rollout_id in ids}

    def _active_ids(self) -> list[str]:
        with self.state.sessions() as session:
            query = select(RolloutRow.id).where(RolloutRow.active_deployment.is_not(None))
            return list(session.scalars(query.order_by(RolloutRow.created_at)))

    # --- lease -----------------------------------------------------------------------------------

    def take_lease(self, rollout_id: str) -> bool:
        """Take or renew the lease of ``rollout_id``; False when another live holder has it."""
        now = self.lease_clock()
        until = now + timedelta(seconds=self.state.settings.rollout_lease_seconds)
        lease_free = or_(
            RolloutRow.lease_holder.is_(None),
            RolloutRow.lease_holder == self.holder,
            RolloutRow.lease_expires_at < now,
        )
        where = (RolloutRow.id == rollout_id, RolloutRow.active_deployment.is_not(None), lease_free)
        return self._update_one(where, {"lease_holder": self.holder, "lease_expires_at": until})

    def _update_one(self, where: tuple[ColumnElement[bool], ...], values: dict[str, Any]) -> bool:
        """One compare-and-swap ``UPDATE rollouts``: whether it changed the row."""
        with self.state.sessions() as session, session.begin():
            result = cast(
                "CursorResult[Any]",
                session.execute(
                    update(RolloutRow).where(*where).values(**values).execution_options(synchronize_session=False)
                ),
            )
            return result.rowcount == 1

    # --- one reconcile ---------------------------------------------------------------------------

    async def drive(self, rollout_id: str) -> str:
        """Lease, observe, reconcile, act and store one rollout; returns an :class:`Outcome`."""
        if not await asyncio.to_thread(self.take_lease, rollout_id):
            return Outcome.LEASED_ELSEWHERE
        try:
            snapshot = await asyncio.to_thread(self.observe, rollout_id)
        except (RolloutSpecError, StatusError) as exc:
            event(log, "rollout.unreadable", logging.ERROR, rollout=rollout_id, error=exc.message)
            return Outcome.BROKEN
        if snapshot is None:
            return Outcome.INACTIVE
        result = await self.decide(snapshot)
        outcome, epoch, pointer = await self.act(snapshot, result)
        if outcome != Outcome.DRIVEN:
            return outcome
        return await asyncio.to_thread(self.store, snapshot, result, pointer, epoch)

    def observe(self, rollout_id: str) -> Snapshot | None:
        """Read the rollout, its deployment's pointer and the fleet (blocking)."""
        with self.state.sessions() as session:
            row = session.get(RolloutRow, rollout_id)
            if row is None or row.active_deployment is None:
                return None
            deployment = session.get(DeploymentRow, row.deployment)
            assert deployment is not None  # rollouts reference their deployment
            version = session.get(VersionRow, row.version)
            spec = parse_spec(row.spec)
            status = RolloutStatus.from_dict(row.status) if row.status is not None else None
            pointer, epoch = Pointer.of(deployment), deployment.epoch
            name, model, row_version = row.deployment, deployment.model, row.row_version
            size = version.size if version is not None else 0
            stored = (row.fleet or {}).get("canary_failures")
        nodes = [n for n in node_infos(self.state, name) if n.role == "node" and not n.stale]
        for node in nodes:
            self._rates.see(node.name, node.counters.bytes_downloaded, node.last_seen)
        attempt = status.attempt if status is not None else 1
        if isinstance(stored, dict) and stored.get("attempt") == attempt and isinstance(stored.get("nodes"), dict):
            before = {str(k): int(v) for k, v in stored["nodes"].items()}
        else:  # the attempt starts now: failures counted so far are an earlier attempt's
            before = {node.name: _failures(node, name, spec.version) for node in nodes}
        fleet, serving = _fleet(name, spec.version, pointer, nodes, before)
        targets = tuple(node.name for node in nodes)
        return Snapshot(
            rollout_id, name, model, spec, status, row_version, pointer, epoch, fleet, serving, size, targets,
            (attempt, before),
        )  # fmt: skip

    async def decide(self, snapshot: Snapshot) -> Reconciliation:
        """Run the engine; take the measurements it asks for and run it again with the answers."""
        now = self.clock()
        rate = self._rates.rate(utcnow())
        measurements: tuple[MeasurementResult, ...] = ()
        result = reconcile(snapshot.spec, snapshot.status, snapshot.observations(rate, measurements), now)
        for _ in range(3):
            wanted = [a for a in result.actions if isinstance(a, MeasureMetric)]
            if not wanted:
                break
            context = RolloutContext(
                snapshot.rollout_id, snapshot.deployment, snapshot.spec.version, result.status.stable
            )
            measurements += tuple([await self.providers.measure(a, context) for a in wanted])
            result = reconcile(snapshot.spec, snapshot.status, snapshot.observations(rate, measurements), now)
        return result

    async def act(self, snapshot: Snapshot, result: Reconciliation) -> tuple[str, int, Pointer]:
        """Carry out the pointer writes; (outcome, epoch, pointer) after them."""
        pointer, epoch = snapshot.pointer, snapshot.epoch
        for action in result.actions:
            if not isinstance(action, SetPointer):
                continue  # StageVersion: the pointer's canary is in every node's keep already
            if not await asyncio.to_thread(self.take_lease, snapshot.rollout_id):
                event(log, "rollout.deposed", logging.WARNING, rollout=snapshot.rollout_id, holder=self.holder)
                return Outcome.DEPOSED, epoch, pointer
            share = snapshot.share_for(action.canary_share) if action.canary is not None else 0.0
            after = Pointer(
                stable=action.stable,
                previous_stable=pointer.stable if action.stable != pointer.stable else pointer.previous_stable,
                canary=action.canary,
                canary_share=share,
            )
            if share != action.canary_share and action.canary is not None:
                chosen = sum(in_canary(snapshot.deployment, n, share) for n in snapshot.targets)
                action = replace(
                    action,
                    reason=f"{action.reason} (rounded up to {chosen} of {len(snapshot.targets)} nodes: share {share:g})",
                )
            try:
                await asyncio.to_thread(
                    change_pointer,
                    self.state,
                    snapshot.deployment,
                    action.expected_epoch,
                    pointer,
                    after,
                    model=snapshot.model,
                    action=pointer_action(pointer, after),
                    actor=f"rollout:{snapshot.rollout_id}",
                    reason=f"rollout {snapshot.rollout_id}: {action.reason.removeprefix('rollout ')}",
                )
            except PreconditionFailed as exc:
                # Fenced: someone (a newer lease holder, an operator) moved the pointer since we read it.
                event(
                    log,
                    "rollout.fenced",
                    logging.WARNING,
                    rollout=snapshot.rollout_id,
                    holder=self.holder,
                    expected_epoch=action.expected_epoch,
                    error=exc.message,
                )
                return Outcome.DEPOSED, epoch, pointer
            await notify_pointer_changed(self.state)
            pointer, epoch = after, action.expected_epoch + 1
            event(
                log,
                "rollout.pointer_moved",
                rollout=snapshot.rollout_id,
                deployment=snapshot.deployment,
                epoch=epoch,
                stable=after.stable,
                canary=after.canary,
                share=after.canary_share,
                reason=action.reason,
            )
        return Outcome.DRIVEN, epoch, pointer

    def store(self, snapshot: Snapshot, result: Reconciliation, pointer: Pointer, epoch: int) -> str:
        """Write the status and fleet view (fenced by ``row_version`` and the lease)."""
        status = result.status
        moved = epoch != snapshot.epoch
        rolled_back = status.abort and not moved and not any(isinstance(a, SetPointer) for a in result.actions)
        done = status.completed or rolled_back
        weight = snapshot.engine_share(pointer) * 100 if pointer.canary == snapshot.spec.version else 0.0
        fleet = {
            "weight": round(weight, 4),
            "canary_share": pointer.canary_share if pointer.canary == snapshot.spec.version else 0.0,
            "nodes": snapshot.nodes,
            "staged_nodes": snapshot.fleet.staged_nodes,
            "target_nodes": snapshot.fleet.target_nodes,
            "epoch": epoch,
            "canary_failures": {"attempt": snapshot.failures_before[0], "nodes": snapshot.failures_before[1]},
        }
        values: dict[str, Any] = {
            "status": status.to_dict(),
            "fleet": fleet,
            "row_version": snapshot.row_version + 1,
            "updated_at": utcnow(),
        }
        if done:
            values.update(active_deployment=None, lease_holder=None, lease_expires_at=None)
        where = (
            RolloutRow.id == snapshot.rollout_id,
            RolloutRow.row_version == snapshot.row_version,
            RolloutRow.lease_holder == self.holder,
        )
        if not self._update_one(where, values):
            event(log, "rollout.status_conflict", rollout=snapshot.rollout_id, holder=self.holder)
            return Outcome.CONFLICT
        before = snapshot.status
        if before is None or before.phase != status.phase or before.step_index != status.step_index or done:
            event(
                log,
                "rollout.progress",
                rollout=snapshot.rollout_id,
                deployment=snapshot.deployment,
                phase=str(status.phase),
                step=status.step_index,
                done=done,
                message=status.message,
            )
        return Outcome.DRIVEN


def _fleet(
    deployment: str, version: str, pointer: Pointer, nodes: list[NodeInfo], failures_before: dict[str, int]
) -> tuple[FleetObservation, dict[str, int]]:
    """The engine's view of the target ``nodes``, and how many serve each digest."""
    staged = assigned = serving_canary = 0
    failures: list[str] = []
    refused: list[str] = []
    serving: dict[str, int] = {}
    canary_on = pointer.canary == version
    for node in nodes:
        held = next((item for item in node.inventory if item.digest == version), None)
        if held is not None and held.state == VersionState.ready:
            staged += 1
        elif held is not None and held.problem is not None:
            failures.append(f"{node.name}: {held.problem.reason}: {held.problem.message}")
        elif held is not None and held.state == VersionState.failed:
            failures.append(f"{node.name}: {held.error or 'fetch failed'}")
        state = next((d for d in node.serving if d.name == deployment), None)
        served = state.digest if state is not None else None
        if served is not None:
            serving[served] = serving.get(served, 0) + 1
        if canary_on and in_canary(deployment, node.name, pointer.canary_share):
            assigned += 1
            if served == version and state is not None:
                hooked = state.hook is None or (state.hook.ok and state.hook.digest == version)
                loaded = (
                    _model_servers(node, deployment, version, failures_before.get(node.name, 0))
                    if hooked
                    else _Loaded.NOT_YET  # the agent switched, but its external server has not been told yet
                )
                if loaded is _Loaded.REFUSED:
                    refused.append(f"{node.name}: its model server refused the version (failed load or validation)")
                serving_canary += loaded in (_Loaded.YES, _Loaded.NO_SERVERS)
    fleet = FleetObservation(len(nodes), staged, assigned, serving_canary, tuple(failures), tuple(refused))
    return fleet, serving


class _Loaded(enum.Enum):
    YES = "yes"
    NOT_YET = "not-yet"
    REFUSED = "refused"
    NO_SERVERS = "no-servers"


def _serve_counters(node: NodeInfo, deployment: str, version: str) -> tuple[bool, VersionServeMetrics | None]:
    """Whether any model server on the node reports the deployment, and its counters for ``version``."""
    reports = [v for v in (node.serve.versions if node.serve else []) if v.deployment == deployment]
    return bool(reports), next((v for v in reports if v.digest == version), None)


def _failures(node: NodeInfo, deployment: str, version: str) -> int:
    """Failed loads (load error or failed validation) of ``version`` the node's model servers reported."""
    mine = _serve_counters(node, deployment, version)[1]
    return mine.validations_failed + mine.load_failures if mine is not None else 0


def _model_servers(node: NodeInfo, deployment: str, version: str, failures_before: int) -> _Loaded:
    """Whether the node's model servers loaded ``version``, from the counters its heartbeat carries.

    A node whose model servers report nothing for the deployment (none runs, or an external server
    that does not report) counts once its agent switched. Otherwise a load that passed validation
    counts, as do requests answered with the version (a server that reports no validations). A
    version that failed to load (load error, golden check, NaN scan) more often than when this
    attempt of the rollout began, and never loaded, is refused: a refusal from an earlier attempt
    does not end a retry before its servers try again. Counters that went down (the agent
    restarted) count whole.
    """
    reporting, mine = _serve_counters(node, deployment, version)
    if not reporting:
        return _Loaded.NO_SERVERS
    if mine is None:
        return _Loaded.NOT_YET
    if mine.validations_passed > 0 or mine.requests > 0:  # validated, or answering requests with it
        return _Loaded.YES
    failures = mine.validations_failed + mine.load_failures
    if failures > failures_before or (failures > 0 and failures < failures_before):
        return _Loaded.REFUSED
    return _Loaded.NOT_YET
