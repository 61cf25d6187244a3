"""A version is ready before it is flushed to disk; a crash in between costs a re-hash, never trust.

The agents here run with ``--sync-delay 600``, so a version stays ready-but-unsynced until the
agent is killed. A power loss could lose any unsynced byte; the damaged-chunk test stands in for
that by overwriting one chunk on disk after the kill (a kill -9 alone loses nothing in the page
cache).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.durability import is_unsynced
from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.fleet import Fleet
from weightship.digests import hex_of
from weightship.layout import read_verification
from weightship.manifest import Manifest
from weightship.testing import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def version(fleet: Fleet, model: str, make_model: Callable[..., Path]) -> Manifest:
    """A version of about 1 MiB in 64 KiB chunks, published as ``model``'s ``v1``."""
    return fleet.publish(make_model("v1", tensors_mb=1.0, seed=11), model, "v1")


def assert_whole(root: Path, manifest: Manifest) -> None:
    for entry in manifest.files:
        assert hashlib.sha256((root / entry.path).read_bytes()).hexdigest() == entry.sha256, entry.path
    record = read_verification(root)
    assert record is not None
    assert record.digest == manifest.digest


async def _killed_before_flush(
    spawn: Spawn, fleet: Fleet, version: Manifest, model: str, deployment: str, name: str
) -> tuple[AgentProcess, Path]:
    """An agent that served ``version`` and was killed (-9) before flushing it; and the version's directory."""
    fleet.point(deployment, model, "v1")
    agent = spawn(name, extra=["--sync-delay", "600"])
    await agent.ready()
    await agent.serving(version.digest)
    root = agent.data_dir / "versions" / hex_of(version.digest)
    assert is_unsynced(root), "ready before the flush: the marker is still there"
    agent.kill9()
    return agent, root


async def test_a_version_killed_before_its_flush_is_hashed_again_at_start_and_downloads_nothing(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, version: Manifest, model: str, deployment: str
) -> None:
    agent, root = await _killed_before_flush(spawn, fleet, version, model, deployment, "node-u")
    served = len(proxy.served)

    agent.extra = []  # the restarted agent flushes at once
    agent.start()
    await agent.ready()
    await agent.serving(version.digest)
    assert "store.version_resynced" in agent.log()
    assert len(proxy.served) == served, "bytes that hash right again are not downloaded again"
    assert not is_unsynced(root)
    assert_whole(root, version)


async def test_a_chunk_lost_between_ready_and_flush_is_found_at_start_and_fetched_again(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, version: Manifest, model: str, deployment: str
) -> None:
    agent, root = await _killed_before_flush(spawn, fleet, version, model, deployment, "node-d")

    # What a power loss may do to bytes that were only in the page cache: chunk 1 of the largest file is gone.
    entry = max(version.files, key=lambda f: f.size)
    assert len(entry.chunks) > 2
    path = root / entry.path
    os.chmod(path, 0o644)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(version.chunk_size), version.chunk_size)
    finally:
        os.close(fd)
    served = len(proxy.served)

    agent.extra = []
    agent.start()
    await agent.ready()
    await agent.serving(version.digest)
    assert "store.version_damaged" in agent.log()
    refetched = [(s.blob, s.start) for s in proxy.served[served:]]
    assert refetched == [(entry.sha256, version.chunk_size)], "only the damaged chunk is downloaded again"
    assert_whole(root, version)
    await eventually(lambda: not is_unsynced(root), 30, "the repaired version to be flushed")
    assert not (agent.data_dir / "staging" / hex_of(version.digest)).exists()
