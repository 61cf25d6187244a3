"""Publishing over REST: upload sessions, their parts, commit, and the expiry of abandoned ones.

A session carries one manifest from "bytes on a publisher's disk" to "ready version"::

    open ──commit──▶ verifying ──▶ committed
      │    ▲             │
      │    └──refused────┘  (422/409: fix and commit again)
      └──DELETE or expiry──▶ aborted

``POST /v1/uploads`` validates the manifest (``parse_manifest``; pickle files only where allowed),
refuses labels that already name other content, and asks the store which blobs it lacks: for each
it opens an upload (S3 multipart, or local staging) and records ``blob sha256 -> upload id`` in
the row's ``uploads``. A blob missing from ``uploads`` was in the store already. The answer lists,
per missing blob, one part per chunk with where to PUT it: a presigned S3 ``UploadPart`` URL with
the ``x-amz-checksum-sha256`` header it must carry, or ``/v1/uploads/{id}/blobs/{sha}/parts/{n}``
on this API (local store), where the part is hashed while it streams to disk and kept only if it
matches its chunk digest.

Opening the same manifest again while its session is open returns that session (resume), with
``done`` set on every part the store already holds (S3 ``ListParts``, local part markers), new
labels, and a new expiry. Content that is already a ready version gets a session with nothing to
upload, and committing it returns the same version id.

``POST /v1/uploads/{id}/commit`` moves the session to ``verifying`` (visible to ``GET``; a second
commit meanwhile is a 409) and holds the trust invariant (``docs/architecture.md``): the version
becomes ready only once every byte of every blob it names was verified against the digests its
manifest states. Per blob:

- uploaded by this session: the store completes it, checking every chunk digest and the
  whole-file SHA-256 before anything appears under ``blobs/`` (``OriginStore.complete_upload``);
- already stored, with a verified chunk list at this chunk size (``blob_chunks``): the manifest's
  list must equal it exactly, else a 422 naming the file, the blob and the first differing chunk;
- already stored, never verified at this chunk size: the control plane hashes the stored bytes
  under this geometry (``verify_stored``), every chunk and the whole file.

Each list verified so is recorded, then the manifest (write-once), provenance and label records are
written, and only then the version row is inserted, ready. Any failure leaves the version absent
and the session open: a part that does not match is an ``IntegrityError`` (422), a part never
uploaded a ``ConflictError`` (409). Opening a session checks known chunk lists already, so a
manifest re-describing a known blob is refused before anything is uploaded.

Sessions expire at ``expires_at`` (``settings.upload_ttl_seconds`` after the last open or the start
of a commit, so a commit that died while verifying frees its session at the latest then). Expired
sessions are swept (store uploads aborted, staging removed, state ``aborted``) at every open and
by ``sweep_expired_uploads``, which a periodic task may call. The clock is
``AppState.clock``, so tests control time.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

from sqlalchemy import select, update
from sqlalchemy.engine import CursorResult

from controlplane.auth import Principal
from controlplane.persistence.engine import database_errors
from controlplane.persistence.rows import ModelRow, UploadSessionRow, VersionRow
from controlplane.persistence.store import BlobStat, OriginStore, PartSpec, blob_key, manifest_key, provenance_key
from controlplane.persistence.store.parts import plan_parts, stat_matches, verify_stored
from controlplane.registry import (
    check_labels_free,
    claim_label_objects,
    known_chunk_lists,
    pickle_files,
    record_chunk_lists,
    record_version,
    version_info,
)
from controlplane.signatures import add_signatures
from controlplane.state import AppState
from weightship.digests import sha256_hex
from weightship.errors import (
    ConflictError,
    IntegrityError,
    ManifestError,
    NotFoundError,
    StoreError,
    WeightshipError,
)
from weightship.logs import event
from weightship.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest, canonical_json, parse_manifest
from weightship.schemas import BlobUpload, PartUpload, UploadCreate, UploadSession, VersionInfo

__all__ = [
    "MAX_REQUEST_BYTES",
    "abandon_session",
    "commit_session",
    "open_session",
    "part_to_upload",
    "read_session",
    "sweep_expired_uploads",
]

log = logging.getLogger(__name__)


#: A manifest inside a JSON string may grow by escaping; anything beyond this is refused unread.
MAX_REQUEST_BYTES = 2 * MAX_MANIFEST_BYTES + 64 * 1024
_SWEEP_BATCH = 50
_POOL = 8
_CACHE_SIZE = 8
_CACHE: OrderedDict[str, Manifest] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_T = TypeVar("_T")
_EMPTY_SHA256 = sha256_hex(b"")
#: sessions in these states still hold store uploads (and expire)
_LIVE = ("open", "verifying")


def _manifest(raw: bytes, digest: str) -> Manifest:
    """The parsed manifest of a session, cached by digest (part uploads look it up every time)."""
    with _CACHE_LOCK:
        cached = _CACHE.get(digest)
        if cached is not None:
            _CACHE.move_to_end(digest)
            return cached
    manifest = parse_manifest(raw)
    with _CACHE_LOCK:
        _CACHE[digest] = manifest
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return manifest


def _in_parallel(fn: Callable[[FileEntry], _T], entries: list[FileEntry]) -> list[_T]:
    """``fn`` over ``entries`` on a small pool; raises the first ``IntegrityError``, else the first error."""
    if len(entries) <= 1:
        return [fn(e) for e in entries]
    results: list[_T] = []
    errors: list[WeightshipError] = []
    with ThreadPoolExecutor(min(_POOL, len(entries)), thread_name_prefix="ws-publish") as pool:
        for future in [pool.submit(fn, e) for e in entries]:
            try:
                results.append(future.result())
            except WeightshipError as err:
                errors.append(err)
    if errors:
        raise next((e for e in errors if isinstance(e, IntegrityError)), errors[0])
    return results


def _check_stored(entry: FileEntry, stat: BlobStat, chunk_size: int, known: list[str] | None) -> None:
    """Refuse a manifest entry that contradicts a stored blob: its verified chunk list, size or store checksum."""
    if known is not None and list(entry.chunks) != known:
        index = next((i for i, (a, b) in enumerate(zip(entry.chunks, known, strict=False)) if a != b), None)
        if index is None:
            where = f"the manifest states {len(entry.chunks)} chunks, the verified list has {len(known)}"
        else:
            where = f"first at chunk {index}: verified {known[index]}, the manifest states {entry.chunks[index]}"
        raise IntegrityError(
            f"file {entry.path}: blob {entry.sha256} was verified at chunk size {chunk_size} with chunk digests "
            f"that differ from this manifest's ({where}); the manifest does not describe these bytes: rebuild it "
            "from the files and publish again"
        )
    if not stat_matches(stat, entry, chunk_size):
        raise IntegrityError(
            f"the store already holds blob {entry.sha256} ({entry.path}), but its size or checksums differ from "
            "this manifest's; the manifest's digests are wrong: rebuild it from the files and publish again"
        )


def _check_empty(entry: FileEntry) -> None:
    """An empty file's blob name must be the SHA-256 of nothing (else an empty object would squat the name)."""
    if entry.sha256 != _EMPTY_SHA256:
        raise IntegrityError(
            f"file {entry.path} has size 0 but sha256 {entry.sha256}; an empty file hashes to {_EMPTY_SHA256}: "
            "rebuild the manifest from the files and publish again"
        )


