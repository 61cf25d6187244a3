"""What goes wrong around a ModelRollout shows on it: API refusals, an unreachable control plane, a rollback by hand.

Real kopf operators, the real ``kubernetes`` client and a live control plane, as in
``test_rollouts.py``. kmock answers the refusals a real API server gives (403 from RBAC, 422 from
validation or an admission policy) where a test asks it to; a user reads them with
``kubectl describe mro`` (conditions and Events), so the tests read the same.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kmock
import pytest
import pytest_asyncio
from aiohttp import web

from tests.kubernetes.conftest import NAMESPACE, REPLICASETS, Operators, VersionedEmulator
from tests.kubernetes.operator_parts import condition, live, sets_of
from tests.kubernetes.rollout_parts import (
    BASE,
    WAIT,
    apply,
    deployed,
    event_reasons,
    reconciles,
    rollout,
    status,
    verb,
)
from weightship.client import Client
from weightship.testing import eventually_async, free_port

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("replicaset_controller")]

ADMIN = "ws_test-bootstrap-admin-0123456789abcdef"


class Cable:
    """A plain reverse proxy in front of the control plane that a test can unplug (connections refused)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.plugged = True
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app)
        self.site: web.TCPSite | None = None
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Listen (again) on its port."""
        if self.session is None:
            await self.runner.setup()
            self.session = aiohttp.ClientSession()
        self.site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await self.site.start()
        self.plugged = True

    async def unplug(self) -> None:
        """Stop listening, and drop any kept-alive connection at its next request."""
        self.plugged = False
        assert self.site is not None
        await self.site.stop()

    async def close(self) -> None:
        """Stop for good."""
        if self.session is not None:
            await self.session.close()
        await self.runner.cleanup()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if not self.plugged:
            assert request.transport is not None
            request.transport.close()
            raise web.HTTPServiceUnavailable()
        assert self.session is not None
        keep = ("Authorization", "Content-Type", "If-Match")
        async with self.session.request(
            request.method, self.target + request.path_qs, data=await request.read(),
            headers={k: v for k, v in request.headers.items() if k in keep},
        ) as answer:  # fmt: skip
            headers = {k: v for k, v in answer.headers.items() if k in ("Content-Type", "ETag")}
            return web.Response(status=answer.status, body=await answer.read(), headers=headers)


@pytest_asyncio.fixture
async def cable(controlplane: tuple[str, dict[str, str]]) -> AsyncIterator[Cable]:
    """The control plane behind a cable the test can unplug."""
    proxy = Cable(controlplane[0])
    await proxy.start()
    yield proxy
    await proxy.close()


def refuse(server: VersionedEmulator, method: str, path: str, code: int, reason: str, message: str) -> Callable[[], None]:
    """Make kmock refuse ``method`` on paths matching ``path`` as an API server would; returns the undo."""
    original = server._handle

    async def handle(request: Any) -> Any:
        if request.method.name == method and re.search(path, request.url.path):
            raise kmock.KubernetesError(status=code, reason=reason, message=message)
        return await original(request)

    server._handle = handle  # type: ignore[method-assign]
    return lambda: delattr(server, "_handle")


def events(server: VersionedEmulator, reason: str) -> list[dict[str, Any]]:
    """The Events with ``reason`` posted so far."""
    kind = kmock.resource("", "v1", "events")
    found = [server.objects[key] for key in list(server.objects) if key[0] == kind]
    return [dict(e) for e in found if e.get("reason") == reason]


async def recovered_event(server: VersionedEmulator) -> None:
    """Wait for the ``Reconciled`` Event of a reconcile that got through again.

    The operator asks for it before it writes ``Reconciled=True``, but kopf posts Events from its
    own queue in the background, so the status can reach the API server first: wait for it.
    """
    await eventually_async(lambda: "Reconciled" in event_reasons(server), WAIT, "a Reconciled Event")


@pytest.mark.parametrize(
    ("code", "reason", "message", "advice"),
    [
        (403, "Forbidden", 'replicasets.apps is forbidden: User "system:serviceaccount:weightship:weightship-operator" '
                           'cannot create resource "replicasets" in API group "apps" in the namespace "models"',
         "operator's Role"),
        (422, "Invalid", 'ReplicaSet.apps "chat" is invalid: spec.template.spec.containers[0].image: Required value',
         "admission policy"),
    ],
)  # fmt: skip
async def test_a_refused_replicaset_shows_as_a_condition_and_one_event_until_it_is_accepted(
    kmock_server: VersionedEmulator,
    operators: Operators,
    controlplane: tuple[str, dict[str, str]],
    code: int,
    reason: str,
    message: str,
    advice: str,
) -> None:
    _, digests = controlplane
    undo = refuse(kmock_server, "POST", r"/replicasets$", code, reason, message)
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    refused = await eventually_async(
        lambda: (c := condition(kmock_server, "Reconciled")).get("status") == "False" and c, WAIT, "Reconciled=False"
    )
    assert refused["reason"] == reason
    assert f"create ReplicaSet {NAMESPACE}/chat-" in refused["message"]
    assert message in refused["message"]
    assert advice in refused["message"]
    await eventually_async(lambda: events(kmock_server, reason), WAIT, f"a {reason} Event")
    await reconciles(kmock_server, 3)  # the same refusal again and again...
    (warning,) = events(kmock_server, reason)  # ...is said once
    assert warning["type"] == "Warning"
    assert message in warning["message"]

    undo()  # RBAC or the policy fixed: the next reconcile gets through
    await deployed(kmock_server, digests["v1"])
    assert condition(kmock_server, "Reconciled")["status"] == "True"
    await recovered_event(kmock_server)


async def test_an_unreachable_control_plane_shows_as_a_condition_and_an_event(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]]
) -> None:
    operators.cp_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    failed = await eventually_async(
        lambda: (c := condition(kmock_server, "Reconciled")).get("status") == "False" and c, WAIT, "Reconciled=False"
    )
    assert failed["reason"] == "ControlPlaneUnreachable"
    assert "cannot reach the control plane" in failed["message"]
    assert "WEIGHTSHIP_URL" in failed["message"]  # what to check
    await eventually_async(lambda: events(kmock_server, "ControlPlaneUnreachable"), WAIT, "a Warning Event")
    assert live(kmock_server, REPLICASETS) == []  # nothing made for a version nobody could resolve


async def test_a_rollback_made_outside_the_operator_is_followed_shown_and_left_alone_until_retry(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]]
) -> None:
    url, digests = controlplane
    operators.start("op-a")
    window = {"rollbackWindowSeconds": 600}
    await apply(kmock_server, rollout("v1", [], **window))
    await deployed(kmock_server, digests["v1"])
    await apply(kmock_server, rollout("v2", [], **window))
    await deployed(kmock_server, digests["v2"])
    ((v1_set, v1_before),) = sets_of(kmock_server, digests["v1"]).items()
    assert (v1_before["role"], v1_before["replicas"]) == ("previous", 4)

    with Client(url, ADMIN) as client:
        moved = client.rollback("chat-prod", reason="v2 answers badly")
    assert moved.stable == digests["v1"]

    shown = await eventually_async(
        lambda: (c := condition(kmock_server, "PointerMovedOutside")).get("status") == "True" and c, WAIT, "the move"
    )
    assert shown["reason"] == "RolledBackOutside"
    assert "moved deployment chat-prod's pointer to v1" in shown["message"]
    assert "v2 answers badly" in shown["message"]
    await eventually_async(lambda: events(kmock_server, "RolledBackOutside"), WAIT, "a RolledBackOutside Event")
    now = status(kmock_server)
    assert (now["stable"], now["stableLabel"], now.get("canary")) == (digests["v1"], "v1", None)
    assert (now["phase"], now["engine"]["abortReason"]) == ("Degraded", "PointerChangedExternally")
    # The ReplicaSets follow: v1's, kept for the window, is stable again with the pods it had.
    await eventually_async(
        lambda: sets_of(kmock_server, digests["v1"]) == {v1_set: {**v1_before, "role": "stable"}}, WAIT, "v1 stable"
    )
    assert [s["role"] for s in sets_of(kmock_server, digests["v2"]).values()] == ["previous"]
    created = [r for r in kmock_server if r.method.name == "POST" and r.url.path.endswith("/replicasets")]
    assert len(created) == 2  # no pod was made for the rollback

    await reconciles(kmock_server, 3)
    with Client(url, ADMIN) as client:
        assert client.get_deployment("chat-prod").epoch == moved.epoch  # the operator did not move it back
    assert len(events(kmock_server, "RolledBackOutside")) == 1

    await verb(kmock_server, "retry")  # a person asks for v2 again
    await deployed(kmock_server, digests["v2"])
    assert condition(kmock_server, "PointerMovedOutside")["status"] == "False"
    with Client(url, ADMIN) as client:
        assert client.get_deployment("chat-prod").stable == digests["v2"]


async def test_with_the_control_plane_unplugged_the_pods_still_converge_and_the_condition_says_why(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], cable: Cable
) -> None:
    _, digests = controlplane
    operators.cp_url = cable.url
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    await deployed(kmock_server, digests["v1"])
    ((name, before),) = sets_of(kmock_server, digests["v1"]).items()

    await cable.unplug()
    failed = await eventually_async(
        lambda: (c := condition(kmock_server, "Reconciled")).get("status") == "False" and c, WAIT, "Reconciled=False"
    )
    assert failed["reason"] == "ControlPlaneUnreachable"
    # The pods need no control plane: a ReplicaSet deleted by hand comes back, a new count applies.
    answer = await kmock_server.delete(f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets/{name}")
    assert answer.status == 200, await answer.text()
    answer = await kmock_server.patch(f"{BASE}/chat", json={"spec": {"replicas": 5}})
    assert answer.status == 200, await answer.text()
    await eventually_async(
        lambda: sets_of(kmock_server, digests["v1"]) == {name: {**before, "replicas": 5}}, WAIT, "v1 back, at 5"
    )
    assert len(events(kmock_server, "ControlPlaneUnreachable")) == 1

    await cable.start()
    await eventually_async(
        lambda: condition(kmock_server, "Reconciled").get("status") == "True", WAIT, "Reconciled=True again"
    )
    await recovered_event(kmock_server)
