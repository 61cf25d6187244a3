"""The REST client of the control plane: one typed method per route, built on the HTTP core.

``Client`` wraps a synchronous ``weightship.http.Session``: the token goes only to the control
plane's own origin (part uploads may go straight to S3 on presigned URLs, which carry their own
signature), every non-2xx answer becomes a ``WeightshipError`` subclass through the one error
mapping (``weightship.problems``: problem details, the older error body, S3's XML), and a refused
connection or timeout becomes a ``TemporaryError`` that names the URL and the flag to check. Its
test seam is the ``transport`` argument (an ``httpx.MockTransport`` in unit tests).

Reads (GET) are retried with capped exponential backoff on temporary failures; writes are not,
because repeating a write whose answer was lost is not always harmless (a pointer update would
come back 412). ``publish_directory`` runs the whole upload protocol (``publishing.py``), which
needs only the ``UploadAPI`` methods this client implements.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel

from weightship.backoff import Backoff
from weightship.chunks import DEFAULT_CHUNK_SIZE
from weightship.errors import NotFoundError, ValidationError
from weightship.http import Params, Session, parse, parse_list, segment
from weightship.modelrollout import VERBS
from weightship.publishing import PublishProgress, PublishResult, publish_directory
from weightship.schemas import (
    BlobURLRequest,
    BlobURLs,
    BuiltinMeasure,
    BuiltinMeasurement,
    Deployment,
    DeploymentCreate,
    DeploymentStatus,
    DesiredState,
    LabelCreate,
    ModelInfo,
    NodeEnrolment,
    NodeEnrolRequest,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistration,
    PartUpload,
    PointerEvent,
    PointerUpdate,
    Preheat,
    PreheatCreate,
    Role,
    RollbackRequest,
    Rollout,
    RolloutAction,
    RolloutCreate,
    RolloutList,
    TokenCreate,
    TokenCreated,
    TokenInfo,
    UploadCreate,
    UploadSession,
    VersionInfo,
    VersionLoads,
    WarmPool,
)
from weightship.signing import SignatureUpload, VersionSignatures

__all__ = ["DEFAULT_URL", "Backoff", "Client"]

DEFAULT_URL = "http://127.0.0.1:8080"
_T = TypeVar("_T", bound=BaseModel)


class Client:
    """Typed access to every control-plane route (see ``weightship.schemas`` for the list).

    Use as a context manager, or call ``close()``::

        with Client("http://127.0.0.1:8080", token) as client:
            client.rollback("chat-prod", reason="p99 regression")
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 30.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.session = Session(
            base_url,
            token,
            service="the control plane",
            advice="check the URL (--url / WEIGHTSHIP_URL) and that the control plane is running",
            transport=transport,
            timeout=timeout,
            backoff=backoff or Backoff(),
        )
        self.base_url = self.session.base_url
        self.token = self.session.token
        self.backoff = self.session.backoff
        self.timeout = timeout

    # --- plumbing ----------------------------------------------------------------------------

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close pooled connections."""
        self.session.close()

    def _get(self, path: str, schema: type[_T], **params: str | int | float) -> _T:
        return parse(schema, self.session.send("GET", path, params=params or None))

    def _list(self, path: str, schema: type[_T], params: Params | None = None) -> list[_T]:
        return parse_list(schema, self.session.send("GET", path, params=params))

    # --- publishing ---------------------------------------------------------------------------

    def create_upload(
        self, manifest: bytes, labels: Sequence[str] = (), *, allow_pickle: bool = False
    ) -> UploadSession:
        """Open (or resume) the publish session of a manifest given as its canonical bytes."""
        request = UploadCreate(manifest=manifest.decode("utf-8"), labels=list(labels), allow_pickle=allow_pickle)
        # Opening is idempotent by design (same manifest -> same session), so it may be retried.
        return parse(UploadSession, self.session.send("POST", "/v1/uploads", json=request, retry=True))

    def get_upload(self, upload_id: str) -> UploadSession:
        """A publish session, with fresh part URLs and which parts are done."""
        return self._get(f"/v1/uploads/{segment(upload_id)}", UploadSession)

    def upload_part(self, part: PartUpload, data: bytes) -> None:
        """PUT one part's bytes to its URL with the headers the session asked for (no retry here)."""
        self.session.send("PUT", part.url, content=data, headers=dict(part.headers), retry=False)

    def commit_upload(self, upload_id: str, signatures: Sequence[bytes] = ()) -> VersionInfo:
        """Ask the control plane to verify every blob and make the version ready, with ``signatures``."""
        body = SignatureUpload(signatures=[s.decode("utf-8") for s in signatures]) if signatures else None
        # The server may re-hash every byte before answering, so reading may take long.
        response = self.session.send(
            "POST",
            f"/v1/uploads/{segment(upload_id)}/commit",
            json=body,
            timeout=self.session.read_timeout(3600.0),
        )
        return parse(VersionInfo, response)

    def signatures(self, model: str, ref: str) -> VersionSignatures:
        """Every signature stored for version ``ref`` of ``model``."""
        path = f"/v1/models/{segment(model)}/versions/{segment(ref)}/signatures"
        return parse(VersionSignatures, self.session.send("GET", path))

    def add_signatures(self, model: str, ref: str, signatures: Sequence[bytes]) -> VersionSignatures:
        """Add ``signatures`` (model-signing bundles) to version ``ref``: checked and stored write-once."""
        path = f"/v1/models/{segment(model)}/versions/{segment(ref)}/signatures"
        body = SignatureUpload(signatures=[s.decode("utf-8") for s in signatures])
        return parse(VersionSignatures, self.session.send("POST", path, json=body))

    def abort_upload(self, upload_id: str) -> None:
        """Abandon a publish session; uploaded parts are discarded."""
        self.session.send("DELETE", f"/v1/uploads/{segment(upload_id)}")

    def publish_directory(
        self,
        path: Path | str,
        model: str,
        labels: Sequence[str] = (),
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        allow_pickle: bool = False,
        metadata: dict[str, str] | None = None,
        concurrency: int = 8,
        progress: PublishProgress | None = None,
        backoff: Backoff | None = None,
        signatures: Sequence[bytes] = (),
        sign_key: bytes | None = None,
    ) -> PublishResult:
        """Build the manifest of ``path`` and publish it: hash, open a session, upload, commit.

        Only blobs the store lacks are uploaded, parts already done are skipped (so running it
        again after a failure resumes), and ``progress`` hears about both phases. Each part is
        retried on temporary failures with ``backoff`` (default: 5 attempts).
        """
        return publish_directory(
            self,
            Path(path),
            model,
            labels,
            chunk_size=chunk_size,
            allow_pickle=allow_pickle,
            metadata=metadata,
            concurrency=concurrency,
            progress=progress,
            backoff=backoff,
            signatures=signatures,
            sign_key=sign_key,
        )

    # --- registry ----------------------------------------------------------------------------

    def list_models(self) -> list[ModelInfo]:
        """Every model with its version count."""
        return self._list("/v1/models", ModelInfo)

    def list_versions(self, model: str) -> list[VersionInfo]:
        """Every ready version of ``model``."""
        return self._list(f"/v1/models/{segment(model)}/versions", VersionInfo)

    def get_version(self, model: str, ref: str) -> VersionInfo:
        """One version of ``model`` by label or ``sha256:`` digest."""
        return self._get(f"/v1/models/{segment(model)}/versions/{segment(ref)}", VersionInfo)

    def get_manifest(self, model: str, ref: str) -> bytes:
        """The manifest bytes of a version exactly as stored (hash them to check the digest)."""
        return self.session.send("GET", f"/v1/models/{segment(model)}/versions/{segment(ref)}/manifest").content

    def label_digest(self, model: str, label: str) -> str | None:
        """The digest ``label`` of ``model`` names, or ``None`` while it is free (also when the model is new)."""
        try:
            return self.get_version(model, label).digest
        except NotFoundError:
            return None

    def add_label(self, model: str, label: str, digest: str) -> VersionInfo:
        """Attach ``label`` to a ready version; labels never move once set."""
        body = LabelCreate(label=label, digest=digest)
        return parse(VersionInfo, self.session.send("POST", f"/v1/models/{segment(model)}/labels", json=body))

    # --- deployments ---------------------------------------------------------------------------

    def create_deployment(self, name: str, model: str, *, warm_pool: dict[str, str] | None = None) -> Deployment:
        """Create a deployment of ``model`` (with a warm pool's node selector); it serves nothing until its pointer is set."""
        pool = WarmPool(selector=warm_pool) if warm_pool is not None else None
        body = DeploymentCreate(name=name, model=model, warm_pool=pool)
        return parse(Deployment, self.session.send("POST", "/v1/deployments", json=body))

    def set_warm_pool(self, name: str, selector: dict[str, str] | None) -> Deployment:
        """Declare the warm pool of ``name`` (nodes matching ``selector`` keep stable and canary staged); ``None`` drops it."""
        path = f"/v1/deployments/{segment(name)}/warm-pool"
        if selector is None:
            return parse(Deployment, self.session.send("DELETE", path))
        return parse(Deployment, self.session.send("PUT", path, json=WarmPool(selector=selector)))

    def preheat(self, name: str, version: str, selector: dict[str, str] | None = None) -> Preheat:
        """Stage ``version`` (label or digest) of ``name``'s model on the nodes ``selector`` matches, without switching."""
        body = PreheatCreate(version=version, selector=selector or {})
        return parse(Preheat, self.session.send("POST", f"/v1/deployments/{segment(name)}/preheats", json=body))

    def list_preheats(self, name: str) -> list[Preheat]:
        """The standing preheats of ``name`` with their progress."""
        return self._list(f"/v1/deployments/{segment(name)}/preheats", Preheat)

    def cancel_preheat(self, name: str, preheat_id: str) -> None:
        """Cancel a preheat of ``name``."""
        self.session.send("DELETE", f"/v1/deployments/{segment(name)}/preheats/{segment(preheat_id)}")

    def measure_builtin(
        self, deployment: str, *, metric: str, provider: dict[str, Any], canary: str, stable: str | None
    ) -> dict[str, float] | None:
        """One built-in analysis measurement of ``canary`` against ``stable`` (None: no data yet)."""
        body = BuiltinMeasure(metric=metric, provider=provider, canary=canary, stable=stable)
        path = f"/v1/deployments/{segment(deployment)}/analysis/builtin"
        return parse(BuiltinMeasurement, self.session.send("POST", path, json=body)).value

    def version_loads(self, deployment: str, digest: str) -> VersionLoads:
        """How the live nodes' model servers fared loading ``digest`` for ``deployment`` (operator role)."""
        return self._get(f"/v1/deployments/{segment(deployment)}/analysis/loads", VersionLoads, digest=digest)

    def list_deployments(self) -> list[Deployment]:
        """Every deployment's pointer."""
        return self._list("/v1/deployments", Deployment)

    def get_deployment(self, name: str) -> Deployment:
        """A deployment's pointer; its ``epoch`` is the value to send back as ``expected_epoch``."""
        return self._get(f"/v1/deployments/{segment(name)}", Deployment)

    def set_pointer(
        self,
        name: str,
        stable: str,
        *,
        expected_epoch: int,
        canary: str | None = None,
        canary_share: float = 0.0,
        reason: str = "",
    ) -> Deployment:
        """Compare-and-swap the pointer: succeeds only if the deployment is still at ``expected_epoch``.

        Raises ``PreconditionFailed`` when someone else changed it first: re-read and retry.
        """
        body = PointerUpdate(stable=stable, canary=canary, canary_share=canary_share, reason=reason)
        response = self.session.send(
            "PUT", f"/v1/deployments/{segment(name)}/pointer", json=body, headers={"If-Match": f'"{expected_epoch}"'}
        )
        return parse(Deployment, response)

    def rollback(
        self, name: str, *, to: str | None = None, reason: str = "", expected_epoch: int | None = None
    ) -> Deployment:
        """Point ``name`` back at its previous stable version, or at ``to`` (label or digest)."""
        headers = {"If-Match": f'"{expected_epoch}"'} if expected_epoch is not None else None
        body = RollbackRequest(to=to, reason=reason)
        return parse(
            Deployment,
            self.session.send("POST", f"/v1/deployments/{segment(name)}/rollback", json=body, headers=headers),
        )

    def history(self, name: str, *, limit: int = 100, before_epoch: int | None = None) -> list[PointerEvent]:
        """Pointer changes of ``name``, newest first, one per epoch; page with ``before_epoch``."""
        params: dict[str, str | int | float] = {"limit": limit}
        if before_epoch is not None:
            params["before_epoch"] = before_epoch
        return self._list(f"/v1/deployments/{segment(name)}/history", PointerEvent, params)

    def deployment_status(self, name: str) -> DeploymentStatus:
        """How each version of ``name`` stands across the fleet."""
        return self._get(f"/v1/deployments/{segment(name)}/status", DeploymentStatus)

    # --- rollouts ------------------------------------------------------------------------------

    def start_rollout(self, deployment: str, spec: dict[str, Any]) -> Rollout:
        """Start a rollout of ``deployment`` with the engine ``spec`` (``version``, ``steps``...).

        Raises ``ConflictError`` (code ``rollout_active``) while another rollout of it is active.
        """
        body = RolloutCreate(spec=spec)
        return parse(Rollout, self.session.send("POST", f"/v1/deployments/{segment(deployment)}/rollouts", json=body))

    def list_rollouts(self, deployment: str | None = None, *, active: bool = False) -> list[Rollout]:
        """Rollouts of ``deployment`` (newest first), or with ``active`` those in progress across deployments."""
        if deployment is not None and not active:
            return self._get(f"/v1/deployments/{segment(deployment)}/rollouts", RolloutList).rollouts
        # "active" is the server's judgement (an aborted rollout stays active until traffic is back on stable)
        found = self._get("/v1/rollouts", RolloutList, active="true" if active else "false").rollouts
        return [r for r in found if deployment is None or r.deployment == deployment]

    def get_rollout(self, deployment: str, rollout_id: str = "current") -> Rollout:
        """One rollout of ``deployment``; ``current`` is its active rollout, else its latest."""
        return self._get(f"/v1/deployments/{segment(deployment)}/rollouts/{segment(rollout_id)}", Rollout)

    def act_on_rollout(self, deployment: str, verb: str, rollout_id: str = "current") -> Rollout:
        """Apply ``verb`` (promote, promote-full, pause, resume, abort, retry) to a rollout.

        Raises ``ConflictError`` (code ``rollout_verb``) when the verb does not fit its state; the
        message says which verb does.
        """
        if verb not in VERBS:
            raise ValidationError(f"{verb!r} is not a rollout verb: use one of {', '.join(VERBS)}")
        body = RolloutAction.model_validate({"verb": verb})
        path = f"/v1/deployments/{segment(deployment)}/rollouts/{segment(rollout_id)}/actions"
        return parse(Rollout, self.session.send("POST", path, json=body))

    # --- fleet ---------------------------------------------------------------------------------

    def enrol_node(self, request: NodeEnrolRequest) -> NodeEnrolment:
        """Enrol a node (enrolment token); the answer holds its node token, shown once."""
        return parse(NodeEnrolment, self.session.send("POST", "/v1/nodes/enrol", json=request))

    def register_node(self, registration: NodeRegistration) -> NodeInfo:
        """Re-register a node, with its own node token."""
        return parse(NodeInfo, self.session.send("POST", "/v1/nodes/register", json=registration, retry=True))

    def heartbeat(self, node_id: str, heartbeat: NodeHeartbeat) -> None:
        """Report a node's inventory, what it serves, its counters and health."""
        self.session.send("POST", f"/v1/nodes/{segment(node_id)}/heartbeat", json=heartbeat, retry=True)

    def desired_state(self, node_id: str, *, after: str | None = None, wait: float = 0.0) -> DesiredState:
        """A node's desired state; with ``after`` and ``wait``, long-poll until it moves past ``after``."""
        params: dict[str, str | int | float] = {"wait": wait}
        if after is not None:
            params["after"] = after
        timeout = self.session.read_timeout(self.timeout + wait)
        response = self.session.send(
            "GET", f"/v1/nodes/{segment(node_id)}/desired", params=params, timeout=timeout, retry=False
        )
        return parse(DesiredState, response)

    def blob_urls(self, blobs: Iterable[str]) -> BlobURLs:
        """Short-lived read URLs (HTTP range requests, no credentials) for blobs by sha256 hex."""
        body = BlobURLRequest(blobs=list(blobs))
        return parse(BlobURLs, self.session.send("POST", "/v1/blobs/urls", json=body, retry=True))

    def list_nodes(self, deployment: str | None = None) -> list[NodeInfo]:
        """Every registered node with its last report; only those serving ``deployment`` if given."""
        return self._list("/v1/nodes", NodeInfo, {"deployment": deployment} if deployment else None)

    # --- tokens --------------------------------------------------------------------------------

    def create_token(
        self,
        name: str,
        role: Role | str,
        *,
        deployments: list[str] | None = None,
        node_role: Literal["node", "cache"] | None = None,
    ) -> TokenCreated:
        """Mint a token; its secret is in the answer and nowhere else.

        For an enrolment token (role ``agent``): ``deployments`` assigns the nodes it enrols (None: all),
        ``node_role`` the role they get (``cache`` only from a token minted so).
        """
        body = TokenCreate(name=name, role=Role(role), deployments=deployments, node_role=node_role)
        return parse(TokenCreated, self.session.send("POST", "/v1/tokens", json=body))

    def whoami(self) -> TokenInfo:
        """The token this client sends: its name and role (any role may ask)."""
        return self._get("/v1/tokens/self", TokenInfo)

    def list_tokens(self) -> list[TokenInfo]:
        """Every token, without secrets."""
        return self._list("/v1/tokens", TokenInfo)

    def revoke_token(self, token_id: str) -> None:
        """Revoke a token; calls with it fail from now on."""
        self.session.send("DELETE", f"/v1/tokens/{segment(token_id)}")

    # --- operations ----------------------------------------------------------------------------

    def healthz(self) -> bool:
        """Whether the control plane process answers."""
        return self.session.send("GET", "/healthz").is_success

    def readyz(self) -> bool:
        """Whether the control plane can serve (its database answers)."""
        return self.session.send("GET", "/readyz").is_success
