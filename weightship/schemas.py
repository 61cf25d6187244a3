"""HTTP schemas: the one definition of every request and response body weightship exchanges.

The control plane, the agent, the CLI and the model server all speak these. Route list
(all under ``/v1``, bearer token required; role in brackets, ``admin`` may do everything):

Publishing [publisher]
    POST   /v1/uploads                              UploadCreate  -> UploadSession
    GET    /v1/uploads/{id}                                       -> UploadSession
    PUT    /v1/uploads/{id}/blobs/{sha256}/parts/{n}  raw chunk   -> 204   (local store only)
    POST   /v1/uploads/{id}/commit                                -> VersionInfo
    DELETE /v1/uploads/{id}                                       -> 204
Registry [any role]
    GET    /v1/models                                             -> list[ModelInfo]
    GET    /v1/models/{model}/versions                            -> list[VersionInfo]
    GET    /v1/models/{model}/versions/{ref}                      -> VersionInfo (ref: label or sha256:…)
    GET    /v1/models/{model}/versions/{ref}/manifest             -> manifest bytes exactly as stored
    POST   /v1/models/{model}/labels               LabelCreate    -> VersionInfo [publisher]
Deployments [reads: any role; writes: operator]
    POST   /v1/deployments                         DeploymentCreate -> Deployment
    GET    /v1/deployments                                        -> list[Deployment]
    GET    /v1/deployments/{name}                                 -> Deployment, ETag: "<epoch>"
    PUT    /v1/deployments/{name}/pointer  If-Match PointerUpdate -> Deployment (412 stale, 428 no If-Match)
    POST   /v1/deployments/{name}/rollback [If-Match] RollbackRequest -> Deployment
    GET    /v1/deployments/{name}/history                         -> list[PointerEvent]
    GET    /v1/deployments/{name}/status                          -> DeploymentStatus
    PUT    /v1/deployments/{name}/warm-pool        WarmPool       -> Deployment
    DELETE /v1/deployments/{name}/warm-pool                       -> Deployment
    POST   /v1/deployments/{name}/preheats         PreheatCreate  -> Preheat (201)
    GET    /v1/deployments/{name}/preheats                        -> list[Preheat] (with progress)
    DELETE /v1/deployments/{name}/preheats/{id}                   -> 204
Fleet [node calls: that node's own node token; blob URLs: a node token (its entitled blobs) or operator; reads: any role but an enrolment token]
    POST   /v1/nodes/enrol                         NodeEnrolRequest -> NodeEnrolment (201) [enrolment token]
    POST   /v1/nodes/register                      NodeRegistration -> NodeInfo
    POST   /v1/nodes/{id}/heartbeat                NodeHeartbeat    -> 204
    GET    /v1/nodes/{id}/desired?after=REV&wait=S                  -> DesiredState (long-poll)
    POST   /v1/blobs/urls                          BlobURLRequest   -> BlobURLs
    GET    /v1/nodes                                                -> list[NodeInfo]
    PUT    /v1/nodes/{id}/assignment               NodeAssignment   -> NodeInfo [operator]
    PUT    /v1/deployments/{name}/assignment       DeploymentAssignment -> DeploymentAssignment [operator]
Tickets [issue: that node's own node token; keys: any role]
    POST   /v1/tickets                             TicketRequest    -> TicketGrant (403: not entitled)
    GET    /v1/tickets/keys                                         -> TicketKeys
Rollouts [reads: any role; create: operator, or publisher where the deployment allows it; verbs: operator]
    POST   /v1/deployments/{name}/rollouts         RolloutCreate    -> Rollout (201; 409 rollout_active)
    GET    /v1/deployments/{name}/rollouts                          -> RolloutList (newest first)
    GET    /v1/deployments/{name}/rollouts/{id}                     -> Rollout (id "current": active, else latest)
    POST   /v1/deployments/{name}/rollouts/{id}/actions RolloutAction -> Rollout (409 rollout_verb)
    GET    /v1/rollouts?active=true                                 -> RolloutList
    POST   /v1/deployments/{name}/analysis/builtin BuiltinMeasure   -> BuiltinMeasurement (operator)
    GET    /v1/deployments/{name}/analysis/loads?digest=            -> VersionLoads (operator)
Tokens [admin]
    POST   /v1/tokens                              TokenCreate      -> TokenCreated
    GET    /v1/tokens                                               -> list[TokenInfo]
    DELETE /v1/tokens/{id}                                          -> 204
    GET    /v1/tokens/self                                          -> TokenInfo (any role)
Unauthenticated operations endpoints: /healthz, /readyz, /metrics.

Errors are ``ErrorBody``: ``{"error": {"code": ..., "message": ...}}``.

The agent's local API (for model servers on the same host, no token; bound to localhost or a
unix socket) lives under ``/local/v1``:
    GET  /local/v1/deployments                              -> list[LocalDeployment]
    GET  /local/v1/deployments/{name}                       -> LocalDeployment
    GET  /local/v1/deployments/{name}/wait?after_epoch=N&timeout=S -> LocalDeployment (204 on timeout)
    POST /local/v1/validation                 ValidationReport -> 204
    POST /local/v1/serve-metrics              ServeReport      -> 204 (cumulative counters, pushed periodically)
    GET  /local/v1/status                                   -> NodeHeartbeat (the agent's own report)
    GET  /local/v1/versions/{digest}?deployment=D          -> LocalVersion (asks the agent to stage it)
    GET  /local/v1/versions/{digest}/wait?deployment=D&timeout=S -> LocalVersion once ready, or on timeout
    PUT  /local/v1/leases/{holder}            LocalLease       -> LocalVersion (never evicted while leased)
    DELETE /local/v1/leases/{holder}                           -> 204
"""

