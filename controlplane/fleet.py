"""The fleet: node registry, heartbeats, desired state per node (with long-poll), deployment status.

**Enrolment and registration.** A new agent enrols with an enrolment token
(``POST /v1/nodes/enrol``): the node is created (or, when its name is known but no node token of it
is active, taken over: same id) and a node token bound to it is returned, once. A name whose node
token is active is refused (409): no enrolment token can hijack an enrolled node; an admin
revoking that node token is what frees the name (a replaced machine). Enrolment fixes what the
control plane trusts about the node: its *assigned* deployments (the enrolment token's scope;
``None``: all), its role (``cache`` only from a token minted for caches: 403 otherwise) and its
labels. Afterwards the node re-registers (``POST /v1/nodes/register``, same id; the deployments
it wants to follow and its address replaced, its role and labels kept: another role is 403),
heartbeats and reads its desired state with its node token only; for any other node that token
gets 403 (``controlplane.auth``). An admin registering is trusted: role and labels replaced. A
peer address that is link-local or a metadata service is refused (``weightship.addresses``). Enrolments of one name are serialised by a write to the node's row made
before the active-token check, so concurrent enrolments yield one token and 409s.

**Heartbeats** store the agent's whole report (inventory, what it serves, counters, health) and
``last_seen``, in one statement; a report equal to the last one written only moves ``last_seen``.
Heartbeats arriving together share one transaction (``controlplane.persistence.batch``: group
commit); each is answered once the transaction holding it committed. A node is *stale* when it has not been heard from for ``node_stale_seconds``.

**Desired state.** For each deployment a node serves (that exists), the node should serve the
pointer's ``stable`` digest, or its ``canary`` digest when the node is in the canary subset. The
subset is a stable hashed one: a node is a canary of deployment *d* when

    bucket(d, node) = first 64 bits of sha256("<d>/<node name>") / 2**64   (uniform in [0, 1))
    bucket(d, node) < canary_share

so membership depends only on the two names and the share: growing the share only adds nodes
(those already in stay in), nodes joining or leaving never move anyone else, and every replica of
the control plane computes the same answer without coordination. The subset's size follows the
share statistically (binomial: about ``share x nodes``, exact only on average), which is the
price of needing no fleet-wide view; ``GET /v1/deployments/{name}/status`` reports the real
count (``nodes_desired`` of the canary). Each node also gets ``keep``: stable, previous stable
and canary, the versions it must hold on disk (so a rollback downloads nothing).

**Revision.** ``revision`` is a hash of the desired content, so it changes exactly when something
the node must act on changes. ``GET /v1/nodes/{id}/desired?after=REV&wait=S`` answers at once when
the revision differs from ``after``; otherwise it parks on the process's shared snapshot of the
node's deployments (``controlplane.snapshot``), which every pointer change, made through any
replica, refreshes with one read per process (``controlplane.notify``); it wakes only the polls
on the deployments that moved, and answers those whose revision moved. A parked poll issues no
query. Changes that arrive without a notification are seen within ``RECHECK_SECONDS``. When
``wait`` runs out it answers with the unchanged state.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import exc, select
from sqlalchemy.orm import Session

from controlplane.deployments import to_schema
from controlplane.persistence.heartbeats import HeartbeatWrite
from controlplane.persistence.rows import DeploymentRow, NodeRow, TokenRow, VersionRow, utcnow
from controlplane.snapshot import MAX_NODES, RECHECK_SECONDS, unknown_node
from controlplane.staging import check_selector
from controlplane.state import AppState
from controlplane.tokens import active_node_token, mint_node_token
from weightship.addresses import check_peer_address
from weightship.digests import sha256_hex
from weightship.errors import ConflictError, ForbiddenError, NotFoundError, ValidationError
from weightship.logs import event
from weightship.schemas import (
    DeploymentAssignment,
    DeploymentStatus,
    DesiredDeployment,
    DesiredState,
    FetchFailure,
    NodeEnrolment,
    NodeEnrolRequest,
    NodeHeartbeat,
    NodeInfo,
    NodeLabels,
    NodeProblem,
    NodeRegistration,
    SourceTally,
    VersionState,
    VersionStatus,
)

__all__ = [
    "RECHECK_SECONDS",
    "assign_deployment",
    "assign_node",
    "canary_bucket",
    "canary_share_for",
    "desired_answer",
    "desired_deployment",
    "desired_state",
    "in_canary",
    "node_infos",
    "record_heartbeat",
    "register_node",
    "status_of",
]

log = logging.getLogger(__name__)


_NODE_ROLES = ("node", "cache")
#: a report equal to the one this process last wrote for a node is still rewritten this often
REPORT_REWRITE_SECONDS = 60.0
#: distinct desired-state answers kept for sharing (``desired_answer``)
_MAX_ANSWERS = 10_000


# --- desired state (pure) ------------------------------------------------------------------------


def canary_bucket(deployment: str, node: str) -> float:
    """Where ``node`` falls in [0, 1) for ``deployment``; fixed for the pair, uniform across nodes."""
    return int(sha256_hex(f"{deployment}/{node}".encode())[:16], 16) / 2**64


def in_canary(deployment: str, node: str, share: float) -> bool:
    """Whether ``node`` is in the canary subset of ``deployment`` at ``share``."""
    return share > 0 and canary_bucket(deployment, node) < share


def canary_share_for(deployment: str, nodes: Iterable[str], weight: float) -> float:
    """The pointer share that puts at least ``ceil(weight × len(nodes))`` of ``nodes`` in the canary.

    ``weight`` is what a rollout step asks for (0.1 for ``setWeight: 10``). The subset stays the
    hashed one (``bucket < share``): when fewer than the rounded-up count fall under ``weight``,
    the share is raised just past the bucket of the node that completes the count (to 4 decimal
    places), so a small fleet never gets a canary step that moves no node, and a larger weight
    never selects fewer nodes than a smaller one did.
    """
    names = sorted(set(nodes))
    if weight <= 0 or not names:
        return weight
    wanted = min(len(names), math.ceil(round(weight * len(names), 9)))
    completing = sorted(canary_bucket(deployment, name) for name in names)[wanted - 1]
    if completing < weight:
        return weight
    return min(1.0, (math.floor(completing * 10_000) + 1) / 10_000)


def desired_deployment(row: DeploymentRow, node: str) -> DesiredDeployment:
    """What ``row``'s pointer asks of the node called ``node``."""
    canary = row.canary is not None and in_canary(row.name, node, row.canary_share)
    keep = list(dict.fromkeys(d for d in (row.stable, row.previous_stable, row.canary) if d is not None))
    return DesiredDeployment(
        name=row.name,
        model=row.model,
        digest=row.canary if canary else row.stable,
        epoch=row.epoch,
        role="canary" if canary else "stable",
        keep=keep,
    )


