"""HTTP routes of publish sessions (``controlplane.publish``): open, read, upload parts, commit, abandon."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError as PydanticValidationError
from starlette.concurrency import run_in_threadpool

from controlplane.auth import Principal
from controlplane.http import state_of
from controlplane.http.auth import require
from controlplane.http.problems import errors
from controlplane.persistence.store import OriginStore
from controlplane.publish import (
    MAX_REQUEST_BYTES,
    abandon_session,
    commit_session,
    open_session,
    part_to_upload,
    read_session,
)
from weightship.errors import (
    IntegrityError,
    ManifestError,
    ValidationError,
)
from weightship.manifest import MAX_MANIFEST_BYTES
from weightship.schemas import Role, UploadCreate, UploadSession, VersionInfo
from weightship.signing import SignatureUpload

__all__ = ["router"]

router = APIRouter(prefix="/v1/uploads", tags=["publish"])


_WRITE_BUFFER = 1024 * 1024


_PUBLISHER = require(Role.publisher)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_big = f"request body exceeds {limit} bytes: a manifest may be at most {MAX_MANIFEST_BYTES} bytes"
    if declared.isdigit() and int(declared) > limit:
        raise ManifestError(too_big)
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ManifestError(too_big)
    return bytes(body)


@router.post(
    "",
    response_model=UploadSession,
    status_code=201,
    responses=errors(400, 404, 409, 422, 502)
    | {200: {"description": "The open session of the same manifest, resumed"}},
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": UploadCreate.model_json_schema()}}}
    },
)
async def create_upload(
    request: Request, response: Response, principal: Principal = Depends(_PUBLISHER)
) -> UploadSession:
    """Open a publish session (201), or resume the open one for the same manifest (200)."""
    body = await _read_body(request, MAX_REQUEST_BYTES)
    try:
        create = UploadCreate.model_validate_json(body)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise ValidationError(f"{where}: {first.get('msg', 'invalid')}") from None
    session, created = await run_in_threadpool(open_session, state_of(request), principal, create)
    response.status_code = 201 if created else 200
    return session


@router.get("/{upload_id}", response_model=UploadSession, responses=errors(404, 502))
def get_upload(upload_id: str, request: Request, _principal: Principal = Depends(_PUBLISHER)) -> UploadSession:
    """A session with fresh part URLs and ``done`` flags; ``state`` is ``verifying`` while a commit checks its blobs."""
    return read_session(state_of(request), upload_id)


@router.put(
    "/{upload_id}/blobs/{sha256}/parts/{number}",
    status_code=204,
    response_class=Response,
    responses=errors(400, 404, 409, 422, 502),
)
async def put_part(
    upload_id: str, sha256: str, number: int, request: Request, _principal: Principal = Depends(_PUBLISHER)
) -> Response:
    """Stream one part to the local store's staging; kept only if its length and SHA-256 match."""
    state = state_of(request)
    store: OriginStore = state.store
    store_upload, spec = await run_in_threadpool(part_to_upload, state, upload_id, sha256, number)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) != spec.length:
        raise IntegrityError(
            f"part {number} of blob {sha256} must be {spec.length} bytes, the request declares {declared} "
            "(truncated or oversized upload); send exactly the chunk's bytes"
        )
    writer = await run_in_threadpool(store.open_part, sha256, store_upload, spec)
    try:
        buffer = bytearray()
        async for piece in request.stream():
            buffer += piece
            if len(buffer) >= _WRITE_BUFFER:
                await run_in_threadpool(writer.write, bytes(buffer))
                buffer.clear()
        if buffer:
            await run_in_threadpool(writer.write, bytes(buffer))
        await run_in_threadpool(writer.finish)
    except BaseException:
        writer.discard()
        raise
    return Response(status_code=204)


@router.post("/{upload_id}/commit", response_model=VersionInfo, responses=errors(400, 404, 409, 422, 502))
def commit_upload(
    upload_id: str,
    request: Request,
    body: SignatureUpload | None = None,
    principal: Principal = Depends(_PUBLISHER),
) -> VersionInfo:
    """Verify every blob and make the version ready (see the module docstring); ``signatures`` go with it."""
    signatures = [s.encode("utf-8") for s in body.signatures] if body is not None else []
    return commit_session(state_of(request), principal, upload_id, signatures)


@router.delete("/{upload_id}", status_code=204, response_class=Response, responses=errors(404, 409, 502))
def delete_upload(upload_id: str, request: Request, _principal: Principal = Depends(_PUBLISHER)) -> Response:
    """Abandon a session: its store uploads are aborted and its parts discarded."""
    abandon_session(state_of(request), upload_id)
    return Response(status_code=204)
