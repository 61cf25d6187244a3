"""Parts for driving rollouts through a live control plane in tests.

- :class:`Hook`: a real local HTTP server (a thread) answering webhook measurements with values
  the test scripts, per metric path; it records what it was asked.
- :class:`SimFleet`: nodes registered and heartbeating through the control plane's own fleet
  functions (``register_node``, ``record_heartbeat``); :meth:`SimFleet.converge` makes every node
  report what its desired state asks (holding every ``keep`` version verified, serving its digest),
  except nodes told their disk is full, which report the canary's fetch failing.
- :func:`tick` (with ``weightship.testing.ManualUTCClock``): the driver's ``now`` under the test's control, and one
  driver tick run on the app's own event loop (the driver announces pointer changes there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Collection, Iterator, Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from controlplane.fleet import desired_deployment, record_heartbeat, register_node
from controlplane.persistence.rows import DeploymentRow
from controlplane.rollout_driver import FleetRolloutDriver
from controlplane.settings import Settings
from controlplane.state import AppState
from tests.controlplane.conftest import LiveControlPlane, SeedVersions
from weightship.schemas import (
    DeploymentState,
    FetchFailure,
    FetchProblem,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistration,
    NodeServeMetrics,
    Role,
    SwitchHookResult,
    VersionInventory,
    VersionServeMetrics,
    VersionState,
)
from weightship.testing import ManualUTCClock

__all__ = ["Hook", "SimFleet", "driver_of", "metric", "tick"]


class Hook:
    """Webhook measurements: ``answers[name]`` is a list of values given in turn (the last repeats)."""

    def __init__(self) -> None:
        self.answers: dict[str, list[object]] = {}
        self.asked: list[dict[str, Any]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                name = self.path.strip("/")
                hook.asked.append({"name": name, **body})
                values = hook.answers.get(name) or [None]
                value = values.pop(0) if len(values) > 1 else values[0]
                payload = json.dumps({"value": value}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


def metric(hook: Hook, name: str, **extra: Any) -> dict[str, Any]:
    """A webhook metric: Successful when the value is at most 0.1, Failed above."""
    return {
        "name": name,
        "successCondition": "result <= 0.1",
        "failureCondition": "result > 0.1",
        "provider": {"webhook": {"url": f"{hook.url}/{name}", "jsonPath": "$.value", "timeout": "5s"}},
        **extra,
    }


def driver_of(cp: LiveControlPlane) -> FleetRolloutDriver:
    """The live control plane's rollout driver."""
    state = cp.app.state.ws
    assert isinstance(state, AppState)
    assert state.rollouts is not None
    return state.rollouts


def tick(cp: LiveControlPlane, times: int = 1) -> dict[str, str]:
    """Run ``times`` driver ticks on the app's event loop; the outcomes of the last."""
    driver = driver_of(cp)
    assert driver.loop is not None
    outcomes: dict[str, str] = {}
    for _ in range(times):
        outcomes = asyncio.run_coroutine_threadsafe(driver.tick(), driver.loop).result(timeout=60)
    return outcomes


class SimFleet:
    """``count`` nodes of ``deployment`` reporting through the control plane's fleet functions."""

    def __init__(self, cp: LiveControlPlane, deployment: str, count: int, size: int = 1000) -> None:
        state = self.state = cp.state
        #: the control plane's event loop, where heartbeats are written (group commit)
        self.loop = driver_of(cp).loop
        self.deployment = deployment
        self.size = size
        self.nodes: list[NodeInfo] = []
        for i in range(count):
            info = register_node(state, NodeRegistration(name=f"node-{i}", deployments=[deployment]))
            assert isinstance(info, NodeInfo)
            self.nodes.append(info)
        #: what each node served last: node name -> digest
        self.serving: dict[str, str | None] = {}
        self.since = datetime.now(UTC)
        #: node -> (failed, passed) loads of the canary its model server reports (see ``converge``)
        self.canary_loads: dict[str, tuple[int, int]] = {}
        #: the last version some node was told to serve as canary
        self.last_canary: str | None = None

    def converge(
        self,
        disk_full: Mapping[str, str] | None = None,
        refuse: Collection[str] = (),
        loading: Collection[str] = (),
        hook_failing: Collection[str] = (),
    ) -> None:
        """Every node reports what its desired state asks; ``disk_full`` nodes cannot fetch that digest.

        Nodes in ``refuse`` or ``loading`` run a model server that reports its counters: it loaded
        every version it served except the canary, which it refused (failed validation) or has not
        loaded yet. ``canary_loads`` (node -> failed, passed loads of the canary, as counted since
        the agent started) says the same for any count. Other nodes report no model server. Nodes in
        ``hook_failing`` switched, but their switch hook failed to tell their external server.
        """
        loads = {**self.canary_loads, **{n: (1, 0) for n in refuse}, **{n: (0, 0) for n in loading}}
        with self.state.sessions() as session:
            row = session.get(DeploymentRow, self.deployment)
            assert row is not None
            wanted = {n.name: desired_deployment(row, n.name) for n in self.nodes}
            self.last_canary = row.canary or self.last_canary
        for node in self.nodes:
            desired = wanted[node.name]
            blocked = (disk_full or {}).get(node.name)
            inventory = []
            for digest in desired.keep:
                if digest == blocked:
                    problem = FetchProblem(
                        reason=FetchFailure.disk_full,
                        message="no space left on device: 0 B free of 1000 B needed",
                        since=datetime.now(UTC),
                        attempts=3,
                    )
                    inventory.append(VersionInventory(digest=digest, state=VersionState.failed, bytes_total=self.size,
                                                      bytes_present=0, problem=problem))  # fmt: skip
                else:
                    inventory.append(VersionInventory(digest=digest, state=VersionState.ready, bytes_total=self.size,
                                                      bytes_present=self.size))  # fmt: skip
            serving = desired.digest if desired.digest != blocked else self.serving.get(node.name)
            self.serving[node.name] = serving
            stable = desired.keep[0]  # the pointer's stable version comes first
            versions = [VersionServeMetrics(deployment=self.deployment, digest=stable, validations_passed=1, instances=1)]
            failed, passed = loads.get(node.name, (0, 0))
            # Counters are kept per version since the agent started, whatever the node serves now.
            if (failed or passed) and self.last_canary is not None:
                versions.append(VersionServeMetrics(deployment=self.deployment, digest=self.last_canary,
                                                    validations_failed=failed, validations_passed=passed,
                                                    instances=1))  # fmt: skip
            hook = None
            if node.name in hook_failing and serving is not None:
                hook = SwitchHookResult(kind="command", digest=serving, epoch=desired.epoch, ok=False,
                                        detail="exit status 1", exit_code=1, at=datetime.now(UTC))  # fmt: skip
            report = NodeHeartbeat(
                inventory=inventory,
                deployments=[DeploymentState(name=self.deployment, digest=serving, epoch=desired.epoch, hook=hook)],
                serve=NodeServeMetrics(since=self.since, versions=versions) if node.name in loads else None,
            )
            beat = record_heartbeat(self.state, node.id, node.name, report)
            assert self.loop is not None
            asyncio.run_coroutine_threadsafe(beat, self.loop).result(timeout=60)