from __future__ import annotations

import itertools
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from weightship.modelrollout import RolloutVerb

__all__ = [
    "INT64_MAX",
    "SERVE_LATENCY_BOUNDS",
    "BlobURL",
    "BlobURLRequest",
    "BlobURLs",
    "BlobUpload",
    "BuiltinMeasure",
    "BuiltinMeasurement",
    "Deployment",
    "DeploymentAssignment",
    "DeploymentCreate",
    "DeploymentState",
    "DeploymentStatus",
    "DesiredDeployment",
    "DesiredState",
    "ErrorBody",
    "ErrorDetail",
    "FetchFailure",
    "FetchProblem",
    "LabelCreate",
    "LocalDeployment",
    "LocalLease",
    "LocalVersion",
    "LocalVersionState",
    "ModelInfo",
    "NodeAssignment",
    "NodeCounters",
    "NodeEnrolRequest",
    "NodeEnrolment",
    "NodeHealth",
    "NodeHeartbeat",
    "NodeInfo",
    "NodeLabels",
    "NodeLoads",
    "NodeProblem",
    "NodeRegistration",
    "NodeServeMetrics",
    "PartUpload",
    "PointerEvent",
    "PointerUpdate",
    "Preheat",
    "PreheatCreate",
    "Role",
    "RollbackRequest",
    "Rollout",
    "RolloutAction",
    "RolloutAnalysisRun",
    "RolloutCreate",
    "RolloutList",
    "RolloutMeasurement",
    "RolloutMetric",
    "RolloutStep",
    "Selector",
    "ServeCounters",
    "ServeReport",
    "SourceTally",
    "StagedVersion",
    "SwitchHookResult",
    "TicketGrant",
    "TicketKeys",
    "TicketRequest",
    "TokenCreate",
    "TokenCreated",
    "TokenInfo",
    "TrackerAnnounce",
    "TrackerAvailability",
    "TrackerHave",
    "TrackerReport",
    "TrackerSource",
    "TrackerSources",
    "UploadCreate",
    "UploadSession",
    "ValidationCheck",
    "ValidationReport",
    "VersionInfo",
    "VersionInventory",
    "VersionLoads",
    "VersionServeMetrics",
    "VersionState",
    "VersionStatus",
    "WarmPool",
]

