"""HTTP routes of the version index (controlplane.registry): models, versions, manifests, labels, blob URLs.

All under ``/v1``:

- ``GET /models``, ``GET /models/{model}/versions``, ``GET /models/{model}/versions/{ref}``
  (``ref``: a label or ``sha256:<hex>``) — any role;
- ``GET /models/{model}/versions/{ref}/manifest`` — the manifest bytes exactly as stored, checked
  against the digest on the way out, ``ETag`` = the digest (``If-None-Match`` gives 304);
- ``POST /models/{model}/labels`` — publisher;
- ``POST /blobs/urls`` — operator, or a node token for blobs of versions its node is entitled to
  (never an enrolment token): short-lived read URLs, presigned S3 GETs or, for the
  local store, ``GET /blobs/{sha256}?expires=&sig=`` served here with HTTP range support and no
  token (the HMAC signature authorises it; ``persistence.store.signing``).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import FileResponse
from sqlalchemy import exc, func, select
from sqlalchemy.orm import Session

from controlplane.auth import ANY_ROLE, Principal
from controlplane.http import state_of
from controlplane.http.auth import require
from controlplane.http.problems import errors
from controlplane.persistence.engine import database_errors
from controlplane.persistence.rows import LabelRow, ModelRow, VersionRow
from controlplane.persistence.store import LocalStore, manifest_key
from controlplane.persistence.store.signing import signed_blob_url, verify_blob_signature
from controlplane.registry import (
    check_labels_free,
    claim_label_objects,
    info_with_labels,
    resolve_version,
    version_info,
)
from controlplane.tickets import entitled_blobs
from weightship.digests import is_hex
from weightship.errors import ConflictError, ForbiddenError, NotFoundError
from weightship.logs import event
from weightship.manifest import (
    MAX_MANIFEST_BYTES,
    check_manifest_bytes,
    check_model_name,
)
from weightship.schemas import INT64_MAX, BlobURL, BlobURLRequest, BlobURLs, LabelCreate, ModelInfo, Role, VersionInfo

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["registry"])


_IMMUTABLE = "private, max-age=31536000, immutable"


class BlobResponse(FileResponse):
    """A file response that reads 1 MiB per step instead of Starlette's 64 KiB.

    Each step is one hop to a worker thread and back: at 64 KiB a 100 Mbit/s link needs about 190
    a second, and on a busy host their scheduling delays leave the link idle in gaps.
    """

    chunk_size = 1024 * 1024


@router.get("/models", response_model=list[ModelInfo])
def list_models(request: Request, _principal: Principal = Depends(require(*ANY_ROLE))) -> list[ModelInfo]:
    """Every model, with its number of versions."""
    state = state_of(request)
    counts = select(VersionRow.model, func.count().label("n")).group_by(VersionRow.model).subquery()
    with database_errors("listing models"), state.sessions() as session:
        rows = session.execute(
            select(ModelRow, counts.c.n).outerjoin(counts, counts.c.model == ModelRow.name).order_by(ModelRow.name)
        ).all()
    return [
        ModelInfo(name=m.name, versions=int(n or 0), allow_pickle=m.allow_pickle, created_at=m.created_at)
        for m, n in rows
    ]


def _model(session: Session, name: str) -> ModelRow:
    check_model_name(name)
    row = session.get(ModelRow, name)
    if row is None:
        raise NotFoundError(
            f"model {name!r} does not exist; publish a version of it first", code="model_not_found", fields={"model": name}
        )
    return row


@router.get("/models/{model}/versions", response_model=list[VersionInfo], responses=errors(400, 404))
def list_versions(
    model: str, request: Request, _principal: Principal = Depends(require(*ANY_ROLE))
) -> list[VersionInfo]:
    """The model's versions, newest first, each with its labels."""
    state = state_of(request)
    with database_errors(f"listing versions of {model}"), state.sessions() as session:
        _model(session, model)
        rows = session.scalars(
            select(VersionRow)
            .where(VersionRow.model == model)
            .order_by(VersionRow.created_at.desc(), VersionRow.digest)
        ).all()
        labels: dict[str, list[str]] = {}
        for label in session.scalars(select(LabelRow).where(LabelRow.model == model).order_by(LabelRow.label)):
            labels.setdefault(label.digest, []).append(label.label)
    return [info_with_labels(row, labels.get(row.digest, [])) for row in rows]


@router.get("/models/{model}/versions/{ref}", response_model=VersionInfo, responses=errors(400, 404))
def get_version(
    model: str, ref: str, request: Request, _principal: Principal = Depends(require(*ANY_ROLE))
) -> VersionInfo:
    """One version, by label or digest."""
    state = state_of(request)
    with database_errors(f"reading {model}@{ref}"), state.sessions() as session:
        _model(session, model)
        return version_info(session, resolve_version(session, model, ref))


