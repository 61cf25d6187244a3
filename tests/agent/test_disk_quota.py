"""Retention within a disk quota: unreferenced versions are evicted oldest first; when nothing can go, a clear error."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.fleet import Fleet
from tests.agent.local_versions import small_tmpfs
from weightship.digests import hex_of
from weightship.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: about what one test version takes on disk (0.5 MiB of tensors plus metadata files)
VERSION_BYTES = 540 * 1024


@pytest.fixture
def four(fleet: Fleet, model: str, make_model: Callable[..., Path]) -> list[Manifest]:
    """Four distinct versions of ``model``, published as ``q0`` .. ``q3``."""
    return [fleet.publish(make_model(f"q{i}", tensors_mb=0.5, seed=10 + i), model, f"q{i}") for i in range(4)]


def on_disk(agent: AgentProcess) -> set[str]:
    return set(os.listdir(agent.data_dir / "versions"))


async def test_quota_evicts_the_oldest_unreferenced_version_first(
    spawn: Spawn, fleet: Fleet, four: list[Manifest], model: str, deployment: str
) -> None:
    v1, v2, v3, v4 = four
    agent = spawn("node-q", extra=["--quota", str(int(3.5 * VERSION_BYTES))])
    await agent.ready()
    for label, version in zip(("q0", "q1", "q2"), (v1, v2, v3), strict=True):
        fleet.point(deployment, model, label)
        await agent.serving(version.digest)
    # v1 is no longer referenced (keep = v3, v2) but fits: it stays as the LRU tail.
    assert on_disk(agent) == {hex_of(v.digest) for v in (v1, v2, v3)}

    fleet.point(deployment, model, "q3")
    await agent.serving(v4.digest)
    assert on_disk(agent) == {hex_of(v.digest) for v in (v2, v3, v4)}, "v1 (oldest unreferenced) goes first"
    assert f"retention.evicted digest={v1.digest}" in agent.log()
    assert f"retention.evicted digest={v2.digest}" not in agent.log()
    status = await agent.status()
    assert status.health.used_bytes <= 3.5 * VERSION_BYTES
    assert {i.digest for i in status.inventory} == {v2.digest, v3.digest, v4.digest}


async def test_quota_too_small_for_referenced_versions_fails_clearly_and_keeps_serving(
    spawn: Spawn, fleet: Fleet, four: list[Manifest], model: str, deployment: str
) -> None:
    v1, v2 = four[:2]
    agent = spawn("node-f", extra=["--quota", str(int(1.5 * VERSION_BYTES))])
    await agent.ready()
    fleet.point(deployment, model, "q0")
    await agent.serving(v1.digest)

    fleet.point(deployment, model, "q1")  # keep = v2, v1: both referenced
    failure = await eventually(lambda: fleet.failed("node-f", v2.digest), 20, "v2 reported failed")
    assert "no room to fetch" in failure.error
    assert "quota" in failure.error
    assert "disk-full.md" in failure.error
    assert any("no room to fetch" in e for e in failure.node.health.errors)
    view = await agent.deployment()
    assert view is not None
    assert view.digest == v1.digest
    assert view.ready
    assert on_disk(agent) == {hex_of(v1.digest)}, "nothing partial is ever under versions/"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (needs permission to mount; skipped otherwise)."""
    with small_tmpfs(tmp_path / "small-disk", "2m") as mount:
        yield mount


async def test_full_disk_fails_the_fetch_clearly_and_it_completes_once_space_is_freed(
    fleet: Fleet, four: list[Manifest], small_disk: Path, model: str, deployment: str
) -> None:
    v1, v2 = four[:2]
    agent = AgentProcess(small_disk, "node-t", fleet.cp.url, fleet.agent_token, [deployment])
    agent.log_path = small_disk.parent / "node-t.log"
    fleet.point(deployment, model, "q0")
    agent.start()
    try:
        await agent.ready()
        await agent.serving(v1.digest)
        filler = small_disk / "filler"
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        filler.write_bytes(bytes(free - 100 * 1024))  # leave 100 KiB: less than v2 needs

        fleet.point(deployment, model, "q1")
        failure = await eventually(lambda: fleet.failed("node-t", v2.digest), 20, "v2 reported failed")
        assert "no room to fetch" in failure.error
        assert "free on disk" in failure.error
        view = await agent.deployment()
        assert view is not None
        assert view.digest == v1.digest
        assert view.ready

        filler.unlink()
        await agent.serving(v2.digest, within=30)  # the retry (with backoff) now fits
    finally:
        await agent.close()