Digest = Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
HexDigest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Name = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,127}$")]
Label = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
Share = Annotated[float, Field(ge=0.0, le=1.0)]
#: the largest integer any field takes: what a signed 64-bit database column (BigInteger) holds
INT64_MAX = 2**63 - 1
#: a count, size, offset or epoch: never negative, never beyond a 64-bit column
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
#: a finite, non-negative measurement (seconds, GB/s)
Measure = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Role(StrEnum):
    """What a token may do; ``admin`` may do everything."""

    publisher = "publisher"
    operator = "operator"
    agent = "agent"
    admin = "admin"
    read = "read"  # reads every GET route (and the status page at /ui/), writes nothing


class ErrorDetail(_Schema):
    """What went wrong, for people (message) and programs (code)."""

    code: str
    message: str


class ErrorBody(_Schema):
    """Body of every non-2xx response."""

    error: ErrorDetail


# --- publishing -------------------------------------------------------------------------------


class UploadCreate(_Schema):
    """Open (or resume) a publish session for a manifest."""

    manifest: str = Field(description="the canonical manifest JSON, exactly the bytes to be stored")
    labels: list[Label] = Field(default_factory=list)
    allow_pickle: bool = False


class PartUpload(_Schema):
    """One part (= one chunk) of a blob to upload: PUT the chunk's bytes to ``url``."""

    number: int = Field(ge=1, le=INT64_MAX, description="1-based part number; chunk index + 1")
    offset: Count
    length: Count
    sha256: HexDigest
    url: str = Field(description="absolute URL, or a path relative to the API base")
    headers: dict[str, str] = Field(default_factory=dict, description="headers the PUT must carry")
    done: bool = False


class BlobUpload(_Schema):
    """A file's blob: already in the store, or the parts still to upload."""

    sha256: HexDigest
    size: Count
    present: bool
    method: str = Field(description="'s3-multipart' or 'http-put'")
    parts: list[PartUpload] = Field(default_factory=list)


class UploadSession(_Schema):
    """A publish session: upload the missing parts, then commit."""

    id: str
    model: Name
    digest: Digest
    state: str = Field(description="'open', 'committed' or 'aborted'")
    expires_at: datetime
    labels: list[Label]
    blobs: list[BlobUpload]
    bytes_total: Count
    bytes_missing: Count


class VersionInfo(_Schema):
    """A published, immutable version."""

    model: Name
    digest: Digest
    labels: list[Label]
    state: str
    size: Count
    files: Count
    created_at: datetime
    created_by: str


class LabelCreate(_Schema):
    """Attach a label to a ready version; labels never move once set."""

    label: Label
    digest: Digest


class ModelInfo(_Schema):
    """A model and its version count."""

    name: Name
    versions: Count
    allow_pickle: bool = False
    created_at: datetime


# --- deployments and pointers -------------------------------------------------------------------


#: a node selector: label name (a ``NodeLabels`` field) -> required value; empty matches every node
Selector = dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")], Annotated[str, Field(max_length=128)]]


class WarmPool(_Schema):
    """Nodes (matched by ``selector``) that keep a deployment's stable and canary versions staged, not served."""

    selector: Selector = Field(max_length=16)


class DeploymentCreate(_Schema):
    """Create a deployment of a model; it serves nothing until its pointer is set."""

    name: Name
    model: Name
    #: whether a ``publisher`` token may start rollouts of this deployment (operators always may)
    publisher_rollouts: bool = False
    warm_pool: WarmPool | None = None


class Deployment(_Schema):
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


class PointerUpdate(_Schema):
    """Set the pointer; refs are labels or digests of ready versions of the deployment's model."""

    stable: str
    canary: str | None = None
    canary_share: Share = 0.0
    reason: str = Field(default="", max_length=1024)


class RollbackRequest(_Schema):
    """Roll back to the previous stable version, or to ``to`` (label or digest)."""

    to: str | None = None
    reason: str = Field(default="", max_length=1024)