def desired_state(node_id: str, node: str, deployments: Iterable[DeploymentRow]) -> DesiredState:
    """The whole desired state of a node, with the revision that names its content."""
    wanted = [desired_deployment(row, node) for row in sorted(deployments, key=lambda r: r.name)]
    content = json.dumps([d.model_dump(mode="json") for d in wanted], sort_keys=True, separators=(",", ":"))
    return DesiredState(node_id=node_id, revision=sha256_hex(content.encode())[:32], deployments=wanted)


# --- database reads ------------------------------------------------------------------------------


def _report(row: NodeRow) -> NodeHeartbeat:
    try:
        return NodeHeartbeat.model_validate(row.report or {})
    except ValueError:
        # A report stored by an older agent that no longer parses: show the node, not its report.
        event(log, "node.report_unreadable", logging.WARNING, node=row.name)
        return NodeHeartbeat()


def _is_stale(row: NodeRow, now: datetime, stale_seconds: float) -> bool:
    return row.last_seen is None or now - row.last_seen > timedelta(seconds=stale_seconds)


def _node_info(row: NodeRow, now: datetime, stale_seconds: float) -> NodeInfo:
    report = _report(row)
    return NodeInfo(
        id=row.id,
        name=row.name,
        labels=NodeLabels.model_validate(row.labels or {}),
        role=row.role,
        address=row.address,
        deployments=list(row.deployments),
        registered_at=row.registered_at,
        last_seen=row.last_seen,
        stale=_is_stale(row, now, stale_seconds),
        inventory=report.inventory,
        serving=report.deployments,
        counters=report.counters,
        health=report.health,
        validation=report.validation,
        refused=report.refused,
        serve=report.serve,
        assigned=None if row.assigned is None else list(row.assigned),
    )


# --- node routes ---------------------------------------------------------------------------------