# --- opening and resuming -----------------------------------------------------------------------


def _begin_uploads(store: OriginStore, manifest: Manifest, known: Mapping[str, list[str]]) -> dict[str, str]:
    """Open an upload for every blob the store lacks; ``{sha256: upload id}``.

    Stored blobs are checked against ``known`` (verified chunk lists); empty files need no upload
    (commit writes them). If any blob fails, the uploads already opened are aborted again before
    the error is raised.
    """

    def begin(entry: FileEntry) -> tuple[str, str | None, WeightshipError | None]:
        try:
            if entry.size == 0:
                _check_empty(entry)
            stat = store.stat_blob(entry.sha256)
            if stat is not None:
                _check_stored(entry, stat, manifest.chunk_size, known.get(entry.sha256))
                return entry.sha256, None, None
            if entry.size == 0:
                return entry.sha256, None, None
            return entry.sha256, store.begin_upload(entry.sha256, manifest.chunk_size), None
        except WeightshipError as err:
            return entry.sha256, None, err

    results = _in_parallel(begin, manifest.blobs())
    opened = {sha: upload_id for sha, upload_id, _ in results if upload_id is not None}
    errors = [err for _, _, err in results if err is not None]
    if errors:
        _abort_all(store, opened, best_effort=True)
        raise next((e for e in errors if isinstance(e, IntegrityError)), errors[0])
    return opened


