"""Retention: protected versions never go; partial areas, then least recently used versions, go first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agent.retention import Candidate, Retention, choose_eviction
from agent.staging import Staging
from agent.store import VersionStore
from tests.agent.local_versions import install, manifest_of
from weightship.errors import DiskFullError


def test_choose_eviction_prefers_partial_areas_then_the_oldest_unprotected_version() -> None:
    cands = [Candidate("a", False, 10.0), Candidate("b", False, 5.0), Candidate("c", True, 20.0)]
    assert choose_eviction(cands, set()) == cands[2]
    assert choose_eviction(cands, {"c"}) == cands[1]
    assert choose_eviction(cands, {"b", "c"}) == cands[0]
    assert choose_eviction(cands, {"a", "b", "c"}) is None


@pytest.fixture
def three(tmp_path: Path, make_model: Callable[..., Path]) -> tuple[VersionStore, list[str]]:
    store = VersionStore(tmp_path / "data")
    digests = [install(store, make_model(f"m{i}", tensors_mb=0.25, seed=i)).digest for i in range(3)]
    for n, digest in enumerate(digests):
        store._last_used[digest] = 100.0 + n  # v0 least recently used
    return store, digests


def test_make_room_evicts_least_recently_used_unprotected_versions_only(three: tuple[VersionStore, list[str]]) -> None:
    store, (d0, d1, d2) = three
    quota = store.usage_bytes() + 10_000
    gone: list[str] = []  # the daemon stops serving and announcing what is evicted
    retention = Retention(store, quota, 0, on_evicted=gone.append)
    evicted = retention.make_room("sha256:" + "f" * 64, 200_000, {d0})
    assert evicted == [d1], "d0 is protected, so d1 (the next oldest) goes, and only as much as needed"
    assert gone == [d1]
    assert set(store.ready()) == {d0, d2}
    assert retention.reserved() == 200_000


def test_make_room_raises_a_clear_disk_full_error_when_everything_is_referenced(
    three: tuple[VersionStore, list[str]],
) -> None:
    store, digests = three
    retention = Retention(store, store.usage_bytes(), 0)
    with pytest.raises(DiskFullError) as caught:
        retention.make_room("sha256:" + "f" * 64, 100_000, set(digests))
    message = caught.value.message
    assert "no room to fetch sha256:ffff" in message
    assert "quota" in message
    assert "--quota" in message
    assert set(store.ready()) == set(digests), "nothing referenced was deleted"


def test_abandoned_partial_staging_goes_before_any_ready_version(
    three: tuple[VersionStore, list[str]], make_model: Callable[..., Path]
) -> None:
    store, _digests = three
    partial = manifest_of(make_model("p", tensors_mb=0.25, seed=9))
    staging = Staging(store.staging_dir, partial)
    staging.open()  # a fetch that was abandoned (its version is no longer wanted)
    staging.close()
    retention = Retention(store, store.usage_bytes(), 0)
    evicted = retention.make_room("sha256:" + "f" * 64, 1, set())
    assert evicted[0] == partial.digest
    assert not (store.staging_dir / partial.digest.removeprefix("sha256:")).exists()


def test_trim_brings_usage_under_a_lowered_quota(three: tuple[VersionStore, list[str]]) -> None:
    store, (d0, d1, d2) = three
    retention = Retention(store, store.usage_bytes() // 2, 0)
    assert retention.trim({d2}) == [d0, d1]
    assert set(store.ready()) == {d2}
