"""Staging: which versions a node holds verified without serving them (preheats and warm pools).

Two things ask a node to *stage* a version (fetch and verify it, keep it on disk, never serve it):

- a **preheat** (``preheats`` table, ``controlplane.preheats``): one ready version of a
  deployment's model, on every node its selector matches, until the preheat is deleted;
- a deployment's **warm pool** (``deployments.warm_pool``): the deployment's stable and canary
  versions, on every node its selector matches, for as long as the pool is declared. The pool
  follows the pointer: a promotion stages the new stable on the pool at once.

A **selector** maps node label names (the fields of ``NodeLabels``: region, cluster, zone, rack,
gpu_type) to the value a node must have; a node matches when every entry matches, so the empty
selector matches every node. Both reach nodes of role ``node`` only, *whether or not the node is
registered for that deployment*: spare capacity that serves nothing yet is exactly what a warm
pool is for. Caches (role ``cache``) get nothing staged; they learn preheated versions from
``GET /v1/deployments`` (``Deployment.preheated``) and pin them, and nodes pulling through
them warm them (``agent.cache``).

The whole view (every preheat, every deployment with a warm pool) is small, and every
control-plane process holds one copy in its snapshot (``controlplane.snapshot``), re-read on the
``staging`` notification (a preheat or warm pool changed) and, while any warm pool exists, on
``deployments`` (a pool's pointer may have moved). A node's ``stage`` is then computed in memory
from its labels: a parked long-poll still issues no query.

The desired state carries ``stage`` only when it is not empty, and the revision of a node with
nothing staged is exactly what it was before staging existed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.persistence.rows import DeploymentRow, PreheatRow
from weightship.digests import sha256_hex
from weightship.errors import ValidationError
from weightship.schemas import NodeLabels, StagedVersion

__all__ = [
    "LABEL_NAMES",
    "STAGING_ROLE",
    "Preheated",
    "StagingView",
    "WarmPoolView",
    "check_selector",
    "matches",
    "read_view",
    "staged_digests",
    "view_of",
    "with_stage",
]

#: the label names a selector may use
LABEL_NAMES = tuple(NodeLabels.model_fields)
#: the node role staging applies to
STAGING_ROLE = "node"

SelectorItems = tuple[tuple[str, str], ...]


def check_selector(selector: Mapping[str, str], what: str) -> SelectorItems:
    """``selector`` as sorted items; 400 naming the label when it uses one nodes do not have."""
    unknown = sorted(set(selector) - set(LABEL_NAMES))
    if unknown:
        raise ValidationError(
            f"{what}: selector label {unknown[0]!r} is not a node label; use one of {', '.join(LABEL_NAMES)} "
            "(e.g. --selector cluster=c1,gpu_type=h100)",
            code="selector_invalid",
            fields={"label": unknown[0], "labels": ",".join(LABEL_NAMES)},
        )
    return tuple(sorted(selector.items()))


def matches(selector: SelectorItems, labels: Mapping[str, str]) -> bool:
    """Whether a node with ``labels`` is one ``selector`` picks (every entry equal)."""
    return all(labels.get(key) == value for key, value in selector)


@dataclass(frozen=True, slots=True)
class Preheated:
    """One standing preheat, as the snapshot holds it."""

    model: str
    digest: str
    selector: SelectorItems


@dataclass(frozen=True, slots=True)
class WarmPoolView:
    """One deployment's warm pool and the versions it keeps staged now."""

    deployment: str
    model: str
    digests: tuple[str, ...]
    selector: SelectorItems


@dataclass(frozen=True, slots=True)
class StagingView:
    """Every preheat and warm pool: what ``stage_for`` computes a node's ``stage`` from."""

    preheats: tuple[Preheated, ...] = ()
    pools: tuple[WarmPoolView, ...] = ()

    def stage_for(self, labels: Mapping[str, str], role: str) -> tuple[StagedVersion, ...]:
        """The versions a node with ``labels`` and ``role`` must stage, by digest, once each."""
        if role != STAGING_ROLE:
            return ()
        found: dict[str, str] = {}
        for preheat in self.preheats:
            if matches(preheat.selector, labels):
                found.setdefault(preheat.digest, preheat.model)
        for pool in self.pools:
            if matches(pool.selector, labels):
                for digest in pool.digests:
                    found.setdefault(digest, pool.model)
        return tuple(StagedVersion(model=model, digest=digest) for digest, model in sorted(found.items()))


def read_view(sessions: sessionmaker[Session]) -> StagingView:
    """Read every preheat and warm pool (two small queries in one session)."""
    with sessions() as session:
        return view_of(session)


def view_of(session: Session) -> StagingView:
    """Every preheat and warm pool, read in ``session``."""
    preheats = tuple(
        sorted(
            {
                Preheated(r.model, r.digest, tuple(sorted((r.selector or {}).items())))
                for r in session.scalars(select(PreheatRow))
            },
            key=lambda p: (p.digest, p.selector),
        )
    )
    pools = tuple(
        WarmPoolView(
            deployment=row.name,
            model=row.model,
            digests=tuple(dict.fromkeys(d for d in (row.stable, row.canary) if d is not None)),
            selector=tuple(sorted((row.warm_pool or {}).items())),
        )
        for row in session.scalars(
            select(DeploymentRow).where(DeploymentRow.warm_pool.is_not(None)).order_by(DeploymentRow.name)
        )
    )
    return StagingView(preheats=preheats, pools=pools)


def staged_digests(session: Session, labels: Mapping[str, str], role: str) -> set[str]:
    """The versions staging asks of a node (for its tickets); a cache: every preheated version (it pins them)."""
    view = view_of(session)
    if role == "cache":
        return {p.digest for p in view.preheats}
    return {s.digest for s in view.stage_for(labels, role)}


def with_stage(revision: str, deployments: bytes, stage: tuple[StagedVersion, ...]) -> tuple[str, bytes]:
    """The revision and the JSON members after ``node_id`` of a desired state with ``stage`` added.

    Nothing staged: the revision and body are exactly those of the deployments alone.
    """
    if not stage:
        return revision, b'"deployments":' + deployments
    staged = json.dumps([s.model_dump(mode="json") for s in stage], separators=(",", ":")).encode()
    members = b'"deployments":%s,"stage":%s' % (deployments, staged)
    return sha256_hex(b"%s|%s" % (revision.encode(), staged))[:32], members
