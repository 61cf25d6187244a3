"""The version index: models, ready versions and their labels, and read access to their bytes.

The database indexes what the origin store holds; the store is the truth. Beside versions it
keeps each stored blob's *verified* chunk list per chunk size (``blob_chunks``): written only
after every byte was checked under that geometry (``publish``), read to hold later manifests
naming the blob to exactly that list. A version row is
inserted only after every blob and the manifest are in the store (``publish``), and a label is
claimed twice, in this order: a write-once ``labels/<model>/<label>`` object in the store (so
labels survive the loss of the database, see ``recovery``), then its row. Labels never move: a
label already naming another digest is a ``ConflictError`` (409) at either step.

Routes (all under ``/v1``):

- ``GET /models``, ``GET /models/{model}/versions``, ``GET /models/{model}/versions/{ref}``
  (``ref``: a label or ``sha256:<hex>``) — any role;
- ``GET /models/{model}/versions/{ref}/manifest`` — the manifest bytes exactly as stored, checked
  against the digest on the way out, ``ETag`` = the digest (``If-None-Match`` gives 304);
- ``POST /models/{model}/labels`` — publisher;
- ``POST /blobs/urls`` — agent or operator: short-lived read URLs, presigned S3 GETs or, for the
  local store, ``GET /blobs/{sha256}?expires=&sig=`` served here with HTTP range support and no
  token (the HMAC signature authorises it; ``store.signing``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import PurePosixPath
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import FileResponse
from sqlalchemy import exc, func, select
from sqlalchemy.orm import Session

from controlplane.auth import ANY_ROLE, Principal, require
from controlplane.persistence.db import BlobChunksRow, LabelRow, ModelRow, VersionRow
from controlplane.persistence.store import LocalStore, OriginStore, label_key, manifest_key
from controlplane.persistence.store.signing import signed_blob_url, verify_blob_signature
from weightship.digests import hex_of, is_hex, parse_digest, sha256_hex
from weightship.errors import ConflictError, DatabaseUnavailable, IntegrityError, NotFoundError
from weightship.manifest import (
    MAX_MANIFEST_BYTES,
    PICKLE_SUFFIXES,
    FileEntry,
    Manifest,
    canonical_json,
    check_model_name,
)
from weightship.schemas import INT64_MAX, BlobURL, BlobURLRequest, BlobURLs, LabelCreate, ModelInfo, Role, VersionInfo

__all__ = [
    "as_utc",
    "check_labels_free",
    "claim_label_objects",
    "database_errors",
    "known_chunk_lists",
    "pickle_files",
    "record_chunk_lists",
    "record_version",
    "resolve_version",
    "router",
    "version_info",
]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["registry"])

_LABEL_OBJECT_MAX = 64 * 1024
_IMMUTABLE = "private, max-age=31536000, immutable"


@contextmanager
def database_errors(what: str) -> Iterator[None]:
    """Map SQLAlchemy's connection-level failures of ``what`` (locked, timed out, unreachable) to 503."""
    try:
        yield
    except (exc.OperationalError, exc.InterfaceError) as err:
        raise DatabaseUnavailable(
            f"{what}: the database is unavailable or busy ({type(err.orig).__name__}: {err.orig}); retry shortly"
        ) from None
    except exc.TimeoutError:
        raise DatabaseUnavailable(
            f"{what}: every database connection is in use (pool timeout); the control plane is overloaded, retry shortly"
        ) from None


def as_utc(moment: datetime) -> datetime:
    """``moment`` as an aware UTC datetime (SQLite hands stored datetimes back naive)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def version_info(session: Session, row: VersionRow) -> VersionInfo:
    """The API view of a version row, with its labels."""
    labels = session.scalars(select(LabelRow.label).where(LabelRow.digest == row.digest).order_by(LabelRow.label))
    return _info(row, list(labels))


def _info(row: VersionRow, labels: Sequence[str]) -> VersionInfo:
    return VersionInfo(
        model=row.model,
        digest=row.digest,
        labels=list(labels),
        state=row.state,
        size=row.size,
        files=row.files,
        created_at=row.created_at,
        created_by=row.created_by,
    )


def resolve_version(session: Session, model: str, ref: str) -> VersionRow:
    """The version of ``model`` that ``ref`` names: a label, or a ``sha256:<hex>`` digest."""
    if ref.startswith("sha256:"):
        parse_digest(ref)
        row = session.get(VersionRow, ref)
        if row is None or row.model != model:
            raise NotFoundError(f"model {model!r} has no version {ref}; list them with GET /v1/models/{model}/versions")
        return row
    label = session.get(LabelRow, (model, ref))
    if label is None:
        raise NotFoundError(
            f"model {model!r} has no label {ref!r}; list its versions with GET /v1/models/{model}/versions"
        )
    row = session.get(VersionRow, label.digest)
    if row is None:  # the foreign key makes this impossible
        raise NotFoundError(f"label {ref!r} of model {model!r} names {label.digest}, which does not exist")
    return row


def check_labels_free(session: Session, model: str, digest: str, labels: Sequence[str]) -> None:
    """``ConflictError`` if any of ``labels`` of ``model`` already names another digest."""
    for label in labels:
        row = session.get(LabelRow, (model, label))
        if row is not None and row.digest != digest:
            raise ConflictError(
                f"label {label!r} of model {model!r} already names {row.digest}; labels never move to other "
                "content: choose a new label"
            )


def claim_label_objects(
    store: OriginStore, model: str, labels: Sequence[str], digest: str, actor: str, now: datetime
) -> None:
    """Write each label's write-once record to the store; ``ConflictError`` if one names other content."""
    for label in labels:
        key = label_key(model, label)
        record = {"model": model, "label": label, "digest": digest, "created_by": actor, "created_at": now.isoformat()}
        if store.put_once(key, canonical_json(record)):
            continue
        existing = json.loads(store.get_bytes(key, _LABEL_OBJECT_MAX))
        if existing.get("digest") != digest:
            raise ConflictError(
                f"label {label!r} of model {model!r} already names {existing.get('digest')} in the store; labels "
                "never move to other content: choose a new label"
            )


