"""Building ready versions on disk without a network, for store, retention and staging tests."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

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


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``2m``) mounted at ``mount`` for real ENOSPC; skips where mounting is not allowed."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
