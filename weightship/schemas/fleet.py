"""The fleet: enrolment, registration, heartbeats, desired state, staging, preheats, blob URLs, status, assignment."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from weightship.schemas.base import Count, Digest, HexDigest, Measure, Name, Schema
from weightship.schemas.deployments import Deployment, Selector
from weightship.schemas.serving import NodeServeMetrics

__all__ = [
    "BlobURL",
    "BlobURLRequest",
    "BlobURLs",
    "DeploymentAssignment",
    "DeploymentState",
    "DeploymentStatus",
    "DesiredDeployment",
    "DesiredState",
    "FetchFailure",
    "FetchProblem",
    "NodeAssignment",
    "NodeCounters",
    "NodeEnrolRequest",
    "NodeEnrolment",
    "NodeHealth",
    "NodeHeartbeat",
    "NodeInfo",
    "NodeLabels",
    "NodeProblem",
    "NodeRegistration",
    "Preheat",
    "PreheatCreate",
    "SourceTally",
    "StagedVersion",
    "SwitchHookResult",
    "ValidationCheck",
    "ValidationReport",
    "VersionInventory",
    "VersionState",
    "VersionStatus",
]

class NodeLabels(Schema):
    """Where a node sits; used for canary selection and choosing peers and caches."""

    region: str = "default"
    cluster: str = "default"
    zone: str = "default"
    rack: str = "default"
    gpu_type: str = "none"


class NodeRegistration(Schema):
    """An agent introducing itself; the same name re-registers the same node."""

    name: Name
    labels: NodeLabels = Field(default_factory=NodeLabels)
    role: str = Field(default="node", description="'node' or 'cache'")
    address: str | None = Field(default=None, description="peer-serving base URL, if any")
    deployments: list[Name] = Field(default_factory=list)


class VersionState(StrEnum):
    """Where a version stands on a node."""

    fetching = "fetching"
    ready = "ready"
    failed = "failed"


class FetchFailure(StrEnum):
    """Why a node's fetch of a version keeps failing."""

    corrupt_origin = "corrupt_origin"  # a chunk's bytes from the origin never matched its digest
    origin_unavailable = "origin_unavailable"  # the origin (or its URLs) refused or did not answer
    disk_full = "disk_full"
    signature_refused = "signature_refused"  # the node's signing policy refuses the version (before any byte)
    error = "error"  # anything else; the message says what


class FetchProblem(Schema):
    """A version whose fetch is retrying or has failed on a node: why, since when, what next.

    ``state`` ``fetching`` with a problem is a fetch that is retrying; ``failed`` is one that
    gave up until ``retry_at`` (or until a new desired state names the version again).
    """

    reason: FetchFailure
    message: str = Field(max_length=4096, description="the last error, as the node logged it")
    since: datetime = Field(description="when this run of failures began")
    attempts: int = Field(ge=0, description="whole fetch attempts of the version that failed in a row")
    retry_at: datetime | None = Field(default=None, description="when the node tries again by itself")
    blob: HexDigest | None = Field(default=None, description="corrupt_origin: the blob (file sha256) at fault")
    file: str | None = Field(default=None, max_length=1024, description="corrupt_origin: the file's path")
    chunk_index: int | None = Field(default=None, ge=0, description="corrupt_origin: the chunk's index in the file")
    chunk_digest: HexDigest | None = Field(default=None, description="corrupt_origin: the chunk's expected sha256")
    chunk_attempts: int = Field(default=0, ge=0, description="corrupt_origin: times the chunk was fetched and rejected")


class VersionInventory(Schema):
    """One version on a node's disk."""

    digest: Digest
    state: VersionState
    bytes_total: Count
    bytes_present: Count
    error: str | None = None
    problem: FetchProblem | None = None