@router.get(
    "/models/{model}/versions/{ref}/manifest",
    response_class=Response,
    responses=errors(400, 404, 502) | {304: {"description": "Not Modified: the manifest named in If-None-Match"}},
)
def get_manifest(
    model: str,
    ref: str,
    request: Request,
    if_none_match: str | None = Header(default=None),
    _principal: Principal = Depends(require(*ANY_ROLE)),
) -> Response:
    """The manifest bytes exactly as stored; ``ETag`` is the version digest."""
    state = state_of(request)
    with database_errors(f"reading {model}@{ref}"), state.sessions() as session:
        _model(session, model)
        digest = resolve_version(session, model, ref).digest
    etag = f'"{digest}"'
    if if_none_match is not None and etag in {t.strip() for t in if_none_match.split(",")}:
        return Response(status_code=304, headers={"ETag": etag, "Cache-Control": _IMMUTABLE})
    raw = state.store.get_bytes(manifest_key(digest), MAX_MANIFEST_BYTES)
    check_manifest_bytes(
        raw,
        digest,
        f"the stored manifest of {digest}",
        "the origin store is corrupt: restore manifests/sha256/ from a backup",
    )
    return Response(content=raw, media_type="application/json", headers={"ETag": etag, "Cache-Control": _IMMUTABLE})


@router.post(
    "/models/{model}/labels",
    response_model=VersionInfo,
    responses=errors(400, 404, 409, 502) | {201: {"description": "Label added"}},
)
def add_label(
    model: str,
    body: LabelCreate,
    request: Request,
    response: Response,
    principal: Principal = Depends(require(Role.publisher)),
) -> VersionInfo:
    """Label a ready version; the same label again on the same digest is a no-op, elsewhere a 409."""
    state = state_of(request)
    with database_errors(f"labelling {model}"), state.sessions() as session:
        _model(session, model)
        row = resolve_version(session, model, body.digest)
        if row.state != "ready":
            raise ConflictError(f"version {row.digest} is {row.state!r}; only ready versions can be labelled")
        existing = session.get(LabelRow, (model, body.label))
        if existing is not None and existing.digest == body.digest:
            return version_info(session, row)
        check_labels_free(session, model, body.digest, [body.label])
    now = datetime.now(UTC)
    claim_label_objects(state.store, model, [body.label], body.digest, principal.name, now)
    with database_errors(f"labelling {model}"), state.sessions() as session:
        try:
            session.add(
                LabelRow(model=model, label=body.label, digest=body.digest, created_at=now, created_by=principal.name)
            )
            session.commit()
        except exc.IntegrityError:
            session.rollback()
            check_labels_free(session, model, body.digest, [body.label])
        event(log, "label.added", model=model, label=body.label, digest=body.digest, by=principal.name)
        response.status_code = 201
        return version_info(session, resolve_version(session, model, body.digest))


@router.post("/blobs/urls", response_model=BlobURLs, responses=errors(403))
def blob_urls(
    body: BlobURLRequest, request: Request, principal: Principal = Depends(require(Role.agent, Role.operator))
) -> BlobURLs:
    """Short-lived read URLs for blobs: presigned S3 GETs, or signed URLs served by this API.

    A node token gets URLs only for blobs of versions its node is entitled to
    (``controlplane.tickets.entitled_blobs``); any other blob refuses the request (403).
    """
    state = state_of(request)
    if principal.role == Role.agent and principal.node_id is not None:
        refused = sorted(set(body.blobs) - entitled_blobs(state, principal.node_id))
        if refused:
            event(
                log,
                "blob.urls_refused",
                logging.WARNING,
                node=principal.node_name,
                refused=len(refused),
                first=refused[0],
            )
            raise ForbiddenError(
                f"node {principal.node_name!r} is not entitled to blob {refused[0]}"
                + (f" and {len(refused) - 1} more" if len(refused) > 1 else "")
                + ": blob URLs are issued only for versions a pointer of a deployment the node was assigned "
                "names (or staging asks of it)",
                code="blob_not_entitled",
                fields={"refused": ",".join(refused[:16])},
            )
    ttl = int(state.settings.blob_url_ttl_seconds)
    now = time.time()
    expires = int(now) + ttl
    expires_at = datetime.fromtimestamp(expires, UTC)
    urls: dict[str, BlobURL] = {}
    for sha in dict.fromkeys(body.blobs):
        url = state.store.read_url(sha, ttl)
        if url is None:
            url = signed_blob_url(state.settings.public_url, state.settings.url_signing_key, sha, expires)
        urls[sha] = BlobURL(url=url, expires_at=expires_at - timedelta(seconds=1))
    return BlobURLs(urls=urls)


@router.head("/blobs/{sha256}", response_class=BlobResponse, include_in_schema=False)
@router.get(
    "/blobs/{sha256}",
    response_class=BlobResponse,
    responses=errors(403, 404, 416) | {206: {"description": "Partial Content: the range asked for"}},
)
def read_blob(
    sha256: str, request: Request, expires: int = Query(..., ge=0, le=INT64_MAX), sig: str = Query(..., max_length=128)
) -> BlobResponse:
    """A blob of the local store, on a signed URL; HTTP range requests are served from the file."""
    state = state_of(request)
    store = state.store
    if not is_hex(sha256):
        raise NotFoundError(f"{sha256!r} is not a blob name (64 lowercase hex)")
    verify_blob_signature(state.settings.url_signing_key, sha256, expires, sig, time.time())
    if not isinstance(store, LocalStore):
        raise NotFoundError("this control plane's store is S3: read blobs from presigned URLs (POST /v1/blobs/urls)")
    path = store.blob_path(sha256)
    if not path.is_file():
        raise NotFoundError(f"blob {sha256} is not in the store")
    return BlobResponse(
        path,
        media_type="application/octet-stream",
        headers={"ETag": f'"{sha256}"', "Cache-Control": _IMMUTABLE},
    )