class PointerEvent(_Schema):
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


# --- fleet -------------------------------------------------------------------------------------


class NodeLabels(_Schema):
    """Where a node sits; used for canary selection and choosing peers and caches."""

    region: str = "default"
    cluster: str = "default"
    zone: str = "default"
    rack: str = "default"
    gpu_type: str = "none"


class NodeRegistration(_Schema):
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
    error = "error"  # anything else; the message says what


class FetchProblem(_Schema):
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


class VersionInventory(_Schema):
    """One version on a node's disk."""

    digest: Digest
    state: VersionState
    bytes_total: Count
    bytes_present: Count
    error: str | None = None
    problem: FetchProblem | None = None


class SwitchHookResult(_Schema):
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


class DeploymentState(_Schema):
    """What a node serves for a deployment right now."""

    name: Name
    digest: Digest | None
    epoch: Count
    hook: SwitchHookResult | None = Field(default=None, description="its switch hook's last call, when one is set")


class SourceTally(_Schema):
    """What one chunk source (local, peer, cluster_cache, region_cache, origin) delivered to a node."""

    bytes: Count = 0
    chunks: Count = 0
    errors: Count = 0


class NodeCounters(_Schema):
    """Monotonic byte counters since the agent started."""

    bytes_downloaded: Count = 0
    bytes_from_peers: Count = 0
    bytes_copied_locally: Count = 0
    chunks_rejected: Count = 0
    #: per source, nearest first: local, peer, cluster_cache, region_cache, origin
    sources: dict[str, SourceTally] = Field(default_factory=dict)


class NodeHealth(_Schema):
    """Node health as the agent sees it."""

    disk_total: Count = 0
    disk_free: Count = 0
    quota_bytes: Count = 0
    used_bytes: Count = 0
    errors: list[str] = Field(default_factory=list)


class ValidationCheck(_Schema):
    """One check of a loaded model (smoke test, NaN/Inf scan, ...)."""

    name: str
    passed: bool
    detail: str = ""


class ValidationReport(_Schema):
    """What a model server found when it loaded and validated a version."""

    deployment: Name
    digest: Digest
    passed: bool
    checks: list[ValidationCheck] = Field(default_factory=list)
    load_seconds: Measure = 0.0
    load_gbps: Measure = 0.0
    at: datetime | None = None


#: upper bounds (seconds) of the model servers' latency histogram buckets; a last, implicit +Inf follows
SERVE_LATENCY_BOUNDS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeCounters(_Schema):
    """One version's cumulative serving counters, as a model server (or a node's sum of them) counts them.

    Counters only grow while their counter (a model server, an agent) lives; a restart starts them
    from 0 again, which readers detect (a counter lower than before, or a new ``since``/instance).
    ``latency_le`` is the cumulative latency histogram over ``SERVE_LATENCY_BOUNDS`` plus +Inf
    (``latency_le[i]``: requests answered within bound ``i``); empty when nothing was observed.
    """

    digest: Digest
    requests: Count = Field(default=0, description="inference requests this version answered (any status)")
    errors: Count = Field(default=0, description="of those, server-side failures (5xx)")
    latency_le: list[Count] = Field(default_factory=list, max_length=len(SERVE_LATENCY_BOUNDS) + 1)
    latency_sum: Measure = 0.0
    load_failures: Count = Field(default=0, description="loads of this version that failed (start-up failures)")
    validations_passed: Count = 0
    validations_failed: Count = Field(default=0, description="loads whose validation (golden check, NaN scan) failed")
    queue_depth: Count = Field(default=0, description="gauge: requests waiting for this version right now")

    @model_validator(mode="after")
    def _histogram_shape(self) -> ServeCounters:
        le = self.latency_le
        if le and (len(le) != len(SERVE_LATENCY_BOUNDS) + 1 or any(b < a for a, b in itertools.pairwise(le))):
            raise ValueError(
                f"latency_le must hold {len(SERVE_LATENCY_BOUNDS) + 1} cumulative (non-decreasing) bucket counts"
            )
        return self