class SwitchHookResult(Schema):
    """The last call of a deployment's switch hook on a node (``agent.switchhooks``)."""

    kind: str = Field(description="'command', 'signal' or 'http'")
    digest: Digest = Field(description="the version the hook announced")
    epoch: Count
    ok: bool
    detail: str = Field(default="", max_length=2000, description="why it failed: exit code or HTTP status, stderr")
    exit_code: int | None = Field(default=None, description="command: its exit status (negative: killed by a signal)")
    http_status: int | None = Field(default=None, description="http: the answer's status")
    seconds: Measure = 0.0
    at: datetime
    attempts: Count = Field(default=0, description="failed calls in a row for this digest")
    retry_at: datetime | None = Field(default=None, description="when a failed hook is called again")


class DeploymentState(Schema):
    """What a node serves for a deployment right now."""

    name: Name
    digest: Digest | None
    epoch: Count
    hook: SwitchHookResult | None = Field(default=None, description="its switch hook's last call, when one is set")


class SourceTally(Schema):
    """What one chunk source (local, peer, cluster_cache, region_cache, origin) delivered to a node."""

    bytes: Count = 0
    chunks: Count = 0
    errors: Count = 0


class NodeCounters(Schema):
    """Monotonic byte counters since the agent started."""

    bytes_downloaded: Count = 0
    bytes_from_peers: Count = 0
    bytes_copied_locally: Count = 0
    chunks_rejected: Count = 0
    #: per source, nearest first: local, peer, cluster_cache, region_cache, origin
    sources: dict[str, SourceTally] = Field(default_factory=dict)


class NodeHealth(Schema):
    """Node health as the agent sees it."""

    disk_total: Count = 0
    disk_free: Count = 0
    quota_bytes: Count = 0
    used_bytes: Count = 0
    errors: list[str] = Field(default_factory=list)


class ValidationCheck(Schema):
    """One check of a loaded model (smoke test, NaN/Inf scan, ...)."""

    name: str
    passed: bool
    detail: str = ""


class ValidationReport(Schema):
    """What a model server found when it loaded and validated a version."""

    deployment: Name
    digest: Digest
    passed: bool
    checks: list[ValidationCheck] = Field(default_factory=list)
    load_seconds: Measure = 0.0
    load_gbps: Measure = 0.0
    at: datetime | None = None


class NodeHeartbeat(Schema):
    """Periodic report of inventory, what is served, counters and health."""

    inventory: list[VersionInventory] = Field(default_factory=list)
    deployments: list[DeploymentState] = Field(default_factory=list)
    counters: NodeCounters = Field(default_factory=NodeCounters)
    health: NodeHealth = Field(default_factory=NodeHealth)
    validation: list[ValidationReport] = Field(default_factory=list)
    refused: list[str] = Field(default_factory=list, description="pointer updates refused (e.g. lower epoch)")
    serve: NodeServeMetrics | None = Field(default=None, description="model servers' counters per version")


class NodeInfo(Schema):
    """A node as the control plane knows it."""

    id: str
    name: Name
    labels: NodeLabels
    role: str
    address: str | None
    deployments: list[Name]
    registered_at: datetime
    last_seen: datetime | None
    stale: bool
    assigned: list[str] | None = Field(
        default=None, description="deployments an admin assigned the node (enrolment token scope); null: all"
    )
    inventory: list[VersionInventory] = Field(default_factory=list)
    serving: list[DeploymentState] = Field(default_factory=list)
    counters: NodeCounters = Field(default_factory=NodeCounters)
    health: NodeHealth = Field(default_factory=NodeHealth)
    validation: list[ValidationReport] = Field(default_factory=list)
    refused: list[str] = Field(default_factory=list, description="pointer updates the node refused (e.g. lower epoch)")
    serve: NodeServeMetrics | None = Field(default=None, description="model servers' counters per version")


class DesiredDeployment(Schema):
    """What one deployment wants this node to serve."""

    name: Name
    model: Name
    digest: Digest | None
    epoch: Count
    role: str = Field(description="'stable' or 'canary': which side of the split this node is on")
    keep: list[Digest] = Field(description="versions to keep on disk: stable, previous stable, canary")


class StagedVersion(Schema):
    """A version a node fetches and verifies but does not serve (a preheat or a warm pool asks it)."""

    model: Name
    digest: Digest


class DesiredState(Schema):
    """The whole desired state of a node; ``revision`` changes whenever any part does."""

    node_id: str
    revision: str
    deployments: list[DesiredDeployment]
    stage: list[StagedVersion] = Field(default_factory=list, description="versions to hold verified, not served")


