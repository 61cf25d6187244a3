"""API tokens: minting, listing and revoking them, and the bootstrap admin token.

A token's secret is shown once, when it is minted; only its SHA-256 is stored
(``controlplane.auth.hash_secret``). Revoking marks the row ``revoked`` instead of deleting it, so
the audit trail (``created_by`` of later tokens, pointer events naming the actor) still resolves.

Bootstrap tokens let an install start with every credential in place, minting nothing by hand
afterwards. The admin one comes from ``WEIGHTSHIP_ADMIN_TOKEN``; any role's from a file named after
the role in ``WEIGHTSHIP_BOOTSTRAP_TOKENS_DIR`` (the Helm chart mounts its bootstrap Secret there:
``agent`` is the nodes' enrolment token, ``cache`` the caches' (an ``agent`` token whose nodes
get the ``cache`` role), ``operator`` the ModelRollout operator's). At start-up each one's hash is
stored as a token of that role named ``bootstrap-<role>`` unless that hash is already known, so
restarts and replicas starting together are harmless. A bootstrap token that an admin
revoked stays revoked: restarting with the same environment never brings it back. A bootstrap
``agent`` token is bound to no node, so it can only enrol one.

Node tokens (``node_id`` set) are minted only by enrolment (``controlplane.fleet``), through
``mint_node_token``: at most one active per node, which the enrolment transaction checks with
``active_node_token`` while it holds the node's row. Revoking a node's token is how an admin
resets a node (a replaced machine): its name can then be enrolled again.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from sqlalchemy import exc, select
from sqlalchemy.orm import Session

from controlplane.auth import hash_secret, new_secret
from controlplane.notify import token_topic
from controlplane.persistence.rows import NodeRow, TokenRow, utcnow
from controlplane.state import AppState
from weightship.errors import ConflictError, ValidationError
from weightship.logs import event
from weightship.schemas import Role, TokenInfo

__all__ = [
    "BOOTSTRAP_NAME",
    "active_node_token",
    "announce_revoked",
    "bootstrap_admin",
    "bootstrap_tokens",
    "mint_node_token",
    "new_token_row",
    "read_bootstrap_dir",
    "token_info",
]

log = logging.getLogger(__name__)


BOOTSTRAP_NAME = "bootstrap-admin"
_MIN_BOOTSTRAP_LENGTH = 16


def _new_id() -> str:
    return secrets.token_hex(8)


def bootstrap_admin(state: AppState) -> None:
    """Store the hash of ``settings.admin_token`` as an admin token, once; nothing when it is empty."""
    if state.settings.admin_token:
        _store_bootstrap(state, Role.admin, state.settings.admin_token)


def bootstrap_tokens(state: AppState) -> None:
    """Store every bootstrap token (the admin one, then each file of the tokens directory), once each.

    A file named ``cache`` holds the caches' enrolment token: an ``agent`` token whose nodes get
    the ``cache`` role (``bootstrap-cache``), since the role is bound to a token minted for it.
    """
    bootstrap_admin(state)
    for role, secret in read_bootstrap_dir(state.settings.bootstrap_tokens_dir):
        _store_bootstrap(state, role, secret)
    directory = state.settings.bootstrap_tokens_dir
    cache = Path(directory) / "cache" if directory else None
    if cache is not None and cache.is_file() and (secret := cache.read_text(encoding="utf-8").strip()):
        _store_bootstrap(state, Role.agent, secret, node_role="cache")


def read_bootstrap_dir(directory: str) -> list[tuple[Role, str]]:
    """(role, token) for each role-named, non-empty file in ``directory``; nothing when it is ``""``."""
    if not directory:
        return []
    root = Path(directory)
    if not root.is_dir():
        raise ValidationError(
            f"WEIGHTSHIP_BOOTSTRAP_TOKENS_DIR names {directory!r}, which is not a directory: "
            "mount the bootstrap Secret there or unset the variable"
        )
    found = []
    for role in Role:
        path = root / role.value
        secret = path.read_text(encoding="utf-8").strip() if path.is_file() else ""
        if secret:
            found.append((role, secret))
        elif path.exists():
            event(log, "bootstrap.token_empty", logging.WARNING, path=path, action="ignored")
    return found


def _store_bootstrap(state: AppState, role: Role, secret: str, node_role: str | None = None) -> None:
    name = f"bootstrap-{node_role or role.value}"
    if len(secret) < _MIN_BOOTSTRAP_LENGTH:
        # Warn rather than refuse: local demos use short tokens; production should not.
        event(
            log,
            "bootstrap.token_weak",
            logging.WARNING,
            name=name,
            length=len(secret),
            advice=f"use_at_least_{_MIN_BOOTSTRAP_LENGTH}_random_chars",
        )
    digest = hash_secret(secret)
    with state.sessions() as session:
        existing = session.scalars(select(TokenRow).where(TokenRow.secret_hash == digest)).first()
        if existing is not None:
            if existing.revoked:
                event(
                    log,
                    "bootstrap.token_revoked",
                    logging.WARNING,
                    name=name,
                    token_id=existing.id,
                    action="left_revoked",
                )
            return
        session.add(
            TokenRow(
                id=_new_id(),
                name=name,
                role=role.value,
                secret_hash=digest,
                revoked=False,
                created_at=utcnow(),
                created_by="bootstrap",
                node_role=node_role,
            )
        )
        try:
            session.commit()
        except exc.IntegrityError:
            # Another replica stored the same hash first: the outcome we wanted.
            session.rollback()
            return
    event(log, "bootstrap.token_stored", name=name, role=role.value)


def active_node_token(session: Session, node_id: str) -> TokenRow | None:
    """The node token of ``node_id`` that is not revoked, if any."""
    return session.scalars(
        select(TokenRow).where(TokenRow.node_id == node_id, TokenRow.revoked.is_(False)).order_by(TokenRow.created_at)
    ).first()


def mint_node_token(session: Session, node: NodeRow, by: str, secret: str | None = None) -> tuple[TokenRow, str]:
    """Add (uncommitted) a token bound to ``node``, named after it; returns the row and its secret.

    ``secret`` is one the node generated and proposed; a fresh one is minted when it is ``None``.
    """
    secret = secret or new_secret()
    if session.scalars(select(TokenRow.id).where(TokenRow.secret_hash == hash_secret(secret))).first() is not None:
        raise ConflictError("the proposed node token is already in use: generate another secret and enrol again")
    row = new_token_row(node.name, Role.agent, secret, by, node_id=node.id)
    session.add(row)
    return row, secret


def new_token_row(name: str, role: Role, secret: str, by: str, node_id: str | None = None) -> TokenRow:
    return TokenRow(
        id=_new_id(),
        name=name,
        role=role.value,
        secret_hash=hash_secret(secret),
        revoked=False,
        created_at=utcnow(),
        created_by=by,
        node_id=node_id,
    )


def token_info(row: TokenRow) -> TokenInfo:
    return TokenInfo(
        id=row.id,
        name=row.name,
        role=Role(row.role),
        created_at=row.created_at,
        created_by=row.created_by,
        node_id=row.node_id,
        deployments=row.deployments,
        node_role=row.node_role,
    )


def announce_revoked(state: AppState, token_id: str) -> None:
    """After token ``token_id``'s revocation is committed: forget it here at once, and in every other process.

    Blocking (it may notify PostgreSQL): call from a worker thread.
    """
    state.tokens.revoke(token_id)
    state.changes.announce_from_thread(token_topic(token_id))