def register_node(
    state: AppState,
    body: NodeRegistration,
    enrol_by: str | None = None,
    *,
    token_id: str | None = None,
    trusted: bool = True,
) -> NodeInfo | NodeEnrolment:
    """Create or update the node called ``body.name``; with ``enrol_by``, also mint its node token.

    ``token_id`` is the enrolment token enrolling (its scope and node role become the node's);
    ``trusted`` is false for a node re-registering itself with its node token: then an enrolled
    node's role and labels stay what enrolment fixed (a different role is refused, 403).
    """
    proposed = body.token if isinstance(body, NodeEnrolRequest) else None
    if body.role not in _NODE_ROLES:
        raise ValidationError(f"node role must be one of {', '.join(_NODE_ROLES)}; got {body.role!r}")
    if body.address:
        check_peer_address(body.address, what=f"node {body.name!r}: peer address")
    for attempt in range(2):
        now = utcnow()
        with state.sessions() as session:
            scope = _enrolment_scope(session, token_id, body) if enrol_by else None
            query = select(NodeRow).where(NodeRow.name == body.name)
            row = session.scalars(query.with_for_update() if enrol_by else query).first()
            created = row is None
            if row is None:
                row = NodeRow(id=uuid.uuid4().hex, name=body.name, registered_at=now, report={}, enrolled=False)
                session.add(row)
            if enrol_by:
                row.enrolled, row.assigned = True, scope
            if trusted or not row.enrolled:
                row.labels = body.labels.model_dump(mode="json")
                row.role = body.role
            else:
                _keep_enrolled(row, body)
            row.address = body.address
            row.deployments = list(dict.fromkeys(body.deployments))
            row.last_seen = now
            try:
                # Writing the node's row first holds its lock (PostgreSQL: FOR UPDATE; SQLite: the
                # write lock) while the active-token check below runs: concurrent enrolments queue.
                session.flush()
                minted = _enrol(session, row, enrol_by, proposed) if enrol_by else None
                session.commit()
            except exc.IntegrityError:
                # The same name registered concurrently: the second pass finds and updates that row.
                session.rollback()
                if attempt:
                    raise
                continue
            event(log, "node.registered", node=row.name, node_id=row.id, new=created, role=row.role)
            info = _node_info(row, now, state.settings.node_stale_seconds)
            if minted is None:
                return info
            event(log, "node.enrolled", node=row.name, node_id=row.id, token_id=minted[0], by=enrol_by)
            return NodeEnrolment(node=info, token_id=minted[0], token=minted[1])
    raise AssertionError("unreachable")  # pragma: no cover


def _enrolment_scope(session: Session, token_id: str | None, body: NodeRegistration) -> list[str] | None:
    """The deployments an enrolment token assigns its nodes (``None``: all); refuses a role it was not minted for.

    An admin enrolling (no ``token_id``) assigns every deployment and any role.
    """
    token = session.get(TokenRow, token_id) if token_id else None
    if token is None:
        return None
    bound = token.node_role or "node"
    if body.role != bound:
        event(
            log,
            "node.enrol_role_refused",
            logging.WARNING,
            node=body.name,
            role=body.role,
            token_id=token.id,
            token_role=bound,
        )
        raise ForbiddenError(
            f"enrolment token {token.name!r} enrols nodes of role {bound!r}, not {body.role!r}: a role is bound "
            f"to the token minted for it; an admin mints one ('weightship token create NAME --role agent "
            f"--node-role {body.role}')",
            code="enrolment_role_refused",
            fields={"token": token.name, "role": body.role, "token_role": bound},
        )
    return None if token.deployments is None else list(token.deployments)


def _keep_enrolled(row: NodeRow, body: NodeRegistration) -> None:
    """A node re-registering itself keeps the role and labels its enrolment fixed."""
    if body.role != row.role:
        raise ForbiddenError(
            f"node {row.name!r} was enrolled as role {row.role!r} and cannot re-register as {body.role!r}: a role is "
            "bound to the enrolment token minted for it; enrol the machine again with such a token",
            code="role_fixed",
            fields={"node": row.name, "role": row.role, "role_asked": body.role},
        )
    labels = body.labels.model_dump(mode="json")
    if labels != (row.labels or {}):
        event(log, "node.labels_fixed", logging.WARNING, node=row.name, node_id=row.id, action="kept_enrolled_labels")


def _enrol(session: Session, row: NodeRow, by: str, proposed: str | None) -> tuple[str, str]:
    """Mint ``row``'s node token unless it has an active one (409); returns (token id, secret)."""
    held = active_node_token(session, row.id)
    if held is not None:
        event(log, "node.enrol_refused", logging.WARNING, node=row.name, node_id=row.id, held_by_token=held.id, by=by)
        raise ConflictError(
            f"node {row.name!r} is already enrolled (node token {held.id}); its agent re-registers with that "
            f"token. If the machine was replaced or lost its data directory, an admin revokes the old token "
            f"('weightship token revoke {held.id}') and the node enrols again"
        )
    token, secret = mint_node_token(session, row, by, proposed)
    return token.id, secret


