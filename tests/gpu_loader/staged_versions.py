"""Helpers for gpu_loader tests: agent-style version directories, and polling with a deadline."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from weightship.digests import hex_of
from weightship.layout import MANIFEST_FILE, META_DIR, read_version_manifest, write_verification
from weightship.manifest import Manifest, build_manifest

#: Small chunks, so that tensors span several chunks and chunks hold several tensors.
CHUNK = 256 * 1024


def stage(model_dir: Path, data_dir: Path, *, model: str = "tiny", chunk_size: int = CHUNK, verified: bool = True) -> Path:
    """Lay ``model_dir`` out as the agent does: ``versions/<hex>/`` with manifest and verification record."""
    manifest = build_manifest(model_dir, model, chunk_size=chunk_size)
    target = data_dir / "versions" / hex_of(manifest.digest)
    if not target.exists():
        shutil.copytree(model_dir, target)
        (target / META_DIR).mkdir(exist_ok=True)
        (target / META_DIR / MANIFEST_FILE).write_bytes(manifest.raw)
        if verified:
            write_verification(target, manifest)
    return target


def poll_until(condition: Callable[[], object], timeout: float, what: str) -> object:
    """Return ``condition()``'s first truthy value, polling until ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)  # ok-sleep: poll interval while waiting for a condition


def manifest_of(version: Path) -> Manifest:
    """The manifest stored in a staged version."""
    return read_version_manifest(version)