def _refresh(
    store: OriginStore, uploads: Mapping[str, str], manifest: Manifest, known: Mapping[str, list[str]]
) -> tuple[dict[str, str], dict[str, set[int]]]:
    """Which parts each open upload holds; drops blobs published meanwhile and replaces lost uploads."""
    entries = [e for e in manifest.blobs() if e.sha256 in uploads]

    def check(entry: FileEntry) -> tuple[str, str | None, set[int]]:
        sha, upload_id = entry.sha256, uploads[entry.sha256]
        stat = store.stat_blob(sha)
        if stat is not None:
            _check_stored(entry, stat, manifest.chunk_size, known.get(sha))
            store.abort_upload(sha, upload_id)
            return sha, None, set()
        try:
            held = store.uploaded_parts(sha, upload_id)
        except NotFoundError:
            return sha, store.begin_upload(sha, manifest.chunk_size), set()
        done = {
            p.number
            for p in plan_parts(entry, manifest.chunk_size)
            if (h := held.get(p.number)) is not None and h.size == p.length and h.sha256 in (None, p.sha256)
        }
        return sha, upload_id, done

    fresh: dict[str, str] = {}
    done: dict[str, set[int]] = {}
    for sha, upload_id, parts in _in_parallel(check, entries):
        if upload_id is not None:
            fresh[sha] = upload_id
            done[sha] = parts
    return fresh, done


def _view(
    state: AppState, row: UploadSessionRow, manifest: Manifest, done: Mapping[str, set[int]], now: datetime
) -> UploadSession:
    """The API view of a session: per blob, present, or its parts with where to PUT them."""
    store: OriginStore = state.store
    expires_in = max(60, int((row.expires_at - now).total_seconds()))
    method = "s3-multipart" if store.kind == "s3" else "http-put"
    blobs: list[BlobUpload] = []
    missing = 0
    for entry in manifest.blobs():
        upload_id = row.uploads.get(entry.sha256)
        if upload_id is None or row.state != "open":
            present = row.state == "committed" or upload_id is None
            blobs.append(BlobUpload(sha256=entry.sha256, size=entry.size, present=present, method=method))
            continue
        parts: list[PartUpload] = []
        for spec in plan_parts(entry, manifest.chunk_size):
            target = store.part_target(entry.sha256, upload_id, spec, expires_in)
            is_done = spec.number in done.get(entry.sha256, set())
            missing += 0 if is_done else spec.length
            parts.append(
                PartUpload(
                    number=spec.number,
                    offset=spec.offset,
                    length=spec.length,
                    sha256=spec.sha256,
                    url=target.url if target else f"/v1/uploads/{row.id}/blobs/{entry.sha256}/parts/{spec.number}",
                    headers=target.headers if target else {},
                    done=is_done,
                )
            )
        blobs.append(BlobUpload(sha256=entry.sha256, size=entry.size, present=False, method=method, parts=parts))
    return UploadSession(
        id=row.id,
        model=row.model,
        digest=row.digest,
        state=row.state,
        expires_at=row.expires_at,
        labels=list(row.labels),
        blobs=blobs,
        bytes_total=manifest.total_size,
        bytes_missing=missing,
    )