class ServeReport(_Schema):
    """``POST /local/v1/serve-metrics``: a model server's cumulative counters per version, pushed periodically.

    ``instance`` names the model-server process (random per start); the agent turns a new instance
    or a counter that went down into a reset, so a restarted server never makes rates negative.
    """

    deployment: Name
    instance: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    versions: list[ServeCounters] = Field(default_factory=list, max_length=32)


class VersionServeMetrics(ServeCounters):
    """A node's serving counters for one deployment and version: the sum over its model servers."""

    deployment: Name
    instances: Count = Field(default=0, description="model servers on the node that reported this version")


class NodeServeMetrics(_Schema):
    """What a node's model servers reported, summed per deployment and version (in the heartbeat).

    Counters are monotonic from ``since`` (when the agent started counting); a changed ``since``
    means they restarted from 0.
    """

    since: datetime
    versions: list[VersionServeMetrics] = Field(default_factory=list, max_length=32)


class NodeHeartbeat(_Schema):
    """Periodic report of inventory, what is served, counters and health."""

    inventory: list[VersionInventory] = Field(default_factory=list)
    deployments: list[DeploymentState] = Field(default_factory=list)
    counters: NodeCounters = Field(default_factory=NodeCounters)
    health: NodeHealth = Field(default_factory=NodeHealth)
    validation: list[ValidationReport] = Field(default_factory=list)
    refused: list[str] = Field(default_factory=list, description="pointer updates refused (e.g. lower epoch)")
    serve: NodeServeMetrics | None = Field(default=None, description="model servers' counters per version")


class NodeInfo(_Schema):
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


class DesiredDeployment(_Schema):
    """What one deployment wants this node to serve."""

    name: Name
    model: Name
    digest: Digest | None
    epoch: Count
    role: str = Field(description="'stable' or 'canary': which side of the split this node is on")
    keep: list[Digest] = Field(description="versions to keep on disk: stable, previous stable, canary")


class StagedVersion(_Schema):
    """A version a node fetches and verifies but does not serve (a preheat or a warm pool asks it)."""

    model: Name
    digest: Digest


class DesiredState(_Schema):
    """The whole desired state of a node; ``revision`` changes whenever any part does."""

    node_id: str
    revision: str
    deployments: list[DesiredDeployment]
    stage: list[StagedVersion] = Field(default_factory=list, description="versions to hold verified, not served")


class PreheatCreate(_Schema):
    """Stage a ready version of a deployment's model on the nodes ``selector`` matches, without switching."""

    version: str = Field(min_length=1, max_length=200, description="label or sha256 digest of a ready version")
    selector: Selector = Field(default_factory=dict, max_length=16)


class Preheat(_Schema):
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


class BlobURLRequest(_Schema):
    """Ask for short-lived read URLs of blobs (by file sha256)."""

    blobs: list[HexDigest] = Field(max_length=10_000)


class BlobURL(_Schema):
    """A short-lived URL that serves one blob with HTTP range requests; no credentials needed."""

    url: str
    expires_at: datetime


class BlobURLs(_Schema):
    """Read URLs by blob sha256."""

    urls: dict[str, BlobURL]


class NodeProblem(_Schema):
    """One node's fetch problem with a version, as ``GET /v1/deployments/{name}/status`` lists it."""

    node: Name
    state: VersionState
    problem: FetchProblem


class VersionStatus(_Schema):
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


class DeploymentStatus(_Schema):
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


class NodeAssignment(_Schema):
    """``PUT /v1/nodes/{id}/assignment`` (operator): the deployments the node may fetch for; null: all."""

    deployments: list[Name] | None = Field(max_length=256)


class DeploymentAssignment(_Schema):
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


class NodeEnrolment(_Schema):
    """A node enrolled with an enrolment token: the node, and its own token, shown once."""

    node: NodeInfo
    token_id: str
    token: str = Field(description="the node token: acts for this node only; store it, it is not shown again")


