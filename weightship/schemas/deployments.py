"""Deployments and their serving pointer: create, read, move (compare-and-swap on the epoch), roll back, audit."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from weightship.schemas.base import Count, Digest, Name, Schema, Share

__all__ = [
    "Deployment",
    "DeploymentCreate",
    "PointerEvent",
    "PointerUpdate",
    "RollbackRequest",
    "Selector",
    "WarmPool",
]

#: a node selector: label name (a ``NodeLabels`` field) -> required value; empty matches every node
Selector = dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")], Annotated[str, Field(max_length=128)]]


class WarmPool(Schema):
    """Nodes (matched by ``selector``) that keep a deployment's stable and canary versions staged, not served."""

    selector: Selector = Field(max_length=16)


class DeploymentCreate(Schema):
    """Create a deployment of a model; it serves nothing until its pointer is set."""

    name: Name
    model: Name
    #: whether a ``publisher`` token may start rollouts of this deployment (operators always may)
    publisher_rollouts: bool = False
    warm_pool: WarmPool | None = None


class Deployment(Schema):
    """The serving pointer of a deployment."""

    name: Name
    model: Name
    stable: Digest | None
    previous_stable: Digest | None
    canary: Digest | None
    canary_share: Share
    epoch: Count
    updated_at: datetime
    warm_pool: WarmPool | None = None
    preheated: list[Digest] = Field(default_factory=list, description="versions preheats of it stage now")


class PointerUpdate(Schema):
    """Set the pointer; refs are labels or digests of ready versions of the deployment's model."""

    stable: str
    canary: str | None = None
    canary_share: Share = 0.0
    reason: str = Field(default="", max_length=1024)


class RollbackRequest(Schema):
    """Roll back to the previous stable version, or to ``to`` (label or digest)."""

    to: str | None = None
    reason: str = Field(default="", max_length=1024)


class PointerEvent(Schema):
    """One audit row: every pointer change writes one, with its new epoch."""

    epoch: Count
    action: str = Field(description="'set', 'promote', 'canary', 'abort' or 'rollback'")
    actor: str
    reason: str
    from_stable: Digest | None
    to_stable: Digest | None
    from_canary: Digest | None
    to_canary: Digest | None
    canary_share: Share
    at: datetime