Headers = dict[Role, dict[str, str]]


@pytest.fixture
def cp_settings(cp_settings: Settings) -> Settings:
    """The live control plane without its background driver: the tests tick it."""
    return dataclasses.replace(cp_settings, rollout_tick_seconds=0.0)


@pytest.fixture
def hook() -> Iterator[Hook]:
    server = Hook()
    yield server
    server.close()


@pytest.fixture
def clock(live_controlplane: LiveControlPlane) -> ManualUTCClock:
    fake = ManualUTCClock()
    driver_of(live_controlplane).clock = fake
    return fake


@dataclasses.dataclass
class World:
    """A deployment ``chat`` of model ``m`` serving v1 on four nodes; v2 and v3 are ready."""

    client: httpx.Client
    headers: Headers
    versions: dict[str, str]
    fleet: SimFleet
    clock: ManualUTCClock
    cp: LiveControlPlane

    @property
    def operator(self) -> dict[str, str]:
        return self.headers[Role.operator]

    def start(self, spec: dict[str, Any], status: int = 201, headers: dict[str, str] | None = None) -> dict[str, Any]:
        response = self.client.post(
            "/v1/deployments/chat/rollouts", json={"spec": spec}, headers=headers or self.operator
        )
        assert response.status_code == status, response.text
        body: dict[str, Any] = response.json()
        return body

    def get(self, rollout_id: str = "current") -> dict[str, Any]:
        response = self.client.get(f"/v1/deployments/chat/rollouts/{rollout_id}", headers=self.operator)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def act(self, rollout_id: str, verb: str) -> httpx.Response:
        return self.client.post(
            f"/v1/deployments/chat/rollouts/{rollout_id}/actions", json={"verb": verb}, headers=self.operator
        )

    def pointer(self) -> dict[str, Any]:
        body: dict[str, Any] = self.client.get("/v1/deployments/chat", headers=self.operator).json()
        return body

    def history(self) -> list[dict[str, Any]]:
        body: list[dict[str, Any]] = self.client.get("/v1/deployments/chat/history", headers=self.operator).json()
        return body

    def run(self, rounds: int = 12, seconds: float = 1.0, **converge: Any) -> dict[str, Any]:
        """Tick, let the fleet follow, advance the clock; until the rollout leaves Progressing."""
        rollout = self.get()
        for _ in range(rounds):
            tick(self.cp)
            self.fleet.converge(**converge)
            self.clock.advance(seconds)
            rollout = self.get()
            if rollout["phase"] != "Progressing" or rollout["completed"]:
                break
        return rollout


@pytest.fixture
def world(
    cp_client: httpx.Client,
    role_headers: Headers,
    seed_versions: SeedVersions,
    cp_state: AppState,
    clock: ManualUTCClock,
    live_controlplane: LiveControlPlane,
) -> World:
    versions = seed_versions("m", ("v1", "v2", "v3"))
    admin = role_headers[Role.admin]
    assert cp_client.post("/v1/deployments", json={"name": "chat", "model": "m"}, headers=admin).status_code == 201
    put = cp_client.put("/v1/deployments/chat/pointer", json={"stable": "v1"}, headers={**admin, "If-Match": '"0"'})
    assert put.status_code == 200, put.text
    fleet = SimFleet(live_controlplane, "chat", 4)
    fleet.converge()
    return World(cp_client, role_headers, versions, fleet, clock, live_controlplane)