def pickle_files(manifest: Manifest) -> list[str]:
    """Paths of files in a pickle format (they run code when loaded)."""
    return [f.path for f in manifest.files if PurePosixPath(f.path).suffix.lower() in PICKLE_SUFFIXES]


def record_version(
    state: Any, manifest: Manifest, labels: Sequence[str], actor: str, now: datetime, allow_pickle: bool
) -> VersionInfo:
    """Insert (or find) the ready version row and its label rows, in one transaction.

    Call only once the blobs, the manifest and the label objects are in the store. Concurrent
    publishes of the same content race on primary keys; the loser retries and finds the rows.
    """
    for _attempt in range(3):
        with database_errors(f"recording version {manifest.digest}"), state.sessions() as session:
            try:
                model = session.get(ModelRow, manifest.model)
                if model is None:
                    model = ModelRow(name=manifest.model, allow_pickle=False, created_at=now)
                    session.add(model)
                    session.flush()
                if allow_pickle and pickle_files(manifest):
                    model.allow_pickle = True
                row = session.get(VersionRow, manifest.digest)
                if row is None:
                    row = VersionRow(
                        digest=manifest.digest,
                        model=manifest.model,
                        size=manifest.total_size,
                        files=len(manifest.files),
                        manifest_size=len(manifest.raw),
                        state="ready",
                        created_at=now,
                        created_by=actor,
                    )
                    session.add(row)
                    session.flush()
                check_labels_free(session, manifest.model, manifest.digest, labels)
                for label in labels:
                    if session.get(LabelRow, (manifest.model, label)) is None:
                        session.add(
                            LabelRow(
                                model=manifest.model,
                                label=label,
                                digest=manifest.digest,
                                created_at=now,
                                created_by=actor,
                            )
                        )
                session.commit()
                return version_info(session, row)
            except exc.IntegrityError:
                session.rollback()
    raise ConflictError(f"version {manifest.digest} is being recorded by a concurrent publish; commit again")


def known_chunk_lists(state: Any, blobs: Sequence[str], chunk_size: int) -> dict[str, list[str]]:
    """``{blob sha256: verified chunk digests}`` of those of ``blobs`` verified at ``chunk_size``."""
    if not blobs:
        return {}
    with database_errors("reading verified chunk lists"), state.sessions() as session:
        rows = session.scalars(
            select(BlobChunksRow).where(BlobChunksRow.chunk_size == chunk_size, BlobChunksRow.sha256.in_(set(blobs)))
        ).all()
    return {row.sha256: list(row.chunks) for row in rows}


def record_chunk_lists(state: Any, entries: Sequence[FileEntry], chunk_size: int, now: datetime) -> None:
    """Record the chunk lists of ``entries``, whose every byte was just verified at ``chunk_size``.

    A list already recorded stays: it was verified from the same bytes, so it is the same list.
    """
    todo = {e.sha256: e for e in entries}
    if not todo:
        return
    for _attempt in range(3):
        with database_errors("recording verified chunk lists"), state.sessions() as session:
            try:
                known = set(
                    session.scalars(
                        select(BlobChunksRow.sha256).where(
                            BlobChunksRow.chunk_size == chunk_size, BlobChunksRow.sha256.in_(set(todo))
                        )
                    )
                )
                for sha, entry in todo.items():
                    if sha not in known:
                        session.add(
                            BlobChunksRow(
                                sha256=sha, chunk_size=chunk_size, size=entry.size, chunks=list(entry.chunks),
                                verified_at=now,
                            )
                        )  # fmt: skip
                session.commit()
                return
            except exc.IntegrityError:
                session.rollback()  # a concurrent commit recorded one of them; look again
    raise ConflictError("verified chunk lists are being recorded by a concurrent publish; commit again")