def open_session(state: AppState, principal: Principal, create: UploadCreate) -> tuple[UploadSession, bool]:
    """Open a session for ``create.manifest``, or resume its open one; ``True`` if newly opened."""
    store: OriginStore = state.store
    manifest = parse_manifest(create.manifest.encode("utf-8"))
    store.check_manifest(manifest)
    labels = list(dict.fromkeys(create.labels))
    now = state.clock()
    ttl = timedelta(seconds=int(state.settings.upload_ttl_seconds))
    sweep_expired_uploads(state, now=now, limit=_SWEEP_BATCH)
    known = known_chunk_lists(state, [e.sha256 for e in manifest.blobs()], manifest.chunk_size)
    with database_errors("opening an upload session"), state.sessions() as session:
        model = session.get(ModelRow, manifest.model)
        allow_pickle = create.allow_pickle or (model is not None and model.allow_pickle)
        pickled = pickle_files(manifest)
        if pickled and not allow_pickle:
            raise ManifestError(
                f"pickle-format files {pickled[:5]} can run code when loaded; convert them to safetensors, or "
                f"publish with allow_pickle to allow pickle for model {manifest.model!r}"
            )
        check_labels_free(session, manifest.model, manifest.digest, labels)
        ready = session.get(VersionRow, manifest.digest) is not None
        row = session.scalars(
            select(UploadSessionRow)
            .where(
                UploadSessionRow.digest == manifest.digest,
                UploadSessionRow.state == "open",
                UploadSessionRow.expires_at > now,
            )
            .order_by(UploadSessionRow.created_at.desc())
            .limit(1)
        ).first()
        if row is not None:
            uploads, done = _refresh(store, row.uploads, manifest, known)
            row.uploads = uploads
            row.labels = labels
            row.allow_pickle = allow_pickle
            row.expires_at = now + ttl
            session.commit()
            event(log, "upload.resumed", session=row.id, model=row.model, digest=row.digest)
            return _view(state, row, manifest, done, now), False
    uploads = {} if ready else _begin_uploads(store, manifest, known)
    row = UploadSessionRow(
        id="up_" + secrets.token_hex(16),
        model=manifest.model,
        digest=manifest.digest,
        manifest=manifest.raw,
        labels=labels,
        allow_pickle=allow_pickle,
        uploads=uploads,
        state="open",
        created_at=now,
        expires_at=now + ttl,
        created_by=principal.name,
    )
    try:
        with database_errors("opening an upload session"), state.sessions() as session:
            session.add(row)
            session.commit()
    except WeightshipError:
        _abort_all(store, uploads, best_effort=True)
        raise
    event(
        log,
        "upload.opened",
        session=row.id,
        model=row.model,
        digest=row.digest,
        blobs_missing=len(uploads),
        by=principal.name,
    )
    return _view(state, row, manifest, {}, now), True


# --- expiry and abort ---------------------------------------------------------------------------


def _abort_all(store: OriginStore, uploads: Mapping[str, str], best_effort: bool = False) -> None:
    """Abort store uploads; ``best_effort`` (cleaning up after another error) logs failures instead."""
    for sha, upload_id in uploads.items():
        try:
            store.abort_upload(sha, upload_id)
        except WeightshipError as err:
            if not best_effort:
                raise
            event(log, "upload.abort_failed", logging.WARNING, blob=sha, upload=upload_id, error=err.message)


def _abort(state: AppState, row: UploadSessionRow, reason: str) -> None:
    """Abort the session's store uploads, then mark it aborted (only if still open or verifying)."""
    _abort_all(state.store, row.uploads)
    with database_errors("aborting an upload session"), state.sessions() as session:
        session.execute(
            update(UploadSessionRow)
            .where(UploadSessionRow.id == row.id, UploadSessionRow.state.in_(_LIVE))
            .values(state="aborted")
        )
        session.commit()
    row.state = "aborted"
    event(log, "upload.aborted", session=row.id, digest=row.digest, reason=reason)


def sweep_expired_uploads(state: AppState, now: datetime | None = None, limit: int = 500) -> int:
    """Abort up to ``limit`` open (or verifying) sessions past their expiry; returns how many were aborted.

    A store failure leaves that session open for the next sweep rather than failing the caller.
    """
    now = now or state.clock()
    with database_errors("sweeping upload sessions"), state.sessions() as session:
        rows = session.scalars(
            select(UploadSessionRow)
            .where(UploadSessionRow.state.in_(_LIVE), UploadSessionRow.expires_at <= now)
            .order_by(UploadSessionRow.expires_at)
            .limit(limit)
        ).all()
    swept = 0
    for row in rows:
        try:
            _abort(state, row, "expired")
            swept += 1
        except WeightshipError as err:
            event(log, "upload.sweep_failed", logging.WARNING, session=row.id, error=err.message)
    return swept


def _load(state: AppState, upload_id: str) -> UploadSessionRow:
    with database_errors(f"reading upload session {upload_id}"), state.sessions() as session:
        row: UploadSessionRow | None = session.get(UploadSessionRow, upload_id)
    if row is None:
        raise NotFoundError(f"upload session {upload_id!r} does not exist; open one with POST /v1/uploads")
    return row


