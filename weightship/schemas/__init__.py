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

The schemas live in one module per API area (``base``, ``publishing``, ``deployments``, ``fleet``,
``serving``, ``tokens``, ``tickets``, ``local``, ``tracker``, ``rollouts``); import them from here.
"""

from __future__ import annotations

from weightship.schemas.base import (
    INT64_MAX,
    ErrorBody,
    ErrorDetail,
    Role,
)
from weightship.schemas.deployments import (
    Deployment,
    DeploymentCreate,
    PointerEvent,
    PointerUpdate,
    RollbackRequest,
    Selector,
    WarmPool,
)
from weightship.schemas.fleet import (
    BlobURL,
    BlobURLRequest,
    BlobURLs,
    DeploymentAssignment,
    DeploymentState,
    DeploymentStatus,
    DesiredDeployment,
    DesiredState,
    FetchFailure,
    FetchProblem,
    NodeAssignment,
    NodeCounters,
    NodeEnrolment,
    NodeEnrolRequest,
    NodeHealth,
    NodeHeartbeat,
    NodeInfo,
    NodeLabels,
    NodeProblem,
    NodeRegistration,
    Preheat,
    PreheatCreate,
    SourceTally,
    StagedVersion,
    SwitchHookResult,
    ValidationCheck,
    ValidationReport,
    VersionInventory,
    VersionState,
    VersionStatus,
)
from weightship.schemas.local import (
    LocalDeployment,
    LocalLease,
    LocalVersion,
    LocalVersionState,
)
from weightship.schemas.publishing import (
    BlobUpload,
    LabelCreate,
    ModelInfo,
    PartUpload,
    UploadCreate,
    UploadSession,
    VersionInfo,
)
from weightship.schemas.rollouts import (
    BuiltinMeasure,
    BuiltinMeasurement,
    NodeLoads,
    Rollout,
    RolloutAction,
    RolloutAnalysisRun,
    RolloutCreate,
    RolloutList,
    RolloutMeasurement,
    RolloutMetric,
    RolloutStep,
    VersionLoads,
)
from weightship.schemas.serving import (
    SERVE_COUNTERS,
    SERVE_LATENCY_BOUNDS,
    NodeServeMetrics,
    ServeCounters,
    ServeReport,
    VersionServeMetrics,
    counters_reset,
)
from weightship.schemas.tickets import (
    TicketGrant,
    TicketKeys,
    TicketRequest,
)
from weightship.schemas.tokens import (
    TokenCreate,
    TokenCreated,
    TokenInfo,
)
from weightship.schemas.tracker import (
    TrackerAnnounce,
    TrackerAvailability,
    TrackerHave,
    TrackerReport,
    TrackerSource,
    TrackerSources,
)

__all__ = [
    "INT64_MAX",
    "SERVE_COUNTERS",
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
    "counters_reset",
]