# --- tokens ------------------------------------------------------------------------------------


class TokenCreate(_Schema):
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


class TokenInfo(_Schema):
    """A token without its secret."""

    id: str
    name: str
    role: Role
    created_at: datetime
    created_by: str
    node_id: str | None = Field(default=None, description="the node a node token acts for")
    deployments: list[str] | None = Field(default=None, description="an enrolment token's scope (null: all)")
    node_role: str | None = Field(default=None, description="the role an enrolment token's nodes get (null: node)")


class TokenCreated(_Schema):
    """A new token; ``token`` is shown once and only its hash is stored."""

    id: str
    name: str
    role: Role
    token: str


# --- entitlement tickets (weightship.tickets) ---------------------------------------------------


class TicketRequest(_Schema):
    """A node asks for a ticket naming itself and these versions."""

    versions: list[Digest] = Field(min_length=1, max_length=256)
    audience: Name | None = Field(
        default=None,
        description="the node (peer, cache or tracker) the ticket will be sent to; only it accepts the ticket",
    )


class TicketKeys(_Schema):
    """The public keys tickets are signed with: key id -> raw ed25519 public key, base64url."""

    keys: dict[str, str]


class TicketGrant(_Schema):
    """A signed ticket, what it names, and the keys that verify tickets (so holders need no second call)."""

    ticket: str = Field(description="send as 'Authorization: Ticket <ticket>' to peers, caches and the tracker")
    node: Name
    versions: list[Digest]
    audience: str | None = None
    expires_at: datetime
    keys: dict[str, str] = Field(description="key id -> raw ed25519 public key, base64url")


# --- agent local API ---------------------------------------------------------------------------


class LocalDeployment(_Schema):
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


class LocalVersion(_Schema):
    """A version by digest, as a model server pinned to it sees it (``GET /local/v1/versions/{digest}``)."""

    digest: Digest
    deployment: Name | None = Field(default=None, description="the deployment it was asked for")
    state: LocalVersionState
    path: str | None = Field(default=None, description="absolute path of the version directory, once ready")
    reason: str = Field(default="", max_length=4096, description="why it is not ready, and what to do")
    bytes_total: Count = 0
    bytes_present: Count = 0


class LocalLease(_Schema):
    """``PUT /local/v1/leases/{holder}``: a model server serves (or is about to serve) ``digest``.

    While the lease lives the agent never evicts the version, and stages it like an ask; the holder
    renews it before ``seconds`` pass (a server that died stops renewing, and the lease lapses).
    """

    deployment: Name
    digest: Digest
    seconds: float = Field(default=30.0, ge=1.0, le=3600.0, allow_inf_nan=False)


# --- tracker (in the cluster cache; agent.tracker_api) ---------------------------------------------


class TrackerHave(_Schema):
    """The chunks of one version a node holds, verified."""

    have: str = Field(
        max_length=1_400_000,
        description="base64 bitmap over the version's chunk order (bit i, MSB first, set: chunk i held)",
    )


class TrackerAnnounce(_Schema):
    """``POST /v1/tracker/announce``: what a node holds, batched over versions; re-sent periodically."""

    node: Name
    address: str = Field(pattern=r"^https?://", max_length=512)
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    upload_slots_free: Count = 0
    versions: dict[Digest, TrackerHave] = Field(max_length=256)


class TrackerSource(_Schema):
    """A parent to fetch a chunk from."""

    node: Name
    address: str


class TrackerSources(_Schema):
    """``GET /v1/tracker/sources``: ranked parents; with none, whether to go up a tier or wait."""

    sources: list[TrackerSource]
    upstream_allowed: bool
    retry_after: Measure = 0.0


class TrackerAvailability(_Schema):
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


class TrackerReport(_Schema):
    """``POST /v1/tracker/report``: a parent served corrupt or slow data, or refused."""

    node: Name
    version: Digest
    chunk: HexDigest
    reason: Literal["corrupt", "slow", "refused"]


# --- rollouts ------------------------------------------------------------------------------------


