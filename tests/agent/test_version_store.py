"""The version store: start-up checks, atomic links, usage with hard links counted once."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.store import VersionStore
from tests.agent.local_versions import install
from weightship.digests import hex_of
from weightship.errors import NotFoundError


def test_recover_keeps_verified_versions_and_sets_aside_damaged_ones(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    store = VersionStore(tmp_path)
    good = install(store, make_model("a", seed=1))
    truncated = install(store, make_model("b", seed=2))
    unverified = install(store, make_model("c", seed=3))
    weights = next(f for f in truncated.files if f.path.endswith(".safetensors"))
    path = store.path(truncated.digest) / weights.path
    os.chmod(path, 0o644)
    os.truncate(path, 10)
    (store.path(unverified.digest) / ".weightship" / "verified.json").unlink()
    (store.versions_dir / "not-a-digest").mkdir()

    reopened = VersionStore(tmp_path)
    reopened.recover()
    assert set(reopened.ready()) == {good.digest}
    assert os.listdir(reopened.versions_dir) == [hex_of(good.digest)]
    assert os.listdir(reopened.trash_dir) == []


def test_current_link_is_swapped_atomically_and_only_to_ready_versions(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    store = VersionStore(tmp_path)
    v1 = install(store, make_model("a", seed=1))
    v2 = install(store, make_model("b", seed=2))
    store.link_current("chat", v1.digest)
    store.link_current("chat", v2.digest)
    assert store.current("chat") == v2.digest
    assert [p.name for p in (tmp_path / "deployments" / "chat").iterdir()] == ["current"]
    with pytest.raises(NotFoundError, match="not ready"):
        store.link_current("chat", "sha256:" + "0" * 64)


def test_usage_counts_hard_linked_files_once(tmp_path: Path, make_model: Callable[..., Path]) -> None:
    store = VersionStore(tmp_path)
    install(store, make_model("a", seed=1))
    one = store.usage_bytes()
    os.link(next(store.versions_dir.iterdir()) / "model.safetensors", tmp_path / "staging" / "x")
    assert store.usage_bytes() == one
