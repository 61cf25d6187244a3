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
import json
import threading
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from controlplane.fleet import desired_deployment, record_heartbeat, register_node
from controlplane.persistence.rows import DeploymentRow
from controlplane.rollout_driver import FleetRolloutDriver
from controlplane.state import AppState
from tests.controlplane.conftest import LiveControlPlane
from weightship.schemas import (
    DeploymentState,
    FetchFailure,
    FetchProblem,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistration,
    NodeServeMetrics,
    SwitchHookResult,
    VersionInventory,
    VersionServeMetrics,
    VersionState,
)

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