def assign_node(state: AppState, node_id: str, deployments: list[str] | None, by: str) -> NodeInfo:
    """Set the deployments node ``node_id`` is assigned (``None``: all); what its tickets and blob URLs follow."""
    with state.sessions() as session:
        row = session.get(NodeRow, node_id)
        if row is None:
            raise unknown_node(node_id)
        row.assigned = None if deployments is None else list(dict.fromkeys(deployments))
        session.commit()
        event(log, "node.assigned", node=row.name, node_id=row.id, deployments=row.assigned, by=by)
        return _node_info(row, utcnow(), state.settings.node_stale_seconds)


def assign_deployment(state: AppState, name: str, selector: dict[str, str] | None, by: str) -> DeploymentAssignment:
    """Assign deployment ``name`` to the nodes whose enrolled labels ``selector`` matches (``None``: no selector)."""
    items = None if selector is None else check_selector(selector, f"assignment of deployment {name!r}")
    with state.sessions() as session:
        row = session.get(DeploymentRow, name)
        if row is None:
            raise NotFoundError(f"deployment {name!r} does not exist; list deployments with GET /v1/deployments",
                                code="deployment_not_found", fields={"deployment": name})  # fmt: skip
        row.assign_selector = None if items is None else dict(items)
        session.commit()
    event(log, "deployment.assigned", deployment=name, selector=selector, by=by)
    return DeploymentAssignment(selector=None if items is None else dict(items))


def _corrupt_origins(report: NodeHeartbeat) -> set[tuple[str, str | None, int | None]]:
    return {
        (item.digest, item.problem.blob, item.problem.chunk_index)
        for item in report.inventory
        if item.problem is not None and item.problem.reason == FetchFailure.corrupt_origin
    }


def _log_corrupt_origins(state: AppState, node: str, body: NodeHeartbeat) -> None:
    # The origin's copy of a blob is bad: say so once per node and chunk (per process), not every heartbeat.
    found = _corrupt_origins(body)
    seen = state.fleet.corrupt_origins_logged
    for digest, blob, chunk in sorted(found - seen.get(node, set()), key=str):
        event(log, "origin.blob_corrupt", logging.ERROR, node=node, version=digest, blob=blob, chunk_index=chunk)
    if found:
        seen[node] = found
    else:
        seen.pop(node, None)


async def record_heartbeat(
    state: AppState, node_id: str, node: str, body: NodeHeartbeat, raw: bytes | None = None
) -> None:
    """Store a node's report and ``last_seen``; returns once committed (group commit, one UPDATE, no read).

    Most heartbeats repeat the last report; this process remembers the hash of the report it last
    wrote per node and then only touches ``last_seen``. The report is still rewritten every
    REPORT_REWRITE_SECONDS, bounding how long a report written meanwhile through another replica
    could hide an equal one sent here. ``raw``, the body as received, is what is hashed when given
    (equal bytes are an equal report; an equal report sent differently is merely rewritten).
    """
    digest = sha256_hex(raw if raw is not None else body.model_dump_json().encode())
    written = state.fleet.reports_written
    last = written.get(node_id)
    now = time.monotonic()
    rewrite = last is None or last[0] != digest or now - last[1] > REPORT_REWRITE_SECONDS
    write = HeartbeatWrite(node_id, utcnow(), body.model_dump(mode="json") if rewrite else None)
    if not await state.heartbeats.submit(write):
        raise unknown_node(node_id)
    if rewrite:
        if len(written) >= MAX_NODES:
            written.clear()
        written[node_id] = (digest, now)
    _log_corrupt_origins(state, node, body)


def node_infos(state: AppState, deployment: str | None) -> list[NodeInfo]:
    now = utcnow()
    with state.sessions() as session:
        rows = session.scalars(select(NodeRow).order_by(NodeRow.name)).all()
        return [
            _node_info(row, now, state.settings.node_stale_seconds)
            for row in rows
            if deployment is None or deployment in row.deployments
        ]


def desired_answer(state: AppState, node: str, rows: list[DeploymentRow]) -> tuple[str, bytes]:
    """The revision and the JSON of the deployments that ``rows`` ask of ``node``.

    Computed once per distinct answer and shared: after a pointer change thousands of woken polls
    get one of a handful of answers (canary or not, per deployment), so each costs a lookup.
    """
    ordered = sorted(rows, key=lambda r: r.name)
    key = tuple(
        (r.name, r.model, r.stable, r.previous_stable, r.canary, r.canary_share, r.epoch,
         r.canary is not None and in_canary(r.name, node, r.canary_share))
        for r in ordered
    )  # fmt: skip
    answers = state.fleet.desired_answers
    found = answers.get(key)
    if found is None:
        wanted = desired_state("", node, ordered)
        content = [d.model_dump(mode="json") for d in wanted.deployments]
        found = wanted.revision, json.dumps(content, separators=(",", ":")).encode()
        if len(answers) >= _MAX_ANSWERS:
            answers.clear()
        answers[key] = found
    return found


