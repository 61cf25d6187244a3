"""Fixtures for gpu_loader tests: small generated models staged as agent-style version directories."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_loader.modelgen import GeneratedModel, generate
from tests.gpu_loader.staged_versions import stage, stage_odd


@dataclass(frozen=True)
class Versions:
    """Staged versions shared by the session (never modified: tests that damage files copy them)."""

    data_dir: Path
    sharded: Path
    single: Path
    variant: Path
    nan: Path
    noise: Path
    sharded_model: GeneratedModel


@pytest.fixture(scope="session")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Versions:
    root = tmp_path_factory.mktemp("models")
    data = tmp_path_factory.mktemp("data")
    made = generate(root / "sharded", size_mb=4, seed=11, shards=3)
    generate(root / "single", size_mb=2, seed=12)
    generate(root / "variant", size_mb=4, seed=11, shards=3, variant=1)
    generate(root / "nan", size_mb=2, seed=13, corrupt="nan")
    generate(root / "noise", size_mb=2, seed=13, corrupt="noise")
    return Versions(
        data_dir=data,
        sharded=stage(root / "sharded", data),
        single=stage(root / "single", data),
        variant=stage(root / "variant", data),
        nan=stage(root / "nan", data),
        noise=stage(root / "noise", data),
        sharded_model=made,
    )


@pytest.fixture
def fresh_copy(tmp_path: Path) -> Callable[[Path], Path]:
    """Copy a staged version to a private directory (same name) so a test may damage it."""

    def copy(version: Path) -> Path:
        target = tmp_path / "versions" / version.name
        shutil.copytree(version, target)
        return target

    return copy


@pytest.fixture(autouse=True)
def _private_checksum_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """verify='fast' records go to the test's own directory, never to ~/.cache."""
    directory = tmp_path / "checksums"
    monkeypatch.setenv("WEIGHTSHIP_CHECKSUM_DIR", str(directory))
    return directory


@pytest.fixture(scope="session")
def odd_version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A staged version of one hand-written file: see ``staged_versions.odd_tensors``."""
    return stage_odd(tmp_path_factory.mktemp("odd"))