def _load_open(state: AppState, upload_id: str, now: datetime) -> UploadSessionRow:
    row = _load(state, upload_id)
    if row.state in _LIVE and row.expires_at <= now:
        _abort(state, row, "expired")
        raise ConflictError(
            f"upload session {upload_id} expired at {row.expires_at.isoformat()}; its parts were discarded: "
            "publish again (POST /v1/uploads)"
        )
    if row.state == "verifying":
        raise ConflictError(
            f"upload session {upload_id} is verifying its blobs for a commit already running; poll "
            f"GET /v1/uploads/{upload_id} until it is committed (or open again), then act"
        )
    if row.state != "open":
        raise ConflictError(f"upload session {upload_id} is {row.state}; open a new one with POST /v1/uploads")
    return row


# --- commit -------------------------------------------------------------------------------------


def _publish_blobs(
    store: OriginStore, manifest: Manifest, uploads: Mapping[str, str], known: Mapping[str, list[str]]
) -> list[FileEntry]:
    """Verify every blob of ``manifest`` (module docstring); returns those whose chunk list was verified now."""
    chunk_size = manifest.chunk_size

    def publish(entry: FileEntry) -> FileEntry | None:
        sha, upload_id = entry.sha256, uploads.get(entry.sha256)
        stat = store.stat_blob(sha)
        if stat is None and entry.size == 0:
            _check_empty(entry)
            store.put_once(blob_key(sha), b"")
            return entry
        if stat is None:
            if upload_id is None:
                raise ConflictError(
                    f"blob {sha} ({entry.path}) is not in the store and this session has no upload for it; "
                    "open the session again (POST /v1/uploads with the same manifest)"
                )
            if store.complete_upload(sha, upload_id, plan_parts(entry, chunk_size)):
                return entry  # every chunk and the whole file checked by the store before it was published
            upload_id = None  # another upload published it first; check that one like any stored blob
            stat = store.stat_blob(sha)
            if stat is None:
                raise StoreError(f"blob {sha} was reported present by {store.describe()} but cannot be found")
        _check_stored(entry, stat, chunk_size, known.get(sha))
        if upload_id is not None:
            store.abort_upload(sha, upload_id)
        if sha in known:
            return None
        event(log, "blob.verifying", blob=sha, path=entry.path, chunk_size=chunk_size, bytes=entry.size)
        verify_stored(store, entry, chunk_size)
        return entry

    return [e for e in _in_parallel(publish, manifest.blobs()) if e is not None]


def _start_verifying(state: AppState, row: UploadSessionRow, now: datetime) -> None:
    """Move the session from open to verifying (compare-and-swap), so that one commit runs at a time."""
    lease = now + timedelta(seconds=int(state.settings.upload_ttl_seconds))
    with database_errors("starting a commit"), state.sessions() as session:
        moved = cast(
            "CursorResult[Any]",
            session.execute(
                update(UploadSessionRow)
                .where(UploadSessionRow.id == row.id, UploadSessionRow.state == "open")
                .values(state="verifying", expires_at=lease)
            ),
        ).rowcount
        session.commit()
    if not moved:
        _load_open(state, row.id, now)  # raises with the state it is in now
        raise ConflictError(f"upload session {row.id} changed while committing; commit again")


def _stop_verifying(state: AppState, row: UploadSessionRow) -> None:
    """Back to open after a refused or failed commit, so the publisher can fix it and commit again."""
    with database_errors("ending a commit"), state.sessions() as session:
        session.execute(
            update(UploadSessionRow)
            .where(UploadSessionRow.id == row.id, UploadSessionRow.state == "verifying")
            .values(state="open")
        )
        session.commit()


