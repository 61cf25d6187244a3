"""The cluster tracker's API (in the cluster cache; ``agent.tracker_api``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from weightship.schemas.base import Count, Digest, HexDigest, Measure, Name, Schema

__all__ = [
    "TrackerAnnounce",
    "TrackerAvailability",
    "TrackerHave",
    "TrackerReport",
    "TrackerSource",
    "TrackerSources",
]

class TrackerHave(Schema):
    """The chunks of one version a node holds, verified."""

    have: str = Field(
        max_length=1_400_000,
        description="base64 bitmap over the version's chunk order (bit i, MSB first, set: chunk i held)",
    )


class TrackerAnnounce(Schema):
    """``POST /v1/tracker/announce``: what a node holds, batched over versions; re-sent periodically."""

    node: Name
    #: the node's peer listener; none for a node that serves no peers: its announcements end its
    #: upstream grants (a chunk it announces is one it no longer fetches) but it is never a parent
    address: str | None = Field(default=None, pattern=r"^https?://", max_length=512)
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    upload_slots_free: Count = 0
    versions: dict[Digest, TrackerHave] = Field(max_length=256)


class TrackerSource(Schema):
    """A parent to fetch a chunk from."""

    node: Name
    address: str


class TrackerSources(Schema):
    """``GET /v1/tracker/sources``: ranked parents; with none, whether to go up a tier or wait."""

    sources: list[TrackerSource]
    upstream_allowed: bool
    retry_after: Measure = 0.0


class TrackerAvailability(Schema):
    """``GET /v1/tracker/availability``: a version's chunks as the asking node sees the cluster.

    Lists are over the version's chunk order; the node asks first for what the swarm lacks most.
    """

    holders: list[Count] = Field(max_length=10_000_000, description="live peers holding each chunk (not the asker)")
    fetching: list[Count] = Field(default_factory=list, description="chunks some node fetches from a cache now")
    cached: list[Count] = Field(default_factory=list, description="chunks the cluster cache holds")
    upstream_free: Count = 0
    free: list[Count] = Field(
        default_factory=list, description="holders of each chunk with a free upload slot now (empty: not told)"
    )


class TrackerReport(Schema):
    """``POST /v1/tracker/report``: a parent served corrupt or slow data, or refused."""

    node: Name
    version: Digest
    chunk: HexDigest
    reason: Literal["corrupt", "slow", "refused"]
