"""kill -9 mid-fetch: verified chunks survive, only missing ones are fetched, nothing half-written is ready."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.fleet import Fleet
from weightship.digests import hex_of
from weightship.layout import read_verification
from weightship.manifest import Manifest
from weightship.testing import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CONCURRENCY = 4


def journaled(agent: AgentProcess, manifest: Manifest) -> set[tuple[str, int]]:
    """(blob, offset) of every chunk the agent's journal says is verified and written."""
    path = agent.data_dir / "staging" / f"{hex_of(manifest.digest)}.journal"
    if not path.exists():
        return set()
    found = set()
    for line in path.read_text().split("\n")[:-1]:
        kind, f, c = line.split()
        assert kind == "c"
        entry = manifest.files[int(f)]
        found.add((entry.sha256, int(c) * manifest.chunk_size))
    return found


def assert_complete_and_verified(agent: AgentProcess, manifest: Manifest) -> None:
    """Every file of ``manifest`` is in place with the right bytes, and the record says so."""
    root = agent.data_dir / "versions" / hex_of(manifest.digest)
    for entry in manifest.files:
        assert hashlib.sha256((root / entry.path).read_bytes()).hexdigest() == entry.sha256, entry.path
    record = read_verification(root)
    assert record is not None
    assert record.digest == manifest.digest


@pytest.fixture
def big(fleet: Fleet, model: str, make_model: Callable[..., Path]) -> Manifest:
    """A version of about 2 MiB in 64 KiB chunks (~33 chunks), published as ``model``'s ``big``."""
    return fleet.publish(make_model("big", tensors_mb=2.0, seed=7), model, "big")


async def test_kill9_mid_fetch_resumes_and_refetches_at_most_the_chunks_in_flight(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, big: Manifest, model: str, deployment: str
) -> None:
    total_chunks = sum(len(f.chunks) for f in big.files)
    # The proxy lets a third of the chunks through, then holds every further request: the agent
    # is killed with those requests in flight and the rest not yet asked for.
    proxy.hold_after = total_chunks // 3
    fleet.point(deployment, model, "big")
    agent = spawn("node-k", extra=["--concurrency", str(CONCURRENCY)])
    await agent.ready()
    await eventually(
        lambda: proxy.held() > 0 and len(journaled(agent, big)) >= total_chunks // 3,
        60,
        "the answered chunks to be journaled while the rest are held",
    )
    status = await agent.status()
    assert [(i.digest, i.state.value) for i in status.inventory] == [(big.digest, "fetching")]
    in_flight = {(s.blob, s.start) for s in proxy.served[total_chunks // 3 :]}
    agent.kill9()

    final = agent.data_dir / "versions" / hex_of(big.digest)
    assert not final.exists(), "a half-fetched version must never be under versions/"
    kept = journaled(agent, big)
    answered = {(s.blob, s.start) for s in proxy.served[: total_chunks // 3]}
    assert kept == answered, "exactly the chunks the proxy answered were verified and kept"
    assert 0 < len(in_flight) <= CONCURRENCY
    served_before = len(proxy.served)

    proxy.release()
    agent.start()
    await agent.ready()
    await agent.serving(big.digest)
    second_run = [(s.blob, s.start) for s in proxy.served[served_before:]]
    assert not kept & set(second_run), "a chunk verified before the kill was downloaded again"
    refetched = (answered | in_flight) & set(second_run)
    assert refetched == in_flight, "only the chunks in flight at the kill are fetched twice"
    assert len(second_run) == len(set(second_run)) == total_chunks - len(kept)
    assert_complete_and_verified(agent, big)
    assert "staging.reverify_failed" not in agent.log()
    assert not (agent.data_dir / "staging" / hex_of(big.digest)).exists()


async def test_repeated_kill9_at_different_moments_still_ends_with_a_verified_version(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, big: Manifest, model: str, deployment: str
) -> None:
    proxy.delay = 0.05
    fleet.point(deployment, model, "big")
    agent = spawn("node-r", extra=["--concurrency", str(CONCURRENCY)])
    total_chunks = sum(len(f.chunks) for f in big.files)
    for fraction in (0.1, 0.4, 0.8):
        await agent.ready()
        target = max(1, int(total_chunks * fraction))

        def enough(target: int = target) -> bool:
            return len(journaled(agent, big)) >= target or _ready(agent, big)

        await eventually(enough, 60, f"{target} chunks journaled")
        agent.kill9()
        if not _ready(agent, big):
            assert not (agent.data_dir / "versions" / hex_of(big.digest)).exists()
        agent.start()
    await agent.ready()
    await agent.serving(big.digest)
    assert_complete_and_verified(agent, big)
    # Across all runs each chunk went through the proxy at most 1 + kills times (only in-flight ones twice).
    assert proxy.bytes_served() <= big.total_size + 3 * CONCURRENCY * big.chunk_size


def _ready(agent: AgentProcess, manifest: Manifest) -> bool:
    return (agent.data_dir / "versions" / hex_of(manifest.digest)).exists()