def commit_session(
    state: AppState, principal: Principal, upload_id: str, signatures: Sequence[bytes] = ()
) -> VersionInfo:
    """Verify and publish every blob, write manifest and labels, then record the version as ready.

    ``signatures`` (model-signing bundles) are checked against the signing policy first and stored
    write-once beside the manifest (``controlplane.signatures``); a model whose policy requires a
    signature is refused unsigned before any byte is verified.
    """
    store: OriginStore = state.store
    now = state.clock()
    row = _load(state, upload_id)
    if row.state == "committed":
        with database_errors("reading a version"), state.sessions() as session:
            version = session.get(VersionRow, row.digest)
            if version is not None:
                return version_info(session, version)
    row = _load_open(state, upload_id, now)
    labels = list(row.labels)
    with database_errors("checking labels"), state.sessions() as session:
        check_labels_free(session, row.model, row.digest, labels)
    manifest = _manifest(row.manifest, row.digest)
    add_signatures(state, manifest, signatures)
    _start_verifying(state, row, now)
    try:
        known = known_chunk_lists(state, [e.sha256 for e in manifest.blobs()], manifest.chunk_size)
        verified = _publish_blobs(store, manifest, row.uploads, known)
        record_chunk_lists(state, verified, manifest.chunk_size, now)
        info = _record(state, principal, row, manifest, labels, now)
    except BaseException:
        _stop_verifying(state, row)
        raise
    event(
        log,
        "version.committed",
        session=row.id,
        model=manifest.model,
        digest=manifest.digest,
        labels=",".join(labels),
        verified_blobs=len(verified),
        by=principal.name,
    )
    return info


def _record(
    state: AppState, principal: Principal, row: UploadSessionRow, manifest: Manifest, labels: list[str], now: datetime
) -> VersionInfo:
    """Once every blob is verified: manifest, provenance and label objects, the ready row, the session closed."""
    store: OriginStore = state.store
    key = manifest_key(manifest.digest)
    if not store.put_once(key, manifest.raw) and store.get_bytes(key, MAX_MANIFEST_BYTES) != manifest.raw:
        raise IntegrityError(
            f"the store holds other bytes under {key}; the origin store is corrupt: restore it from a backup"
        )
    provenance = {
        "digest": manifest.digest,
        "model": manifest.model,
        "created_by": principal.name,
        "created_at": now.isoformat(),
        "session": row.id,
    }
    store.put_once(provenance_key(manifest.digest), canonical_json(provenance))  # the first publisher's stays
    claim_label_objects(store, manifest.model, labels, manifest.digest, principal.name, now)
    info = record_version(state, manifest, labels, principal.name, now, row.allow_pickle)
    with database_errors("closing an upload session"), state.sessions() as session:
        session.execute(update(UploadSessionRow).where(UploadSessionRow.id == row.id).values(state="committed"))
        session.commit()
    return info


# --- routes -------------------------------------------------------------------------------------


def part_to_upload(state: AppState, upload_id: str, sha256: str, number: int) -> tuple[str, PartSpec]:
    row = _load_open(state, upload_id, state.clock())
    manifest = _manifest(row.manifest, row.digest)
    entry = next((e for e in manifest.files if e.sha256 == sha256), None)
    if entry is None:
        raise NotFoundError(f"blob {sha256} is not part of the manifest of upload session {upload_id}")
    upload = row.uploads.get(sha256)
    if upload is None:
        raise ConflictError(f"blob {sha256} is already in the store; it needs no upload")
    parts = plan_parts(entry, manifest.chunk_size)
    if not 1 <= number <= len(parts):
        raise NotFoundError(f"blob {sha256} has parts 1 to {len(parts)}, not {number}")
    return upload, parts[number - 1]


def read_session(state: AppState, upload_id: str) -> UploadSession:
    """A session with fresh part URLs and ``done`` flags; ``state`` is ``verifying`` while a commit checks its blobs."""
    now = state.clock()
    row = _load(state, upload_id)
    manifest = _manifest(row.manifest, row.digest)
    if row.state in _LIVE and row.expires_at <= now:
        _abort(state, row, "expired")
    done: dict[str, set[int]] = {}
    if row.state == "open":
        known = known_chunk_lists(state, [e.sha256 for e in manifest.blobs()], manifest.chunk_size)
        uploads, done = _refresh(state.store, row.uploads, manifest, known)
        if uploads != row.uploads:
            with database_errors("updating an upload session"), state.sessions() as session:
                session.execute(update(UploadSessionRow).where(UploadSessionRow.id == row.id).values(uploads=uploads))
                session.commit()
            row.uploads = uploads
    return _view(state, row, manifest, done, now)


def abandon_session(state: AppState, upload_id: str) -> None:
    """Abandon a session: its store uploads are aborted and its parts discarded; a committed one is a 409."""
    row = _load(state, upload_id)
    if row.state == "committed":
        raise ConflictError(f"upload session {upload_id} is committed; a committed version is never deleted")
    if row.state == "open":
        _abort(state, row, "deleted")
