"""When the agent retries and when its waits expire, on a fake clock: minutes of backoff in milliseconds.

The reconciler and the local API's long-poll read time from their event loop; here that loop
runs on virtual time (``tests.agent.virtual_time``), so the assertions are on exact loop times,
never on the wall clock, and a five-minute retry costs nothing. The origin is a stand-in at the
``ManifestSource``/``BlobURLSource`` seam that fails the way a real one does.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agent.assemble import Assembler
from agent.counters import Counters
from agent.epochs import EpochBook
from agent.fetcher import CorruptChunkError, Fetcher
from agent.rangeclient import RangeClient
from agent.reconcile import CORRUPT_RETRY, Reconciler
from agent.retention import Retention
from agent.serving import Serving
from agent.store import VersionStore
from tests.agent.local_versions import install
from tests.agent.virtual_time import run_virtual
from weightship.errors import TemporaryError
from weightship.schemas import BlobURL, DesiredDeployment, DesiredState

pytestmark = pytest.mark.timeout(60)

DIGEST = "sha256:" + "ab" * 32


class FailingOrigin:
    """An origin whose every manifest request fails with ``error``; records the loop time of each."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.asked: list[float] = []

    async def manifest(self, model: str, digest: str) -> bytes:
        self.asked.append(asyncio.get_running_loop().time())
        raise self.error

    async def blob_urls(self, blobs: Sequence[str]) -> dict[str, BlobURL]:
        raise AssertionError("no manifest, so no blob URLs are ever asked for")


def desired(epoch: int, revision: str) -> DesiredState:
    return DesiredState(
        node_id="node-1",
        revision=revision,
        deployments=[
            DesiredDeployment(name="chat", model="m", digest=DIGEST, epoch=epoch, role="stable", keep=[DIGEST])
        ],
    )


async def reconcile_against(
    origin: FailingOrigin, data_dir: Path, scenario: Callable[[Reconciler], object]
) -> None:
    """Run a real reconciler on ``data_dir`` fetching from ``origin`` while ``scenario`` runs."""
    store = VersionStore(data_dir)
    book = EpochBook(store.state_dir / "deployments.json")
    retention = Retention(store, 0, 0)
    client = RangeClient()
    with ThreadPoolExecutor(max_workers=2) as executor:
        fetcher = Fetcher(client, origin, Counters(), executor, backoff_initial=0.2, backoff_max=10.0)
        reconciler = Reconciler(
            store,
            book,
            Serving(store, book),
            Assembler(store, retention, fetcher, origin, Counters(), executor, lambda: reconciler.protected()),
            retention,
            executor,
            backoff_initial=0.2,
            backoff_max=10.0,
        )
        running = asyncio.create_task(reconciler.run())
        try:
            result = scenario(reconciler)
            if asyncio.iscoroutine(result):
                await result
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await client.close()


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_a_failing_origin_is_retried_with_growing_capped_backoff(tmp_path: Path) -> None:
    origin = FailingOrigin(TemporaryError("origin answered 503"))

    async def scenario(reconciler: Reconciler) -> None:
        await reconciler.apply(desired(1, "r1"))
        await asyncio.sleep(120)  # ok-sleep: two virtual minutes on the virtual-time loop

    run_virtual(lambda: reconcile_against(origin, tmp_path / "data", scenario))
    assert origin.asked[0] == pytest.approx(0.0, abs=1e-6), "the first try is immediate"
    delays = gaps(origin.asked)
    for n, delay in enumerate(delays[:6]):
        base = min(10.0, 0.2 * 2**n)
        assert base * 0.8 - 1e-6 <= delay <= min(10.0, base * 1.2) + 1e-6, (n, delays)
    assert max(delays) <= 10.0 + 1e-6, "capped at backoff_max"
    assert 12 <= len(origin.asked) <= 25, f"{len(origin.asked)} tries in two minutes"


def test_a_corrupt_origin_waits_minutes_and_a_new_pointer_retries_it_at_once(tmp_path: Path) -> None:
    corrupt = CorruptChunkError(
        "chunk 0 of model.safetensors never matched its digest",
        blob="cd" * 32,
        file="model.safetensors",
        chunk_index=0,
        chunk_digest="ef" * 32,
        rejected=5,
    )
    origin = FailingOrigin(corrupt)
    first, longest = CORRUPT_RETRY

    async def scenario(reconciler: Reconciler) -> None:
        await reconciler.apply(desired(1, "r1"))
        await asyncio.sleep(first * 0.5)  # ok-sleep (virtual time): well inside the first wait, no second try
        assert len(origin.asked) == 1
        await asyncio.sleep(first * 1.5)  # ok-sleep (virtual time): past the longest jittered first wait
        assert len(origin.asked) == 2
        # The operator fixes the origin and re-points: tried again now, not minutes later.
        repointed = asyncio.get_running_loop().time()
        await reconciler.apply(desired(2, "r2"))
        await asyncio.sleep(1)  # ok-sleep (virtual time): one virtual second after the re-point
        assert len(origin.asked) == 3
        assert origin.asked[2] - repointed < 0.01

    run_virtual(lambda: reconcile_against(origin, tmp_path / "data", scenario))
    assert first * 0.8 <= origin.asked[1] - origin.asked[0] <= first * 1.2
    assert longest >= first


def test_a_long_poll_expires_at_its_timeout_and_a_switch_answers_it_at_once(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    store = VersionStore(tmp_path / "data")
    v1 = install(store, make_model("a", seed=1))
    book = EpochBook(store.state_dir / "deployments.json")
    serving = Serving(store, book)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # Nothing changes: the wait gives up after exactly its timeout, five virtual minutes.
        assert await serving.wait("chat", 0, 300.0) is None
        assert loop.time() == pytest.approx(300.0)

        async def switch_later() -> None:
            await asyncio.sleep(42)  # ok-sleep (virtual time): the switch lands 42 virtual seconds in
            book.apply("chat", 1, v1.digest, "m")
            await serving.changed()

        switcher = asyncio.create_task(switch_later())
        view = await serving.wait("chat", 0, 300.0)
        await switcher
        assert view is not None
        assert (view.digest, view.epoch) == (v1.digest, 1)
        assert loop.time() == pytest.approx(342.0), "answered at the switch, not at the timeout"

    run_virtual(main)