class BuiltinMeasure(_Schema):
    """``POST /v1/deployments/{name}/analysis/builtin``: one built-in measurement, canary against stable, by digest.

    For a rollout driven outside the control plane (the Kubernetes operator): the control plane
    measures from the serving counters it holds (``docs/rollouts.md``, provider ``builtin``).
    """

    metric: str = Field(description="the analysis metric's name (messages name it)")
    provider: dict[str, Any] = Field(description="the metric's builtin settings: metric, minRequests, window, timeout")
    canary: Digest
    stable: Digest | None = None


class BuiltinMeasurement(_Schema):
    """The answer: the measured ``value`` (a mapping, see ``docs/rollouts.md``), or null when there is no data."""

    value: dict[str, float] | None = None


class NodeLoads(_Schema):
    """How one node's model servers fared loading a version of a deployment (their summed counters)."""

    node: Name
    loaded: bool = Field(description="a load passed validation, or a request was answered with the version")
    failures: Count = Field(description="loads that failed or failed validation (golden check, NaN scan)")


class VersionLoads(_Schema):
    """``GET /v1/deployments/{name}/analysis/loads?digest=``: the loads of ``digest`` on every live node reporting it.

    For a rollout driven outside the control plane (the Kubernetes operator): a canary whose model
    servers keep refusing it never serves, so the rollout aborts at once. Counters are cumulative
    per agent; a reader keeps its own baseline to count only the failures of its attempt.
    """

    digest: Digest
    nodes: list[NodeLoads] = Field(default_factory=list)



class RolloutCreate(_Schema):
    """``POST /v1/deployments/{name}/rollouts``: the engine spec (``version``, ``steps``, ...; see docs/rollouts.md).

    ``spec.version`` may be a label or a ``sha256:`` digest of a ready version of the deployment's model.
    """

    spec: dict[str, Any]


class RolloutStep(_Schema):
    """One step of a rollout, as ``status`` shows it."""

    index: int
    kind: Literal["setWeight", "pause", "analysis", "prefetch"]
    summary: str
    state: Literal["done", "current", "pending"]


class RolloutMeasurement(_Schema):
    """One measurement of one metric: its verdict and the provider's value (or why there is none)."""

    index: int
    phase: str
    value: Any = None
    started_at: datetime
    finished_at: datetime | None = None
    message: str = ""


class RolloutMetric(_Schema):
    """One metric of an analysis run with every measurement taken."""

    name: str
    phase: str
    measurements: list[RolloutMeasurement]


class RolloutAnalysisRun(_Schema):
    """The analysis of one step: ``Running``, then ``Successful``, ``Failed``, ``Inconclusive`` or ``Error``."""

    id: str
    step_index: int
    phase: str
    metrics: list[RolloutMetric]


class Rollout(_Schema):
    """A rollout of one version of a deployment, with where it is and what it measured.

    ``weight`` is the canary percent now (0-100); ``nodes`` counts the target nodes serving each
    digest; ``staged_nodes`` hold ``version`` verified on disk; ``status`` is the engine's stored
    status (schema 1), ``spec`` the spec as created (``version`` resolved to a digest).
    """

    id: str
    deployment: Name
    model: Name
    version: Digest
    stable: Digest | None
    phase: Literal["Progressing", "Paused", "Degraded", "Healthy"]
    message: str
    completed: bool
    aborted: bool
    step_index: int
    steps_total: int
    steps: list[RolloutStep]
    weight: float
    attempt: int
    analysis_runs: list[RolloutAnalysisRun]
    nodes: dict[str, int]
    staged_nodes: int
    target_nodes: int
    spec: dict[str, Any]
    status: dict[str, Any]
    created_at: datetime
    created_by: str
    updated_at: datetime


class RolloutList(_Schema):
    """Rollouts, newest first."""

    rollouts: list[Rollout]


class RolloutAction(_Schema):
    """``POST .../rollouts/{id}/actions``: a verb; the next reconcile acts on it."""

    verb: RolloutVerb
