"""Tracker reports under a liar: one node's false reports cannot ban an honest parent.

Threat: a node holding genuine credentials reports a healthy parent "corrupt" over and over (or
several nodes' routine "refused" answers add up) until the tracker sends nobody to that parent,
for an hour. Strikes count once per distinct reporter, weighed by the reporter's reputation; a
"refused" (busy) answer is not a strike; a ban needs independent evidence, grows only with it,
and is bounded. Real control plane, cluster cache (the tracker) and a real parent agent; the liar
and the witnesses speak to the tracker over HTTP with genuine tickets.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agent.tracker import NodeView, Reason, Tracker, TrackerSettings
from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import peer_url, ticket
from weightship.schemas import TrackerSources

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cache(cluster_cache: AgentProcess) -> AgentProcess:
    """The cluster cache (``cluster_cache``)."""
    return cluster_cache


async def _sources(http: httpx.AsyncClient, tracker: str, token: str, version: str, chunk: str) -> list[str]:
    response = await http.get(f"{tracker}/v1/tracker/sources", params={"version": version, "chunk": chunk},
                              headers={"Authorization": f"Ticket {token}"})  # fmt: skip
    assert response.status_code == 200, response.text
    return [s.node for s in TrackerSources.model_validate_json(response.content).sources]


async def _report(http: httpx.AsyncClient, tracker: str, token: str, body: dict[str, str]) -> None:
    response = await http.post(f"{tracker}/v1/tracker/report", json=body, headers={"Authorization": f"Ticket {token}"})
    assert response.status_code == 204, response.text


async def test_one_liar_cannot_ban_an_honest_parent_and_refusals_are_not_strikes(
    fleet: Fleet, cache: AgentProcess, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    v1 = fleet.publish(make_model("m1", tensors_mb=0.25, seed=31), model, "v1")
    fleet.point(deployment, model, "v1")
    tracker = peer_url(cache)
    parent = spawn(f"{model[:50]}-parent", extra=["--peer-listen", "127.0.0.1:0", "--cluster-cache", tracker])
    await parent.ready()
    await parent.serving(v1.digest)
    chunk = v1.files[0].chunks[0]
    tokens = {who: ticket(fleet, f"{model[:50]}-{who}", [deployment], [v1.digest])
              for who in ("liar", "busy", "asker", "witness")}  # fmt: skip
    body = {"node": parent.name, "version": v1.digest, "chunk": chunk}
    async with httpx.AsyncClient(timeout=10) as http:

        async def offered() -> bool:
            return parent.name in await _sources(http, tracker, tokens["asker"], v1.digest, chunk)

        await eventually(offered, 30, "the tracker to offer the parent")
        for _ in range(12):
            await _report(http, tracker, tokens["liar"], {**body, "reason": "corrupt"})
        await _report(http, tracker, tokens["busy"], {**body, "reason": "refused"})
        assert await offered(), "one liar's reports and one refusal banned an honest parent for everyone"
        # the liar itself is not sent there (its own avoidance), and nothing more
        assert parent.name not in await _sources(http, tracker, tokens["liar"], v1.digest, chunk)
        # independent evidence still counts: a second reporter's strike bans the parent for everyone
        await _report(http, tracker, tokens["witness"], {**body, "reason": "corrupt"})
        assert not await offered()
    # and the liar's repeats did not flood the cache's log (one line per reporter every 10 s)
    liar_lines = [line for line in cache.log().splitlines() if "tracker.reported" in line and f"reporter={model[:50]}-liar " in line]
    assert 1 <= len(liar_lines) <= 2, liar_lines


def _tracker(**settings: float) -> tuple[Tracker, list[float]]:
    now = [1000.0]
    tracker = Tracker(TrackerSettings(**settings), lambda: now[0], sweep_interval=0.0)  # type: ignore[arg-type]
    return tracker, now


def test_a_ban_grows_only_with_independent_reporters_and_is_bounded() -> None:
    tracker, now = _tracker(penalty_corrupt=300.0, max_penalty=1200.0)
    tracker.announce(NodeView("parent", "http://p", upload_slots_free=4), {"v": [0]})
    for _ in range(50):
        tracker.report("liar", "parent", "v", 0, Reason.corrupt)
    assert not tracker.avoided("parent", "someone")
    for reporter in ("a", "b", "c", "d"):
        tracker.report(reporter, "parent", "v", 0, Reason.corrupt)
    # five independent reporters: 300 * 2**4 = 4800 s, bounded to 1200 s
    now[0] += 1199.0
    assert tracker.avoided("parent", "someone")
    now[0] += 2.0
    assert not tracker.avoided("parent", "someone")


def test_a_reporter_accusing_many_parents_weighs_less_and_a_banned_one_nothing() -> None:
    tracker, _now = _tracker(report_quorum=2, credible_accusations=2)
    for name in ("p1", "p2", "p3", "p4"):
        tracker.announce(NodeView(name, f"http://{name}", upload_slots_free=4), {"v": [0]})
    for name in ("p1", "p2", "p3", "p4"):
        tracker.report("accuser", name, "v", 0, Reason.corrupt)
    # four accusations at once: each weighs 2/4, so one honest witness is not enough with it
    tracker.report("witness", "p1", "v", 0, Reason.corrupt)
    assert tracker.evidence("p1") == pytest.approx(1.5)
    assert not tracker.avoided("p1", "someone")
    # refusals never count
    for reporter in ("r1", "r2", "r3"):
        tracker.report(reporter, "p2", "v", 0, Reason.refused)
    assert tracker.evidence("p2") == pytest.approx(0.5)
    assert not tracker.avoided("p2", "someone")