class PreheatCreate(Schema):
    """Stage a ready version of a deployment's model on the nodes ``selector`` matches, without switching."""

    version: str = Field(min_length=1, max_length=200, description="label or sha256 digest of a ready version")
    selector: Selector = Field(default_factory=dict, max_length=16)


class Preheat(Schema):
    """A standing preheat and how far the nodes it matches have got (from their heartbeats)."""

    id: str
    deployment: Name
    model: Name
    digest: Digest
    version: str = Field(description="the ref it was asked with (label or digest)")
    selector: Selector
    created_at: datetime
    created_by: str
    nodes_matched: Count = Field(default=0, description="live nodes the selector matches")
    nodes_staged: Count = Field(default=0, description="of those, nodes that hold the version verified")
    nodes_fetching: Count = 0
    nodes_failed: Count = 0


class BlobURLRequest(Schema):
    """Ask for short-lived read URLs of blobs (by file sha256)."""

    blobs: list[HexDigest] = Field(max_length=10_000)


class BlobURL(Schema):
    """A short-lived URL that serves one blob with HTTP range requests; no credentials needed."""

    url: str
    expires_at: datetime


class BlobURLs(Schema):
    """Read URLs by blob sha256."""

    urls: dict[str, BlobURL]


class NodeProblem(Schema):
    """One node's fetch problem with a version, as ``GET /v1/deployments/{name}/status`` lists it."""

    node: Name
    state: VersionState
    problem: FetchProblem


class VersionStatus(Schema):
    """How a version of a deployment stands across the fleet."""

    digest: Digest
    role: str = Field(description="'stable', 'previous_stable' or 'canary'")
    nodes_desired: Count
    nodes_ready: Count
    nodes_fetching: Count
    nodes_failed: Count
    nodes_serving: Count
    bytes_present: Count
    bytes_total: Count
    nodes_retrying: Count = Field(default=0, description="nodes fetching it whose fetch keeps failing")
    problems: list[NodeProblem] = Field(default_factory=list, description="why it is retrying or failed, per node")


class DeploymentStatus(Schema):
    """Fleet-wide view of one deployment."""

    deployment: Deployment
    versions: list[VersionStatus]
    nodes: Count
    stale_nodes: Count
    lagging_nodes: list[str] = Field(description="nodes not yet serving what they should")
    origin_bytes: Count = Field(
        default=0, description="bytes read from the origin by the live nodes and by every live cache (for them)"
    )
    delivered_bytes: Count = Field(
        default=0, description="chunk bytes the live serving nodes received from any source (caches not counted)"
    )
    hook_failures: list[str] = Field(
        default_factory=list, description="live nodes whose switch hook for this deployment keeps failing, and why"
    )


class NodeAssignment(Schema):
    """``PUT /v1/nodes/{id}/assignment`` (operator): the deployments the node may fetch for; null: all."""

    deployments: list[Name] | None = Field(max_length=256)


class DeploymentAssignment(Schema):
    """``PUT /v1/deployments/{name}/assignment`` (operator): the nodes whose enrolled labels match are assigned it."""

    selector: dict[str, str] | None = Field(
        description="node labels (e.g. {'cluster': 'c1'}); {} matches every node; null: no selector", max_length=16
    )


class NodeEnrolRequest(NodeRegistration):
    """A node enrolling with an enrolment token, optionally proposing the node token it will use.

    An agent generates its node token and stores it *before* asking, so a lost answer costs
    nothing: on retry it re-registers with that token. Without ``token`` the control plane mints one.
    """

    token: str | None = Field(
        default=None,
        pattern=r"^ws_[A-Za-z0-9_-]{40,100}$",
        description="the node token to bind to this node (ws_ and at least 40 url-safe random chars)",
    )


class NodeEnrolment(Schema):
    """A node enrolled with an enrolment token: the node, and its own token, shown once."""

    node: NodeInfo
    token_id: str
    token: str = Field(description="the node token: acts for this node only; store it, it is not shown again")
