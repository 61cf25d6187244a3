"""Entitlement tickets: which node may fetch which versions from peers and caches, signed offline-checkable.

Model weights are confidential, and peers and caches cannot ask the control plane about every
chunk. So a node asks here, with its own node token, for a ticket naming itself and the versions
it wants (``POST /v1/tickets``); peers, caches and the tracker check the ticket's ed25519 signature
with the public keys (``GET /v1/tickets/keys``, also in every grant) and never call back. The
format and its checks are ``weightship.tickets``.

**Who is entitled to what.** Entitlement follows from what an operator assigned the node, never
from what it claims when it registers. A node's *assigned* deployments are its enrolment token's
scope (``weightship token create NAME --role agent --deployment chat``), fixed at enrolment; an
unscoped enrolment token (the default, and the chart's bootstrap token) or an admin enrolling
assigns every deployment. Its role and labels are fixed at enrolment too: ``cache`` only from a
token minted with ``--node-role cache``. A version is granted only when it is ready and

- role ``node``: some deployment the node registered for *and* was assigned names it in its
  pointer (stable, previous stable or canary: the versions it keeps on disk). A node may still
  say which deployments it wants to follow (an agent staging what its pods ask for), but wanting
  one it was not assigned gets it nothing;
- role ``cache``: an assigned deployment's pointer names it (unscoped: any pointer; a cache serves
  the whole cluster or region);
- either role: staging asks it of the node (``controlplane.staging``: a preheat or a warm pool
  matching the labels enrolment fixed; a cache, any preheated version), limited to the models of
  its assigned deployments when it has a scope.

The same rule issues origin blob URLs (``entitled_blobs``): a node token gets URLs only for blobs
of versions it is entitled to; an enrolment token gets none.

**Audience.** A node asks for a ticket for what one fetch needs (the version it fetches) and names
the ``audience``: the node (peer, cache or tracker) it will send it to. Peers, caches and the
tracker accept only tickets naming themselves, so a ticket harvested by a hostile peer opens
nothing anywhere else.

Anything else in the request refuses the whole request (403), naming the versions refused, so a
node never holds a ticket wider than it should and a bug asking for too much is loud. Only node
tokens get tickets, for their own node: an enrolment, publisher, operator or admin token is
refused (403), since a ticket must name a node.

**Signing keys** live in the ``ticket_keys`` table, so every replica signs with the same key. The
first request that finds none creates one; if two replicas race, both keys are stored and the
*oldest* key not retired signs everywhere (each replica re-reads the table every
``KEY_REFRESH_SECONDS``). Rotating is: insert a new key, wait for agents to re-read the keys, retire
the old one (``retired = true``); a retired key stops verifying once agents re-read the keys.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from sqlalchemy import exc, select
from sqlalchemy.orm import Session

from controlplane.persistence.rows import DeploymentRow, NodeRow, TicketKeyRow, VersionRow, utcnow
from controlplane.persistence.store import manifest_key
from controlplane.staging import matches, staged_digests
from controlplane.state import AppState, SigningKeys
from weightship.errors import ForbiddenError, NotFoundError, ValidationError
from weightship.logs import event
from weightship.manifest import MAX_MANIFEST_BYTES, parse_manifest
from weightship.schemas import TicketGrant
from weightship.tickets import (
    Ticket,
    key_id,
    load_private_key,
    new_private_key,
    private_key_text,
    public_key_text,
    sign_ticket,
)

__all__ = [
    "KEY_REFRESH_SECONDS",
    "SigningKeys",
    "assigned_deployments",
    "entitled_blobs",
    "entitled_deployments",
    "entitled_versions",
    "issue_ticket",
    "signing_key",
]

log = logging.getLogger(__name__)

#: how long a replica signs with the key it read before reading the table again (rotation, races)
KEY_REFRESH_SECONDS = 60.0


def _read_keys(session: Session) -> list[TicketKeyRow]:
    return list(
        session.scalars(
            select(TicketKeyRow)
            .where(TicketKeyRow.retired.is_(False))
            .order_by(TicketKeyRow.created_at, TicketKeyRow.kid)
        )
    )


def _load_or_create(state: AppState) -> SigningKeys:
    with state.sessions() as session:
        rows = _read_keys(session)
        if not rows:
            private = new_private_key()
            kid = key_id(private.public_key())
            session.add(
                TicketKeyRow(
                    kid=kid,
                    private_key=private_key_text(private),
                    public_key=public_key_text(private.public_key()),
                    retired=False,
                    created_at=utcnow(),
                )
            )
            try:
                session.commit()
                event(log, "ticket.key_created", kid=kid)
            except exc.IntegrityError:  # pragma: no cover - a 64-bit key-id collision
                session.rollback()
            rows = _read_keys(session)
    oldest = rows[0]
    return SigningKeys(
        kid=oldest.kid,
        private=load_private_key(oldest.private_key),
        public={row.kid: row.public_key for row in rows},
        read_at=time.monotonic(),
    )


def signing_key(state: AppState) -> SigningKeys:
    """The key tickets are signed with now, and every published public key; created on first use."""
    cached = state.ticket_keys
    if cached is None or time.monotonic() - cached.read_at > KEY_REFRESH_SECONDS:
        cached = _load_or_create(state)
        state.ticket_keys = cached
    return cached


def assigned_deployments(session: Session, node: NodeRow) -> list[str] | None:
    """What ``node`` was assigned: its own assignment plus the deployments whose selector matches it; ``None``: all."""
    if node.assigned is None:
        return None
    labels = node.labels or {}
    selected = session.execute(select(DeploymentRow.name, DeploymentRow.assign_selector)).all()
    return list(node.assigned) + [name for name, selector in selected
                                  if selector is not None and matches(tuple(selector.items()), labels)]  # fmt: skip


def entitled_deployments(session: Session, node: NodeRow) -> list[str] | None:
    """The deployments whose pointers entitle ``node``; ``None``: every deployment (an unscoped cache).

    A node: those it registered for that it was also assigned. A cache: those it was assigned.
    Assigned: its own assignment (``None``: all), plus every deployment whose ``assign_selector``
    matches the labels its enrolment fixed.
    """
    assigned = assigned_deployments(session, node)
    if node.role == "cache":
        return None if assigned is None else list(assigned)
    wanted = list(node.deployments or ())
    return wanted if assigned is None else [d for d in wanted if d in set(assigned)]


def entitled_versions(session: Session, node: NodeRow) -> set[str]:
    """Every version some pointer the node may fetch for names, or staging asks of it (before the ready check)."""
    staged = staged_digests(session, node.labels or {}, node.role)
    assigned = assigned_deployments(session, node)
    if assigned is not None and staged:
        models = select(DeploymentRow.model).where(DeploymentRow.name.in_(assigned))
        staged = set(session.scalars(select(VersionRow.digest).where(VersionRow.digest.in_(staged),
                                                                     VersionRow.model.in_(models))))  # fmt: skip
    deployments = entitled_deployments(session, node)
    query = select(DeploymentRow)
    if deployments is not None:
        if not deployments:
            return staged
        query = query.where(DeploymentRow.name.in_(deployments))
    return staged | {
        digest
        for row in session.scalars(query)
        for digest in (row.stable, row.previous_stable, row.canary)
        if digest is not None
    }


#: blob sha256s of each version's manifest (immutable: the digest names the content), bounded
_BLOBS: dict[str, frozenset[str]] = {}
_MAX_BLOB_SETS = 4096


def _blobs_of(state: AppState, digest: str) -> frozenset[str]:
    found = _BLOBS.get(digest)
    if found is None:
        manifest = parse_manifest(state.store.get_bytes(manifest_key(digest), MAX_MANIFEST_BYTES))
        if manifest.digest != digest:
            raise ForbiddenError(f"the stored manifest of {digest} does not hash to it; the origin store is corrupt")
        found = frozenset(f.sha256 for f in manifest.files)
        if len(_BLOBS) >= _MAX_BLOB_SETS:
            _BLOBS.clear()
        _BLOBS[digest] = found
    return found


def entitled_blobs(state: AppState, node_id: str) -> set[str]:
    """The blobs (file sha256) of every ready version node ``node_id`` is entitled to."""
    with state.sessions() as session:
        node = session.get(NodeRow, node_id)
        if node is None:
            raise NotFoundError(f"node {node_id!r} is not registered; its agent registers again on its next start")
        entitled = entitled_versions(session, node)
        ready = list(session.scalars(select(VersionRow.digest).where(VersionRow.digest.in_(entitled),
                                                                     VersionRow.state == "ready")))  # fmt: skip
    blobs: set[str] = set()
    for digest in ready:
        try:
            blobs |= _blobs_of(state, digest)
        except (ForbiddenError, NotFoundError, ValidationError) as exc:
            # One unreadable manifest withholds its own blobs, not those of the node's other versions.
            event(log, "manifest.unreadable", logging.ERROR, version=digest, node=node_id, error=exc.message)
    return blobs


def issue_ticket(
    state: AppState, node_id: str, versions: list[str], now: float | None = None, audience: str | None = None
) -> TicketGrant:
    """A ticket naming node ``node_id``, ``versions`` and ``audience``, or ``ForbiddenError`` naming what it may not have."""
    wanted = sorted(set(versions))
    with state.sessions() as session:
        node = session.get(NodeRow, node_id)
        if node is None:
            raise NotFoundError(f"node {node_id!r} is not registered; its agent registers again on its next start")
        entitled = entitled_versions(session, node)
        ready = set(
            session.scalars(select(VersionRow.digest).where(VersionRow.digest.in_(wanted), VersionRow.state == "ready"))
        )
        name, role, address = node.name, node.role, node.address
    refused = [v for v in wanted if v not in entitled or v not in ready]
    if refused:
        event(log, "ticket.refused", logging.WARNING, node=name, role=role, refused=",".join(refused))
        raise ForbiddenError(
            f"node {name!r} (role {role}) is not entitled to {', '.join(refused)}: a node gets tickets only for "
            "ready versions that a pointer of a deployment it registered for and was assigned names (a cache: any "
            "assigned deployment's pointer); an admin assigns deployments with the enrolment token's scope",
            fields={"refused": ",".join(refused)},
        )
    keys = signing_key(state)
    issued = int(time.time() if now is None else now)
    ticket = Ticket(
        kid=keys.kid,
        node=name,
        versions=frozenset(wanted),
        iat=issued,
        exp=issued + state.settings.ticket_ttl_seconds,
        aud=audience,
        addr=address,
    )
    token = sign_ticket(keys.private, ticket)
    event(log, "ticket.issued", node=name, versions=len(wanted), audience=audience, kid=keys.kid, exp=ticket.exp)
    return TicketGrant(
        ticket=token,
        node=name,
        versions=wanted,
        audience=audience,
        expires_at=datetime.fromtimestamp(ticket.exp, UTC),
        keys=dict(keys.public),
    )