# --- routes -------------------------------------------------------------------------------------


@router.get("/models", response_model=list[ModelInfo])
def list_models(request: Request, _principal: Principal = Depends(require(*ANY_ROLE))) -> list[ModelInfo]:
    """Every model, with its number of versions."""
    state = request.app.state.ws
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
        raise NotFoundError(f"model {name!r} does not exist; publish a version of it first")
    return row


@router.get("/models/{model}/versions", response_model=list[VersionInfo])
def list_versions(
    model: str, request: Request, _principal: Principal = Depends(require(*ANY_ROLE))
) -> list[VersionInfo]:
    """The model's versions, newest first, each with its labels."""
    state = request.app.state.ws
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
    return [_info(row, labels.get(row.digest, [])) for row in rows]


@router.get("/models/{model}/versions/{ref}", response_model=VersionInfo)
def get_version(
    model: str, ref: str, request: Request, _principal: Principal = Depends(require(*ANY_ROLE))
) -> VersionInfo:
    """One version, by label or digest."""
    state = request.app.state.ws
    with database_errors(f"reading {model}@{ref}"), state.sessions() as session:
        _model(session, model)
        return version_info(session, resolve_version(session, model, ref))


@router.get("/models/{model}/versions/{ref}/manifest", response_class=Response)
def get_manifest(
    model: str,
    ref: str,
    request: Request,
    if_none_match: str | None = Header(default=None),
    _principal: Principal = Depends(require(*ANY_ROLE)),
) -> Response:
    """The manifest bytes exactly as stored; ``ETag`` is the version digest."""
    state = request.app.state.ws
    with database_errors(f"reading {model}@{ref}"), state.sessions() as session:
        _model(session, model)
        digest = resolve_version(session, model, ref).digest
    etag = f'"{digest}"'
    if if_none_match is not None and etag in {t.strip() for t in if_none_match.split(",")}:
        return Response(status_code=304, headers={"ETag": etag, "Cache-Control": _IMMUTABLE})
    raw = state.store.get_bytes(manifest_key(digest), MAX_MANIFEST_BYTES)
    if sha256_hex(raw) != hex_of(digest):
        raise IntegrityError(
            f"the stored manifest of {digest} does not hash to its digest; the origin store is corrupt: "
            "restore manifests/sha256/ from a backup"
        )
    return Response(content=raw, media_type="application/json", headers={"ETag": etag, "Cache-Control": _IMMUTABLE})


@router.post("/models/{model}/labels", response_model=VersionInfo)
def add_label(
    model: str,
    body: LabelCreate,
    request: Request,
    response: Response,
    principal: Principal = Depends(require(Role.publisher)),
) -> VersionInfo:
    """Label a ready version; the same label again on the same digest is a no-op, elsewhere a 409."""
    state = request.app.state.ws
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
        log.info("label_added model=%s label=%s digest=%s by=%s", model, body.label, body.digest, principal.name)
        response.status_code = 201
        return version_info(session, resolve_version(session, model, body.digest))


@router.post("/blobs/urls", response_model=BlobURLs)
def blob_urls(
    body: BlobURLRequest, request: Request, _principal: Principal = Depends(require(Role.agent, Role.operator))
) -> BlobURLs:
    """Short-lived read URLs for blobs: presigned S3 GETs, or signed URLs served by this API."""
    state = request.app.state.ws
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


@router.head("/blobs/{sha256}", response_class=FileResponse, include_in_schema=False)
@router.get("/blobs/{sha256}", response_class=FileResponse)
def read_blob(
    sha256: str, request: Request, expires: int = Query(..., ge=0, le=INT64_MAX), sig: str = Query(..., max_length=128)
) -> FileResponse:
    """A blob of the local store, on a signed URL; HTTP range requests are served from the file."""
    state = request.app.state.ws
    store = state.store
    if not is_hex(sha256):
        raise NotFoundError(f"{sha256!r} is not a blob name (64 lowercase hex)")
    verify_blob_signature(state.settings.url_signing_key, sha256, expires, sig, time.time())
    if not isinstance(store, LocalStore):
        raise NotFoundError("this control plane's store is S3: read blobs from presigned URLs (POST /v1/blobs/urls)")
    path = store.blob_path(sha256)
    if not path.is_file():
        raise NotFoundError(f"blob {sha256} is not in the store")
    return FileResponse(
        path,
        media_type="application/octet-stream",
        headers={"ETag": f'"{sha256}"', "Cache-Control": _IMMUTABLE},
    )