# --- deployment status ---------------------------------------------------------------------------


@dataclass
class _Tally:
    digest: str
    role: str
    size: int
    desired: int = 0
    ready: int = 0
    fetching: int = 0
    failed: int = 0
    serving: int = 0
    present: int = 0
    total: int = 0
    retrying: int = 0
    problems: list[NodeProblem] = field(default_factory=list)

    def schema(self) -> VersionStatus:
        return VersionStatus(
            digest=self.digest,
            role=self.role,
            nodes_desired=self.desired,
            nodes_ready=self.ready,
            nodes_fetching=self.fetching,
            nodes_failed=self.failed,
            nodes_serving=self.serving,
            bytes_present=self.present,
            bytes_total=self.total,
            nodes_retrying=self.retrying,
            problems=self.problems,
        )


def status_of(state: AppState, name: str) -> DeploymentStatus:
    now = utcnow()
    stale_seconds = state.settings.node_stale_seconds
    with state.sessions() as session:
        row = session.get(DeploymentRow, name)
        if row is None:
            raise NotFoundError(f"deployment {name!r} does not exist; list deployments with GET /v1/deployments", code="deployment_not_found", fields={"deployment": name})
        everyone = list(session.scalars(select(NodeRow).order_by(NodeRow.name)))
        nodes = [n for n in everyone if name in n.deployments and n.role == "node"]
        caches = [n for n in everyone if n.role == "cache" and not _is_stale(n, now, stale_seconds)]
        roles = {"stable": row.stable, "canary": row.canary, "previous_stable": row.previous_stable}
        tallies: dict[str, _Tally] = {}
        for role, digest in roles.items():
            if digest is not None and digest not in tallies:
                version = session.get(VersionRow, digest)
                tallies[digest] = _Tally(digest=digest, role=role, size=version.size if version else 0)
    live = [n for n in nodes if not _is_stale(n, now, stale_seconds)]
    lagging: list[str] = []
    hook_failures: list[str] = []
    # Origin egress wherever it happened: the serving nodes' own origin reads and every live cache's
    # (a cache heartbeats what it read from the origin for its children). Delivered bytes are only
    # what reached serving nodes, so a cache's reads are never counted as delivered.
    origin_bytes = sum(_report(cache).counters.sources.get("origin", SourceTally()).bytes for cache in caches)
    delivered_bytes = 0
    for node in live:
        report = _report(node)
        origin_bytes += report.counters.sources.get("origin", SourceTally()).bytes
        delivered_bytes += sum(t.bytes for t in report.counters.sources.values())
        want = desired_deployment(row, node.name).digest
        held = {item.digest: item for item in report.inventory}
        served = next((d.digest for d in report.deployments if d.name == name), None)
        hook = next((d.hook for d in report.deployments if d.name == name), None)
        if hook is not None and not hook.ok:
            hook_failures.append(
                f"{node.name}: {hook.kind} hook failed for {hook.digest} ({hook.attempts} attempts): {hook.detail}"
            )
        for tally in tallies.values():
            item = held.get(tally.digest)
            if item is not None:
                tally.ready += item.state == VersionState.ready
                tally.fetching += item.state == VersionState.fetching
                tally.failed += item.state == VersionState.failed
                tally.present += item.bytes_present
                tally.total += item.bytes_total
                if item.problem is not None and item.state != VersionState.ready:
                    tally.retrying += item.state == VersionState.fetching
                    tally.problems.append(NodeProblem(node=node.name, state=item.state, problem=item.problem))
            if tally.digest == want:
                tally.desired += 1
                if item is None:
                    tally.total += tally.size
            tally.serving += served == tally.digest
        if want is not None and served != want:
            lagging.append(node.name)
    return DeploymentStatus(
        deployment=to_schema(row),
        versions=[t.schema() for t in tallies.values()],
        nodes=len(nodes),
        stale_nodes=len(nodes) - len(live),
        lagging_nodes=lagging,
        origin_bytes=origin_bytes,
        delivered_bytes=delivered_bytes,
        hook_failures=hook_failures,
    )


