"""The agent's local API, for model servers on the same host (``/local/v1``)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from weightship.schemas.base import Count, Digest, Name, Schema

__all__ = [
    "LocalDeployment",
    "LocalLease",
    "LocalVersion",
    "LocalVersionState",
]

class LocalDeployment(Schema):
    """What a model server on this host should serve for a deployment."""

    name: Name
    model: Name | None
    digest: Digest | None
    path: str | None = Field(description="absolute path of the version directory")
    epoch: Count
    ready: bool


class LocalVersionState(StrEnum):
    """Where a version asked for by digest stands on this host."""

    ready = "ready"  # verified on disk: serve it from ``path``
    fetching = "fetching"  # being fetched and verified (or queued to be)
    failed = "failed"  # its fetch failed; the agent retries by itself (``reason`` says why)
    unknown = "unknown"  # not on disk and not to be fetched (``reason`` says why, and what to do)


class LocalVersion(Schema):
    """A version by digest, as a model server pinned to it sees it (``GET /local/v1/versions/{digest}``)."""

    digest: Digest
    deployment: Name | None = Field(default=None, description="the deployment it was asked for")
    state: LocalVersionState
    path: str | None = Field(default=None, description="absolute path of the version directory, once ready")
    reason: str = Field(default="", max_length=4096, description="why it is not ready, and what to do")
    bytes_total: Count = 0
    bytes_present: Count = 0


class LocalLease(Schema):
    """``PUT /local/v1/leases/{holder}``: a model server serves (or is about to serve) ``digest``.

    While the lease lives the agent never evicts the version, and stages it like an ask; the holder
    renews it before ``seconds`` pass (a server that died stops renewing, and the lease lapses).
    """

    deployment: Name
    digest: Digest
    seconds: float = Field(default=30.0, ge=1.0, le=3600.0, allow_inf_nan=False)
