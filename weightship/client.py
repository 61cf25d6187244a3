"""The REST client of the control plane: one typed method per route, errors mapped to ours.

``Client`` wraps a synchronous ``httpx.Client``. Its test seam is the ``transport`` argument
(an ``httpx.MockTransport`` in unit tests, the default network transport otherwise), never
monkey-patching. Every non-2xx answer becomes a ``WeightshipError`` subclass chosen from the
``ErrorBody`` code and the HTTP status (``errors.py``), and every ``httpx`` failure (refused
connection, timeout) becomes a ``TemporaryError`` that names the URL and says what to check, so
callers catch our errors, never a library's.

Reads (GET) are retried with capped exponential backoff on temporary failures; writes are not,
because repeating a write whose answer was lost is not always harmless (a pointer update would
come back 412). ``publish_directory`` runs the whole upload protocol (``publishing.py``).

The bearer token is sent only to the control plane's own origin: part uploads may go straight to
S3 on presigned URLs, which carry their own signature and must not see our token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from weightship.backoff import Backoff, is_temporary
from weightship.chunks import DEFAULT_CHUNK_SIZE
from weightship.errors import (
    AuthError,
    ConflictError,
    DiskFullError,
    Field,
    ForbiddenError,
    IntegrityError,
    ManifestError,
    NotFoundError,
    PreconditionFailed,
    PreconditionRequired,
    StoreError,
    TemporaryError,
    ValidationError,
    WeightshipError,
)
from weightship.publishing import PublishProgress, PublishResult, publish_directory
from weightship.schemas import (
    BlobURLRequest,
    BlobURLs,
    Deployment,
    DeploymentCreate,
    DeploymentStatus,
    DesiredState,
    ErrorBody,
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
    Role,
    RollbackRequest,
    TokenCreate,
    TokenCreated,
    TokenInfo,
    UploadCreate,
    UploadSession,
    VersionInfo,
)

__all__ = [
    "DEFAULT_URL",
    "Backoff",
    "Client",
    "error_from_response",
]

DEFAULT_URL = "http://127.0.0.1:8080"
try:
    _VERSION = version("weightship")
except PackageNotFoundError:  # running from a source tree that was never installed
    _VERSION = "0+unknown"
_T = TypeVar("_T", bound=BaseModel)

#: Error classes by the ``code`` of an ``ErrorBody``; the most specific answer wins.
_BY_CODE: dict[str, type[WeightshipError]] = {
    cls.code: cls
    for cls in (
        ValidationError,
        ManifestError,
        IntegrityError,
        NotFoundError,
        ConflictError,
        PreconditionFailed,
        PreconditionRequired,
        AuthError,
        ForbiddenError,
        StoreError,
        TemporaryError,
        DiskFullError,
    )
}
#: Error classes by HTTP status, for bodies without a known code (proxies, S3, older servers).
_BY_STATUS: dict[int, type[WeightshipError]] = {
    400: ValidationError,
    401: AuthError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    412: PreconditionFailed,
    413: ValidationError,
    422: ValidationError,
    428: PreconditionRequired,
    429: TemporaryError,
    502: StoreError,
    503: TemporaryError,
    504: TemporaryError,
    507: DiskFullError,
}
#: S3 error codes that mean the bytes did not match the checksum we sent.
_S3_INTEGRITY_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidChecksum"})
_XML_FIELD = re.compile(r"<(Code|Message)>([^<]*)</\1>")


def error_from_response(response: httpx.Response, what: str) -> WeightshipError:
    """The ``WeightshipError`` that a non-2xx ``response`` to ``what`` (e.g. ``GET /v1/x``) means.

    Reads our ``ErrorBody`` first, then S3's XML error document, then falls back to the status.
    """
    status = response.status_code
    cls: type[WeightshipError] | None = None
    message = ""
    problem = _problem_of(response)
    if problem is not None:
        fallback = TemporaryError if status >= 500 else WeightshipError
        error = _error_of(response, _BY_CODE.get(problem.code) or _BY_STATUS.get(status) or fallback, problem.detail)
        error.code, error.fields = problem.code, problem.fields
        return error
    try:
        body = ErrorBody.model_validate_json(response.content)
        cls = _BY_CODE.get(body.error.code)
        message = body.error.message
    except PydanticValidationError:
        text = response.text.strip()
        fields = dict(_XML_FIELD.findall(text)) if text.startswith("<") else {}
        if fields:
            if fields.get("Code") in _S3_INTEGRITY_CODES:
                cls = IntegrityError
            message = f"{what} answered {status} {fields.get('Code', '')}: {fields.get('Message', '')}".strip()
        else:
            snippet = text[:200] or response.reason_phrase
            message = f"{what} answered HTTP {status}: {snippet}"
            if status >= 500:
                message += "; the server failed without saying why: check its log, then retry"
            elif status in (404, 405):
                message += "; no such route: check that the URL names a weightship control plane of this version"
    if cls is None:
        cls = _BY_STATUS.get(status)
    if cls is None:
        cls = TemporaryError if status >= 500 else WeightshipError
    return _error_of(response, cls, message)


def _error_of(response: httpx.Response, cls: type[WeightshipError], message: str) -> WeightshipError:
    if issubclass(cls, TemporaryError):
        return cls(message, delay=_retry_after(response))
    return cls(message)


@dataclass(frozen=True)
class _Problem:
    code: str
    detail: str
    fields: dict[str, Field]


_PROBLEM_MEMBERS = frozenset({"type", "title", "status", "detail", "instance", "code"})


def _problem_of(response: httpx.Response) -> _Problem | None:
    """RFC 9457 problem details with our ``code``, if that is what ``response`` carries."""
    if response.headers.get("content-type", "").split(";")[0].strip().lower() != "application/problem+json":
        return None
    try:
        doc = json.loads(response.content)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("code"), str) or not isinstance(doc.get("detail"), str):
        return None
    fields = {
        k: v for k, v in doc.items() if k not in _PROBLEM_MEMBERS and (v is None or isinstance(v, str | int | float))
    }
    return _Problem(doc["code"], doc["detail"], fields)


def _retry_after(response: httpx.Response) -> float:
    """The server's ``Retry-After`` in seconds (capped at a minute); 0 when it gave none."""
    try:
        return max(0.0, min(float(response.headers.get("retry-after", "0")), 60.0))
    except ValueError:  # an HTTP date: rare from our servers, so just back off normally
        return 0.0


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
        self.base_url = base_url.rstrip("/")
        self.token = token or None
        self.backoff = backoff or Backoff()
        self.timeout = timeout
        self._origin = httpx.URL(self.base_url + "/")
        self._http = httpx.Client(
            base_url=self.base_url,
            transport=transport,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            headers={"User-Agent": f"weightship/{_VERSION}"},
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
            follow_redirects=False,
        )

    # --- plumbing ----------------------------------------------------------------------------

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close pooled connections."""
        self._http.close()

    def resolve(self, url: str) -> httpx.URL:
        """``url`` made absolute: paths are relative to the API base URL."""
        if url.startswith(("http://", "https://")):
            return httpx.URL(url)
        return httpx.URL(self.base_url + "/" + url.lstrip("/"))

    def _is_ours(self, url: httpx.URL) -> bool:
        return (url.scheme, url.host, url.port) == (self._origin.scheme, self._origin.host, self._origin.port)

    def send(
        self,
        method: str,
        url: str,
        *,
        json: BaseModel | None = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str | int | float] | None = None,
        timeout: httpx.Timeout | float | None = None,
        retry: bool | None = None,
    ) -> httpx.Response:
        """Send one request and return its 2xx response, or raise the mapped ``WeightshipError``.

        ``url`` is a path under the API base or an absolute URL; the token goes only to the API's
        own origin. GETs are retried on temporary failures unless ``retry`` says otherwise.
        """
        target = self.resolve(url)
        all_headers = dict(headers or {})
        if self.token and self._is_ours(target):
            all_headers["Authorization"] = f"Bearer {self.token}"
        body = content
        if json is not None:
            body = json.model_dump_json(exclude_unset=False).encode("utf-8")
            all_headers["Content-Type"] = "application/json"
        what = f"{method} {target.copy_with(query=None)}"

        def once() -> httpx.Response:
            try:
                response = self._http.request(
                    method,
                    target,
                    content=body,
                    headers=all_headers,
                    params=params,
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except httpx.TimeoutException as exc:
                raise TemporaryError(
                    f"{what} timed out ({type(exc).__name__}); the control plane or store is slow or "
                    "unreachable: check it is running and retry"
                ) from None
            except httpx.TransportError as exc:
                advice = (
                    "check the URL (--url / WEIGHTSHIP_URL) and that the control plane is running"
                    if self._is_ours(target)
                    else "check that this machine can reach the object store"
                )
                raise TemporaryError(f"cannot reach {target.host}:{target.port} for {what}: {exc}; {advice}") from None
            if response.is_success:
                return response
            raise error_from_response(response, what)

        should_retry = method == "GET" if retry is None else retry
        if not should_retry:
            return once()
        return self.backoff.run(once, is_temporary)

    def _get(self, path: str, schema: type[_T], **params: str | int | float) -> _T:
        return _parse(schema, self.send("GET", path, params=params or None))

    def _list(self, path: str, schema: type[_T], params: dict[str, str | int | float] | None = None) -> list[_T]:
        response = self.send("GET", path, params=params)
        try:
            return TypeAdapter(list[schema]).validate_json(response.content)  # type: ignore[valid-type]
        except PydanticValidationError as exc:
            raise _bad_answer(path, exc) from None

    # --- publishing ---------------------------------------------------------------------------

    def create_upload(
        self, manifest: bytes, labels: Sequence[str] = (), *, allow_pickle: bool = False
    ) -> UploadSession:
        """Open (or resume) the publish session of a manifest given as its canonical bytes."""
        request = UploadCreate(manifest=manifest.decode("utf-8"), labels=list(labels), allow_pickle=allow_pickle)
        # Opening is idempotent by design (same manifest -> same session), so it may be retried.
        return _parse(UploadSession, self.send("POST", "/v1/uploads", json=request, retry=True))

    def get_upload(self, upload_id: str) -> UploadSession:
        """A publish session, with fresh part URLs and which parts are done."""
        return self._get(f"/v1/uploads/{_seg(upload_id)}", UploadSession)

    def upload_part(self, part: PartUpload, data: bytes) -> None:
        """PUT one part's bytes to its URL with the headers the session asked for (no retry here)."""
        self.send("PUT", part.url, content=data, headers=dict(part.headers), retry=False)

    def commit_upload(self, upload_id: str) -> VersionInfo:
        """Ask the control plane to verify every blob and make the version ready."""
        # The server may re-hash every byte before answering, so reading may take long.
        timeout = httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0), read=3600.0)
        response = self.send("POST", f"/v1/uploads/{_seg(upload_id)}/commit", timeout=timeout)
        return _parse(VersionInfo, response)

    def abort_upload(self, upload_id: str) -> None:
        """Abandon a publish session; uploaded parts are discarded."""
        self.send("DELETE", f"/v1/uploads/{_seg(upload_id)}")

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
        )

    # --- registry ----------------------------------------------------------------------------

    def list_models(self) -> list[ModelInfo]:
        """Every model with its version count."""
        return self._list("/v1/models", ModelInfo)

    def list_versions(self, model: str) -> list[VersionInfo]:
        """Every ready version of ``model``."""
        return self._list(f"/v1/models/{_seg(model)}/versions", VersionInfo)

    def get_version(self, model: str, ref: str) -> VersionInfo:
        """One version of ``model`` by label or ``sha256:`` digest."""
        return self._get(f"/v1/models/{_seg(model)}/versions/{_seg(ref)}", VersionInfo)

    def get_manifest(self, model: str, ref: str) -> bytes:
        """The manifest bytes of a version exactly as stored (hash them to check the digest)."""
        return self.send("GET", f"/v1/models/{_seg(model)}/versions/{_seg(ref)}/manifest").content

    def label_digest(self, model: str, label: str) -> str | None:
        """The digest ``label`` of ``model`` names, or ``None`` while it is free (also when the model is new)."""
        try:
            return self.get_version(model, label).digest
        except NotFoundError:
            return None

    def add_label(self, model: str, label: str, digest: str) -> VersionInfo:
        """Attach ``label`` to a ready version; labels never move once set."""
        body = LabelCreate(label=label, digest=digest)
        return _parse(VersionInfo, self.send("POST", f"/v1/models/{_seg(model)}/labels", json=body))

    # --- deployments ---------------------------------------------------------------------------

    def create_deployment(self, name: str, model: str) -> Deployment:
        """Create a deployment of ``model``; it serves nothing until its pointer is set."""
        body = DeploymentCreate(name=name, model=model)
        return _parse(Deployment, self.send("POST", "/v1/deployments", json=body))

    def list_deployments(self) -> list[Deployment]:
        """Every deployment's pointer."""
        return self._list("/v1/deployments", Deployment)

    def get_deployment(self, name: str) -> Deployment:
        """A deployment's pointer; its ``epoch`` is the value to send back as ``expected_epoch``."""
        return self._get(f"/v1/deployments/{_seg(name)}", Deployment)

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
        response = self.send(
            "PUT", f"/v1/deployments/{_seg(name)}/pointer", json=body, headers={"If-Match": f'"{expected_epoch}"'}
        )
        return _parse(Deployment, response)

    def rollback(
        self, name: str, *, to: str | None = None, reason: str = "", expected_epoch: int | None = None
    ) -> Deployment:
        """Point ``name`` back at its previous stable version, or at ``to`` (label or digest)."""
        headers = {"If-Match": f'"{expected_epoch}"'} if expected_epoch is not None else None
        body = RollbackRequest(to=to, reason=reason)
        return _parse(
            Deployment, self.send("POST", f"/v1/deployments/{_seg(name)}/rollback", json=body, headers=headers)
        )

    def history(self, name: str, *, limit: int = 100, before_epoch: int | None = None) -> list[PointerEvent]:
        """Pointer changes of ``name``, newest first, one per epoch; page with ``before_epoch``."""
        params: dict[str, str | int | float] = {"limit": limit}
        if before_epoch is not None:
            params["before_epoch"] = before_epoch
        return self._list(f"/v1/deployments/{_seg(name)}/history", PointerEvent, params)

    def deployment_status(self, name: str) -> DeploymentStatus:
        """How each version of ``name`` stands across the fleet."""
        return self._get(f"/v1/deployments/{_seg(name)}/status", DeploymentStatus)

    # --- fleet ---------------------------------------------------------------------------------

    def enrol_node(self, request: NodeEnrolRequest) -> NodeEnrolment:
        """Enrol a node (enrolment token); the answer holds its node token, shown once."""
        return _parse(NodeEnrolment, self.send("POST", "/v1/nodes/enrol", json=request))

    def register_node(self, registration: NodeRegistration) -> NodeInfo:
        """Re-register a node, with its own node token."""
        return _parse(NodeInfo, self.send("POST", "/v1/nodes/register", json=registration, retry=True))

    def heartbeat(self, node_id: str, heartbeat: NodeHeartbeat) -> None:
        """Report a node's inventory, what it serves, its counters and health."""
        self.send("POST", f"/v1/nodes/{_seg(node_id)}/heartbeat", json=heartbeat, retry=True)

    def desired_state(self, node_id: str, *, after: str | None = None, wait: float = 0.0) -> DesiredState:
        """A node's desired state; with ``after`` and ``wait``, long-poll until it moves past ``after``."""
        params: dict[str, str | int | float] = {"wait": wait}
        if after is not None:
            params["after"] = after
        timeout = httpx.Timeout(self.timeout + wait, connect=min(self.timeout, 10.0))
        response = self.send("GET", f"/v1/nodes/{_seg(node_id)}/desired", params=params, timeout=timeout, retry=False)
        return _parse(DesiredState, response)

    def blob_urls(self, blobs: Iterable[str]) -> BlobURLs:
        """Short-lived read URLs (HTTP range requests, no credentials) for blobs by sha256 hex."""
        body = BlobURLRequest(blobs=list(blobs))
        return _parse(BlobURLs, self.send("POST", "/v1/blobs/urls", json=body, retry=True))

    def list_nodes(self, deployment: str | None = None) -> list[NodeInfo]:
        """Every registered node with its last report; only those serving ``deployment`` if given."""
        return self._list("/v1/nodes", NodeInfo, {"deployment": deployment} if deployment else None)

    # --- tokens --------------------------------------------------------------------------------

    def create_token(self, name: str, role: Role | str) -> TokenCreated:
        """Mint a token; its secret is in the answer and nowhere else."""
        body = TokenCreate(name=name, role=Role(role))
        return _parse(TokenCreated, self.send("POST", "/v1/tokens", json=body))

    def whoami(self) -> TokenInfo:
        """The token this client sends: its name and role (any role may ask)."""
        return self._get("/v1/tokens/self", TokenInfo)

    def list_tokens(self) -> list[TokenInfo]:
        """Every token, without secrets."""
        return self._list("/v1/tokens", TokenInfo)

    def revoke_token(self, token_id: str) -> None:
        """Revoke a token; calls with it fail from now on."""
        self.send("DELETE", f"/v1/tokens/{_seg(token_id)}")

    # --- operations ----------------------------------------------------------------------------

    def healthz(self) -> bool:
        """Whether the control plane process answers."""
        return self.send("GET", "/healthz").is_success

    def readyz(self) -> bool:
        """Whether the control plane can serve (its database answers)."""
        return self.send("GET", "/readyz").is_success


def _seg(value: str) -> str:
    """``value`` escaped as one path segment (a ``/`` in a name must not open another route)."""
    return quote(value, safe="")


def _parse(schema: type[_T], response: httpx.Response) -> _T:
    try:
        return schema.model_validate_json(response.content)
    except PydanticValidationError as exc:
        raise _bad_answer(str(response.request.url.path), exc) from None


def _bad_answer(path: str, exc: PydanticValidationError) -> WeightshipError:
    errors = exc.errors()
    where, msg = (".".join(str(p) for p in errors[0]["loc"]), errors[0]["msg"]) if errors else ("", "")
    return WeightshipError(
        f"the answer to {path} does not match the weightship {_VERSION} schema ({where}: {msg}); "
        "the control plane and this client are probably different versions: upgrade the older one"
    )
