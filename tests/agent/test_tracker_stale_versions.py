"""An announcement naming a version the node may no longer announce is accepted for the rest.

After an aborted rollout a node still holds the canary, which its ticket no longer covers. The
tracker drops that version (and what it knew the node to hold of it), logs it once per node and
version, and records the rest, so it still learns who holds the next version's chunks.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from agent.tracker import Tracker
from tests.agent.agent_processes import Spawn, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import peer_url, start_cache
from tests.agent.tracker_parts import Signer, tracker_server
from weightship.manifest import Manifest
from weightship.testing import problem

pytestmark = pytest.mark.timeout(120)

NEXT = "sha256:" + "ab" * 32
ABORTED = "sha256:" + "ef" * 32
HAVE_ONE = base64.b64encode(b"\x80").decode()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """This module's control plane issues 4 s tickets, so a node renews its ticket within seconds."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WEIGHTSHIP_TICKET_TTL", "4")
        world = Fleet(tmp_path_factory.mktemp("fleet"))
        try:
            world.start()
            yield world
        finally:
            world.close()


def _manifest(digest: str, chunk: str) -> Manifest:
    return SimpleNamespace(digest=digest, files=(SimpleNamespace(chunks=(chunk,)),))  # type: ignore[return-value]


async def test_a_stale_version_is_dropped_and_logged_once_and_the_rest_is_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    signer = Signer()
    tracker = Tracker()
    manifests = {NEXT: _manifest(NEXT, "cd" * 32), ABORTED: _manifest(ABORTED, "12" * 32)}
    runner, url = await tracker_server(tracker, signer, manifests)
    body = {"node": "alice", "address": "http://10.0.0.9:7071", "upload_slots_free": 4,
            "versions": {NEXT: {"have": HAVE_ONE}, ABORTED: {"have": HAVE_ONE}}}  # fmt: skip
    try:
        async with httpx.AsyncClient() as client:
            # While the rollout ran, alice was entitled to both and announced both.
            both = {"Authorization": f"Ticket {signer.sign('alice', [NEXT, ABORTED])}"}
            assert (await client.post(f"{url}/v1/tracker/announce", json=body, headers=both)).status_code == 204
            assert tracker.holders(ABORTED, 0) == {"alice"}

            # Aborted: its ticket covers only NEXT now, but alice still holds and announces ABORTED.
            only_next = {"Authorization": f"Ticket {signer.sign('alice', [NEXT])}"}
            with caplog.at_level(logging.WARNING, logger="agent.tracker"):
                for _ in range(3):
                    response = await client.post(f"{url}/v1/tracker/announce", json=body, headers=only_next)
                    assert response.status_code == 204, response.text

            # A ticket covering none of the announced versions is still refused.
            other = {"Authorization": f"Ticket {signer.sign('alice', ['sha256:' + '99' * 32])}"}
            refused = await client.post(f"{url}/v1/tracker/announce", json=body, headers=other)
    finally:
        await runner.cleanup()

    assert tracker.holders(NEXT, 0) == {"alice"}
    assert tracker.holders(ABORTED, 0) == set(), "what alice held of the aborted version is forgotten"
    dropped = [r for r in caplog.records if "tracker.announce_version_dropped" in r.getMessage()]
    assert len(dropped) == 1, [r.getMessage() for r in dropped]
    assert ABORTED in dropped[0].getMessage()
    assert refused.status_code == 403
    assert problem(refused)["code"] == "ticket_not_covering"


async def test_a_node_holding_an_aborted_canary_keeps_announcing_what_it_may(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Real processes: once its ticket is renewed, the control plane refuses the aborted canary; the node leaves it out."""
    v1 = fleet.publish(make_model("s1", tensors_mb=0.25, seed=41), model, "v1")
    v2 = fleet.publish(make_model("s2", tensors_mb=0.25, seed=42), model, "v2")
    fleet.point(deployment, model, "v1")
    cache = start_cache(tmp_path, fleet, f"{model[:50]}-cache")
    try:
        await cache.ready()
        node = spawn(f"{model[:50]}-n", extra=["--peer-listen", "127.0.0.1:0", "--cluster-cache", peer_url(cache),
                                               "--announce-interval", "0.5"])  # fmt: skip
        await node.ready()
        await node.serving(v1.digest)
        with fleet.cp.client() as admin:
            epoch = admin.get_deployment(deployment).epoch
            admin.set_pointer(deployment, "v1", canary="v2", canary_share=1.0, expected_epoch=epoch, reason="canary")
        await node.serving(v2.digest)
        with fleet.cp.client() as admin:  # aborted: v2 is no longer named by any pointer
            epoch = admin.get_deployment(deployment).epoch
            admin.set_pointer(deployment, "v1", expected_epoch=epoch, reason="abort")
        await node.serving(v1.digest)
        marker = len(node.log())
        try:
            await eventually(lambda: "sources.announce_version_dropped" in node.log(), 30,
                             "the node to leave the aborted version out of its announcement")  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{node.log()[-4000:]}") from None
        await asyncio.sleep(3.0)  # ok-sleep: six re-announcements (every 0.5 s) and a ticket renewal: none refused
        after = node.log()[marker:]
        assert "sources.announce_refused" not in after, after[-2000:]
        assert "sources.announce_failed" not in after, after[-2000:]
        dropped = [line for line in node.log().splitlines() if "sources.announce_version_dropped" in line]
        assert len(dropped) == 1, dropped
        assert v2.digest in dropped[0]
    finally:
        await cache.close()
