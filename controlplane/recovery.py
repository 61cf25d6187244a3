"""Disaster recovery: rebuild the version index from the origin store alone.

The store holds everything the index needs, because publishing writes it there before the
database: ``manifests/sha256/<hex>`` (each version, byte-exact: model, files, sizes),
``provenance/sha256/<hex>`` (who published it and when) and ``labels/<model>/<label>`` (which
digest each label names, written once). ``rebuild_index`` reads them into an *empty* database:

- every manifest whose bytes hash to its key, that parses, and whose blobs are all present under
  ``blobs/sha256/`` becomes a ready version (and its model a model row; ``allow_pickle`` where a
  version holds pickle files, since such a version could only have been published with it);
- every label record naming a recovered version of its model becomes a label row.

Anything else is reported, not guessed at. Deployments, tokens and upload sessions are not in
the store and are not recovered: re-create deployments and mint tokens after a recovery. Nor are
verified chunk lists (``blob_chunks``): safe to lose, since a blob without one is hashed again the
first time a new manifest names it. Staged S3 uploads (``uploads/``) are not versions and are ignored.

Command line::

    python -m controlplane.recovery --store s3://bucket/prefix --database postgresql+psycopg://... \\
        [--s3-endpoint-url URL] [--s3-region REGION]

It migrates the database to the newest schema, rebuilds, and prints one JSON line with the counts
and problems; exit status 0 when everything in the store was recovered, 1 when something was
skipped, 2 when recovery could not run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.persistence import migrate
from controlplane.persistence.engine import database_errors, make_engine, make_sessionmaker
from controlplane.persistence.rows import LabelRow, ModelRow, VersionRow, utcnow
from controlplane.persistence.store import OriginStore, provenance_key, store_from_url
from controlplane.persistence.store.origin import BLOBS, LABELS, MANIFESTS
from controlplane.registry import as_utc, pickle_files
from weightship.errors import ConflictError, ManifestError, NotFoundError, WeightshipError
from weightship.logs import event
from weightship.manifest import MAX_MANIFEST_BYTES, Manifest, manifest_bytes_match, parse_manifest

__all__ = ["RecoveryReport", "main", "rebuild_index"]

log = logging.getLogger(__name__)

_RECORD_MAX = 64 * 1024


@dataclass
class RecoveryReport:
    """What a rebuild found: rows written, and everything it skipped with the reason."""

    models: int = 0
    versions: int = 0
    labels: int = 0
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Version:
    manifest: Manifest
    created_at: datetime
    created_by: str


def _record(store: OriginStore, key: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(store.get_bytes(key, _RECORD_MAX))
    except NotFoundError:
        return None
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _read_version(store: OriginStore, key: str, blobs: set[str], report: RecoveryReport) -> _Version | None:
    hex_digest = key.removeprefix(MANIFESTS)
    raw = store.get_bytes(key, MAX_MANIFEST_BYTES)
    if not manifest_bytes_match(raw, hex_digest):
        report.skipped.append(f"{key}: bytes do not hash to the key (corrupt manifest)")
        return None
    try:
        manifest = parse_manifest(raw)
    except ManifestError as exc:
        report.skipped.append(f"{key}: not a valid manifest ({exc.message})")
        return None
    missing = sorted({f.sha256 for f in manifest.files} - blobs)
    if missing:
        report.skipped.append(f"{manifest.digest} ({manifest.model}): {len(missing)} blobs missing, e.g. {missing[0]}")
        return None
    provenance = _record(store, provenance_key(manifest.digest)) or {}
    try:
        created_at = as_utc(datetime.fromisoformat(str(provenance["created_at"])))
    except (KeyError, ValueError):
        created_at = utcnow()
    return _Version(manifest=manifest, created_at=created_at, created_by=str(provenance.get("created_by", "recovery")))


def _require_empty(session: Session) -> None:
    for table in (ModelRow, VersionRow, LabelRow):
        count = session.scalar(select(func.count()).select_from(table)) or 0
        if count:
            raise ConflictError(
                f"the database already holds {count} rows in {table.__tablename__}; recover into an empty database"
            )


def rebuild_index(store: OriginStore, sessions: sessionmaker[Any]) -> RecoveryReport:
    """Rebuild models, versions and labels from ``store`` into the empty database of ``sessions``."""
    report = RecoveryReport()
    with database_errors("checking the database"), sessions() as session:
        _require_empty(session)
    blobs = {key.removeprefix(BLOBS) for key in store.list_keys(BLOBS)}
    versions: dict[str, _Version] = {}
    for key in sorted(store.list_keys(MANIFESTS)):
        version = _read_version(store, key, blobs, report)
        if version is not None:
            versions[version.manifest.digest] = version
    labels: list[tuple[str, str, str, datetime, str]] = []
    for key in sorted(store.list_keys(LABELS)):
        _, model, label = key.split("/", 2)
        record = _record(store, key) or {}
        digest = str(record.get("digest", ""))
        if digest not in versions or versions[digest].manifest.model != model:
            report.skipped.append(f"{key}: names {digest or 'nothing'}, not a recovered version of {model!r}")
            continue
        try:
            created_at = as_utc(datetime.fromisoformat(str(record["created_at"])))
        except (KeyError, ValueError):
            created_at = utcnow()
        labels.append((model, label, digest, created_at, str(record.get("created_by", "recovery"))))
    with database_errors("writing the recovered index"), sessions() as session:
        _require_empty(session)
        models: dict[str, ModelRow] = {}
        for version in sorted(versions.values(), key=lambda v: v.created_at):
            manifest = version.manifest
            model_row = models.get(manifest.model)
            if model_row is None:
                model_row = ModelRow(name=manifest.model, allow_pickle=False, created_at=version.created_at)
                models[manifest.model] = model_row
                session.add(model_row)
            model_row.allow_pickle = model_row.allow_pickle or bool(pickle_files(manifest))
        session.flush()
        for version in versions.values():
            manifest = version.manifest
            session.add(
                VersionRow(
                    digest=manifest.digest,
                    model=manifest.model,
                    size=manifest.total_size,
                    files=len(manifest.files),
                    manifest_size=len(manifest.raw),
                    state="ready",
                    created_at=version.created_at,
                    created_by=version.created_by,
                )
            )
        session.flush()
        for model_name, label, digest, created_at, created_by in labels:
            session.add(
                LabelRow(model=model_name, label=label, digest=digest, created_at=created_at, created_by=created_by)
            )
        session.commit()
    report.models, report.versions, report.labels = len(models), len(versions), len(labels)
    event(
        log,
        "index.rebuilt",
        store=store.describe(),
        models=report.models,
        versions=report.versions,
        labels=report.labels,
        skipped=len(report.skipped),
    )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m controlplane.recovery``: see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m controlplane.recovery", description="Rebuild the version index from the origin store alone."
    )
    parser.add_argument("--store", required=True, help="local:/path or s3://bucket[/prefix]")
    parser.add_argument("--database", required=True, help="SQLAlchemy URL of an empty database")
    parser.add_argument("--s3-endpoint-url", default="", help="S3 endpoint (MinIO, moto); empty for AWS")
    parser.add_argument("--s3-region", default="us-east-1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    engine = make_engine(args.database)
    try:
        migrate.upgrade(engine)
        store = store_from_url(args.store, s3_endpoint_url=args.s3_endpoint_url, s3_region=args.s3_region)
        report = rebuild_index(store, make_sessionmaker(engine))
    except WeightshipError as exc:
        print(f"recovery failed: {exc.message}", file=sys.stderr)
        return 2
    finally:
        engine.dispose()
    print(json.dumps({"event": "recovered", **asdict(report)}, sort_keys=True))
    return 1 if report.skipped else 0


if __name__ == "__main__":
    sys.exit(main())
