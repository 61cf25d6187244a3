"""The version index: models, ready versions and their labels, and read access to their bytes.

The database indexes what the origin store holds; the store is the truth. Beside versions it
keeps each stored blob's *verified* chunk list per chunk size (``blob_chunks``): written only
after every byte was checked under that geometry (``publish``), read to hold later manifests
naming the blob to exactly that list. A version row is
inserted only after every blob and the manifest are in the store (``publish``), and a label is
claimed twice, in this order: a write-once ``labels/<model>/<label>`` object in the store (so
labels survive the loss of the database, see ``recovery``), then its row. Labels never move: a
label already naming another digest is a ``ConflictError`` (409) at either step.

Its routes are in ``controlplane.http.registry``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import PurePosixPath

from sqlalchemy import exc, select
from sqlalchemy.orm import Session

from controlplane.persistence.engine import database_errors
from controlplane.persistence.rows import BlobChunksRow, LabelRow, ModelRow, VersionRow
from controlplane.persistence.store import OriginStore, label_key
from controlplane.state import AppState
from weightship.digests import parse_digest
from weightship.errors import ConflictError, NotFoundError
from weightship.manifest import (
    PICKLE_SUFFIXES,
    FileEntry,
    Manifest,
    canonical_json,
)
from weightship.schemas import VersionInfo

__all__ = [
    "as_utc",
    "check_labels_free",
    "claim_label_objects",
    "info_with_labels",
    "known_chunk_lists",
    "pickle_files",
    "record_chunk_lists",
    "record_version",
    "resolve_version",
    "version_info",
]

log = logging.getLogger(__name__)


_LABEL_OBJECT_MAX = 64 * 1024


def as_utc(moment: datetime) -> datetime:
    """``moment`` as an aware UTC datetime (SQLite hands stored datetimes back naive)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def version_info(session: Session, row: VersionRow) -> VersionInfo:
    """The API view of a version row, with its labels."""
    labels = session.scalars(select(LabelRow.label).where(LabelRow.digest == row.digest).order_by(LabelRow.label))
    return info_with_labels(row, list(labels))


def info_with_labels(row: VersionRow, labels: Sequence[str]) -> VersionInfo:
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
            raise NotFoundError(
                f"model {model!r} has no version {ref}; list them with GET /v1/models/{model}/versions",
                code="version_not_found",
                fields={"model": model, "version": ref},
            )
        return row
    label = session.get(LabelRow, (model, ref))
    if label is None:
        raise NotFoundError(
            f"model {model!r} has no label {ref!r}; list its versions with GET /v1/models/{model}/versions",
            code="version_not_found",
            fields={"model": model, "version": ref},
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
                "content: choose a new label",
                code="label_taken",
                fields={"model": model, "label": label, "digest": row.digest},
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
                "never move to other content: choose a new label",
                code="label_taken",
                fields={"model": model, "label": label, "digest": existing.get("digest")},
            )


def pickle_files(manifest: Manifest) -> list[str]:
    """Paths of files in a pickle format (they run code when loaded)."""
    return [f.path for f in manifest.files if PurePosixPath(f.path).suffix.lower() in PICKLE_SUFFIXES]


def record_version(
    state: AppState, manifest: Manifest, labels: Sequence[str], actor: str, now: datetime, allow_pickle: bool
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


def known_chunk_lists(state: AppState, blobs: Sequence[str], chunk_size: int) -> dict[str, list[str]]:
    """``{blob sha256: verified chunk digests}`` of those of ``blobs`` verified at ``chunk_size``."""
    if not blobs:
        return {}
    with database_errors("reading verified chunk lists"), state.sessions() as session:
        rows = session.scalars(
            select(BlobChunksRow).where(BlobChunksRow.chunk_size == chunk_size, BlobChunksRow.sha256.in_(set(blobs)))
        ).all()
    return {row.sha256: list(row.chunks) for row in rows}


def record_chunk_lists(state: AppState, entries: Sequence[FileEntry], chunk_size: int, now: datetime) -> None:
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


