"""A fetch that keeps failing is reported as retrying/failed with its last error and since when, not `fetching 0%`."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from rich.console import Console

from tests.agent.agent_processes import Spawn, eventually
from tests.agent.fleet import Fleet
from weightship.cli.display import status_view
from weightship.manifest import Manifest
from weightship.schemas import FetchFailure, NodeProblem, VersionState
from weightship.testing import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def test_a_fetch_that_keeps_failing_shows_retrying_with_its_last_error_and_since_when(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, versions: dict[str, Manifest], model: str, deployment: str
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    fleet.point(deployment, model, "v1")
    agent = spawn("node-r")
    await agent.ready()
    await agent.serving(v1.digest)

    upstream = proxy.upstream
    proxy.upstream = "http://127.0.0.1:9"  # nothing listens there: the proxy answers 502
    began = datetime.now(UTC)
    try:
        fleet.point(deployment, model, "v2")

        def problems(state: VersionState) -> list[NodeProblem]:
            with fleet.cp.client() as admin:
                status = admin.deployment_status(deployment)
            found = [p for v in status.versions if v.digest == v2.digest for p in v.problems]
            return [p for p in found if p.state == state]

        # While the fetch still runs, its chunk retries already show (not "fetching 0%") ...
        retrying = (await eventually(lambda: problems(VersionState.fetching), 30, "v2 reported as retrying"))[0]
        assert retrying.node == "node-r"
        assert retrying.problem.reason == FetchFailure.origin_unavailable
        assert "502" in retrying.problem.message
        assert began <= retrying.problem.since <= datetime.now(UTC)
        with fleet.cp.client() as admin:
            status = admin.deployment_status(deployment)
        assert next(v for v in status.versions if v.digest == v2.digest).nodes_retrying == 1
        # ... and once attempts have failed, the count and the time of the next try show too.
        failed = (await eventually(lambda: problems(VersionState.failed), 30, "v2 reported as failed"))[0]
        assert failed.problem.attempts >= 1
        assert failed.problem.retry_at is not None
        assert failed.problem.since == retrying.problem.since, "one run of failures, one 'since'"
        # The same problem is in the node's own report, and ``weightship status`` spells it out.
        node = fleet.node("node-r")
        assert node is not None
        assert any(i.problem and i.digest == v2.digest for i in node.inventory)
        view = status_view(status)
        console = Console(width=400, record=True)
        console.print(view)
        text = console.export_text()
        assert "node-r stable" in text
        assert "origin unavailable: " in text
        assert "since" in text
    finally:
        proxy.upstream = upstream
    # The origin comes back: the node gets there by itself (short backoff), and the problem clears.
    await agent.serving(v2.digest, within=30)
    await eventually(lambda: not problems(VersionState.failed) and not problems(VersionState.fetching), 15, "clear")
