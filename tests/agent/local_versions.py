"""Building ready versions on disk without a network, for store, retention and staging tests."""

from __future__ import annotations

from pathlib import Path

from agent.staging import Staging
from agent.store import VersionStore
from weightship.manifest import Manifest, build_manifest

CHUNK = 64 * 1024


def manifest_of(model_dir: Path, model: str = "m") -> Manifest:
    """The manifest of ``model_dir`` with 64 KiB chunks."""
    return build_manifest(model_dir, model, chunk_size=CHUNK)


def fill(staging: Staging, source: Path) -> None:
    """Place every missing chunk of ``staging`` from the files under ``source``."""
    for job in staging.jobs():
        entry = staging.manifest.files[job.placements[0].file]
        with open(source / entry.path, "rb") as handle:
            handle.seek(job.blob_offset)
            staging.place(job, memoryview(handle.read(job.length)))


def install(store: VersionStore, model_dir: Path, model: str = "m") -> Manifest:
    """Assemble ``model_dir`` through a staging area and install it as a ready version."""
    manifest = manifest_of(model_dir, model)
    staging = Staging(store.staging_dir, manifest)
    staging.open()
    fill(staging, model_dir)
    store.install(staging.finish(), manifest)
    staging.discard_journal()
    return manifest
