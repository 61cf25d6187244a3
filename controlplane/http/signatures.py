"""HTTP routes of a version's signatures (``controlplane.signatures``).

- ``GET /v1/models/{model}/versions/{ref}/signatures`` — any role (agents check them against
  their own policy before they fetch);
- ``POST /v1/models/{model}/versions/{ref}/signatures`` — publisher: add signatures (a second
  approver); each is checked against the signing policy and stored write-once. 201 with all of
  the version's signatures; a refusal is a 422 ``signature_refused`` naming model, key and reason.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from controlplane.auth import ANY_ROLE, Principal
from controlplane.http import state_of
from controlplane.http.auth import require
from controlplane.http.problems import errors
from controlplane.persistence.engine import database_errors
from controlplane.persistence.store import manifest_key
from controlplane.registry import resolve_version
from controlplane.signatures import add_signatures, stored_signatures
from controlplane.state import AppState
from weightship.manifest import MAX_MANIFEST_BYTES, parse_manifest
from weightship.schemas import Role
from weightship.signing import SignatureUpload, VersionSignatures

__all__ = ["router"]

router = APIRouter(prefix="/v1/models", tags=["signatures"])


def _digest(state: AppState, model: str, ref: str) -> str:
    with database_errors(f"reading {model}@{ref}"), state.sessions() as session:
        return resolve_version(session, model, ref).digest


def _listing(state: AppState, model: str, digest: str) -> VersionSignatures:
    signatures = [raw.decode("utf-8", "replace") for raw in stored_signatures(state.store, digest)]
    return VersionSignatures(model=model, digest=digest, signatures=signatures)


def _read(state: AppState, model: str, ref: str) -> VersionSignatures:
    return _listing(state, model, _digest(state, model, ref))


def _add(state: AppState, model: str, ref: str, body: SignatureUpload) -> VersionSignatures:
    digest = _digest(state, model, ref)
    manifest = parse_manifest(state.store.get_bytes(manifest_key(digest), MAX_MANIFEST_BYTES))
    add_signatures(state, manifest, [s.encode("utf-8") for s in body.signatures])
    return _listing(state, model, digest)


@router.get("/{model}/versions/{ref}/signatures", response_model=VersionSignatures, responses=errors(404, 502))
async def get_signatures(
    model: str, ref: str, request: Request, _principal: Principal = Depends(require(*ANY_ROLE))
) -> VersionSignatures:
    """Every signature the version holds, as stored."""
    return await run_in_threadpool(_read, state_of(request), model, ref)


@router.post(
    "/{model}/versions/{ref}/signatures",
    response_model=VersionSignatures,
    status_code=201,
    responses=errors(400, 404, 422, 502),
)
async def post_signatures(
    model: str,
    ref: str,
    body: SignatureUpload,
    request: Request,
    response: Response,
    _principal: Principal = Depends(require(Role.publisher)),
) -> VersionSignatures:
    """Add signatures to a version; checked against the signing policy, stored write-once."""
    return await run_in_threadpool(_add, state_of(request), model, ref, body)
