"""``weightship rollout`` end to end on fleet rollouts: the CLI against a live control plane whose driver runs.

The control plane serves over real HTTP with its background rollout driver on (ticking every
0.1 s on the real clock); a simulated fleet of four nodes follows its desired state as agents
would (``SimFleet.converge`` in a loop, a stand-in for the agents' reconcile). The CLI is driven
as a script drives it: token and URL from the environment, ``--json`` for what the test reads,
exit statuses and the one-line errors on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from controlplane.settings import Settings
from controlplane.state import AppState
from tests.controlplane.conftest import LiveControlPlane, SeedVersions
from tests.controlplane.rollouts.fleet_driving import Hook, SimFleet, metric
from weightship.cli import app
from weightship.schemas import Role

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cp_settings(cp_settings: Settings) -> Settings:
    """The live control plane with its rollout driver ticking fast on the real clock."""
    return dataclasses.replace(cp_settings, rollout_tick_seconds=0.1)


@pytest.fixture
def hook() -> Iterator[Hook]:
    server = Hook()
    yield server
    server.close()


@dataclass
class Fleet:
    """The CLI's world: deployment ``chat`` of model ``m`` serving v1 on four nodes that follow the pointer."""

    url: str
    operator: str
    versions: dict[str, str]

    def cli(self, *args: str, input: str | None = None) -> Result:
        env = {"WEIGHTSHIP_URL": self.url, "WEIGHTSHIP_TOKEN": self.operator, "COLUMNS": "200"}
        return CliRunner().invoke(app, list(args), input=input, env=env, catch_exceptions=False)

    def json(self, *args: str) -> Any:
        result = self.cli("--json", "rollout", *args)
        assert result.exit_code == 0, f"weightship rollout {' '.join(args)} exited {result.exit_code}: {result.stderr}"
        return json.loads(result.stdout)


@pytest.fixture
def fleet(
    cp_client: httpx.Client,
    role_headers: dict[Role, dict[str, str]],
    seed_versions: SeedVersions,
    cp_state: AppState,
    live_controlplane: LiveControlPlane,
) -> Iterator[Fleet]:
    versions = seed_versions("m", ("v1", "v2", "v3"))
    admin = role_headers[Role.admin]
    assert cp_client.post("/v1/deployments", json={"name": "chat", "model": "m"}, headers=admin).status_code == 201
    put = cp_client.put("/v1/deployments/chat/pointer", json={"stable": "v1"}, headers={**admin, "If-Match": '"0"'})
    assert put.status_code == 200, put.text
    nodes = SimFleet(live_controlplane, "chat", 4)
    stop = threading.Event()

    def follow() -> None:  # the agents' reconcile loop, every 50 ms
        while not stop.wait(0.05):
            nodes.converge()

    nodes.converge()
    thread = threading.Thread(target=follow, name="sim-fleet", daemon=True)
    thread.start()
    yield Fleet(live_controlplane.url, role_headers[Role.operator]["Authorization"].removeprefix("Bearer "), versions)
    stop.set()
    thread.join(timeout=10)


def test_start_then_watch_follows_the_rollout_until_it_completes(fleet: Fleet, hook: Hook) -> None:
    hook.answers = {"quality": [0.01]}
    spec = {"steps": [{"setWeight": 25}, {"analysis": {"metrics": [metric(hook, "quality")]}}, {"setWeight": 50}]}
    started = fleet.cli("--json", "rollout", "start", "chat", "v2", "--spec", "-", input=json.dumps(spec))
    assert started.exit_code == 0, started.stderr
    created = json.loads(started.stdout)
    assert (created["version"], created["steps_total"]) == (fleet.versions["v2"], 3)

    watched = fleet.cli("--json", "rollout", "status", "chat", "--watch", "--interval", "0.1", "--timeout", "60")
    assert watched.exit_code == 0, watched.stderr
    states = [json.loads(line) for line in watched.stdout.splitlines()]
    last = states[-1]
    assert (last["id"], last["phase"], last["completed"]) == (created["id"], "Healthy", True)
    assert last["stable"] == fleet.versions["v1"]  # the rollback target it captured
    assert [s["state"] for s in last["steps"]] == ["done"] * 3
    assert last["analysis_runs"][0]["metrics"][0]["measurements"][0]["value"] == 0.01
    assert max(s["weight"] for s in states) >= 25
    assert last["nodes"] == {fleet.versions["v2"]: 4}

    listed = fleet.json("list", "chat")
    assert [r["id"] for r in listed] == [created["id"]]
    assert fleet.json("list", "--active") == []
    shown = fleet.cli("rollout", "status", "chat", "--rollout", created["id"])
    assert shown.exit_code == 0, shown.stderr
    assert "Healthy" in shown.stdout
    assert fleet.versions["v2"] in shown.stdout  # whole, unwrapped


def test_verbs_promote_pause_resume_abort_retry_and_refusals(fleet: Fleet) -> None:
    steps = ["--step", "setWeight=25", "--step", "pause", "--step", "setWeight=50", "--step", "pause"]
    created = fleet.json("start", "chat", "v2", *steps)

    second = fleet.cli("rollout", "start", "chat", "v3")
    assert second.exit_code == 3
    assert created["id"] in second.stderr  # the server's message names the active rollout

    waited = fleet.cli("rollout", "status", "chat", "--watch", "--interval", "0.1", "--timeout", "2")
    assert waited.exit_code == 5  # paused until promoted: --watch gives up at its timeout
    assert "still Paused" in waited.stderr
    paused = fleet.json("status", "chat")
    assert (paused["phase"], paused["weight"], paused["step_index"]) == ("Paused", 25.0, 1)

    refused = fleet.cli("rollout", "retry", "chat")
    assert refused.exit_code == 3
    assert "only an aborted rollout can be retried" in refused.stderr

    promoted = fleet.json("promote", "chat")
    assert promoted["step_index"] >= 2
    assert fleet.json("pause", "chat")["phase"] == "Paused"
    again = fleet.cli("rollout", "pause", "chat")
    assert again.exit_code == 3
    assert "already paused; use 'resume'" in again.stderr
    assert fleet.json("resume", "chat")["phase"] in ("Progressing", "Paused")

    aborted = fleet.json("abort", "chat")
    assert aborted["aborted"]
    assert aborted["phase"] == "Degraded"
    ended = fleet.cli("rollout", "status", "chat", "--watch", "--interval", "0.1", "--timeout", "30")
    assert ended.exit_code == 1
    assert "weightship rollout retry chat" in ended.stderr

    retried = fleet.json("retry", "chat")
    assert retried["attempt"] == 2
    assert retried["phase"] != "Degraded"
    finished = fleet.json("promote", "chat", "--full")
    assert finished["phase"] != "Degraded"
    done = fleet.cli("--json", "rollout", "status", "chat", "--watch", "--interval", "0.1", "--timeout", "60")
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["stable"] == fleet.versions["v1"]  # the rollback target
    assert fleet.json("status", "chat")["nodes"] == {fleet.versions["v2"]: 4}
