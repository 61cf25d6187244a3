"""API tokens: create, list, revoke."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from weightship.schemas.base import Name, Role, Schema

__all__ = [
    "TokenCreate",
    "TokenCreated",
    "TokenInfo",
]

class TokenCreate(Schema):
    """Mint a token for a role."""

    name: str = Field(min_length=1, max_length=128)
    role: Role
    deployments: list[Name] | None = Field(
        default=None,
        max_length=256,
        description="agent enrolment tokens only: the deployments the nodes it enrols are assigned (null: all)",
    )
    node_role: Literal["node", "cache"] | None = Field(
        default=None, description="agent enrolment tokens only: the role the nodes it enrols get (null: node)"
    )


class TokenInfo(Schema):
    """A token without its secret."""

    id: str
    name: str
    role: Role
    created_at: datetime
    created_by: str
    node_id: str | None = Field(default=None, description="the node a node token acts for")
    deployments: list[str] | None = Field(default=None, description="an enrolment token's scope (null: all)")
    node_role: str | None = Field(default=None, description="the role an enrolment token's nodes get (null: node)")


class TokenCreated(Schema):
    """A new token; ``token`` is shown once and only its hash is stored."""

    id: str
    name: str
    role: Role
    token: str
