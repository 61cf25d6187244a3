"""Per-node identity: a node's credential names the node, and acts for that node only.

Threat: a holder of one agent credential (a leaked node token, or the enrolment token shared by
every machine being provisioned) re-registers another node's name (the node silently stops
following rollouts while its status looks healthy), sends heartbeats for it, or reads its
desired state. Everything runs against the real control plane as a process (SQLite and
PostgreSQL) and, where the agent's side matters, real agent processes.
"""

from __future__ import annotations

import stat
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.controlplane_process import ADMIN_TOKEN, ControlPlaneProcess
from tests.controlplane.conftest import problem
from weightship.schemas import NodeEnrolment, NodeInfo, TokenInfo

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def bearer(token: str) -> dict[str, str]:
    """``Authorization`` header for ``token``."""
    return {"Authorization": f"Bearer {token}"}


class API:
    """Plain HTTP calls on a control-plane process, as an attacker would make them."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)

    def token(self, name: str, role: str = "agent") -> dict[str, Any]:
        """Mint a token as the admin; the whole answer (``id``, ``token``)."""
        response = self.http.post("/v1/tokens", json={"name": name, "role": role}, headers=ADMIN)
        assert response.status_code == 201, response.text
        created: dict[str, Any] = response.json()
        return created

    def enrol(self, token: str, name: str, **body: Any) -> httpx.Response:
        """``POST /v1/nodes/enrol`` with ``token``."""
        return self.http.post("/v1/nodes/enrol", json={"name": name, **body}, headers=bearer(token))

    def enrolled(self, token: str, name: str, **body: Any) -> NodeEnrolment:
        """Enrol, expecting success."""
        response = self.enrol(token, name, **body)
        assert response.status_code == 201, response.text
        return NodeEnrolment.model_validate_json(response.content)

    def node(self, name: str) -> NodeInfo:
        """What the admin's ``GET /v1/nodes`` says about ``name``."""
        nodes = [NodeInfo.model_validate(n) for n in self.http.get("/v1/nodes", headers=ADMIN).json()]
        (found,) = [n for n in nodes if n.name == name]
        return found

    def tokens(self) -> list[TokenInfo]:
        """Every active token."""
        return [TokenInfo.model_validate(t) for t in self.http.get("/v1/tokens", headers=ADMIN).json()]

    def node_tokens(self, node_id: str) -> list[TokenInfo]:
        """Active tokens bound to ``node_id``."""
        return [t for t in self.tokens() if t.node_id == node_id]


@pytest.fixture
def controlplane(tmp_path: Path, database_url: str) -> Iterator[ControlPlaneProcess]:
    """The control plane as a process on the parametrised database (SQLite, PostgreSQL)."""
    cp = ControlPlaneProcess(tmp_path / "controlplane", database_url=database_url)
    cp.start()
    try:
        cp.wait_ready()
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def api(controlplane: ControlPlaneProcess) -> Iterator[API]:
    """Raw HTTP on ``controlplane``."""
    client = API(controlplane.url)
    yield client
    client.http.close()


# --- the control plane's side ---------------------------------------------------------------------


def test_a_node_token_cannot_act_for_another_node(api: API) -> None:
    enrolment = api.token("provisioning")["token"]
    victim = api.enrolled(enrolment, "gpu-victim", labels={"zone": "a"}, deployments=["chat"])
    attacker = api.enrolled(enrolment, "gpu-attacker")
    before = api.node("gpu-victim")
    steal = bearer(attacker.token)

    attempts = {
        "heartbeat": api.http.post(f"/v1/nodes/{victim.node.id}/heartbeat", json={}, headers=steal),
        "desired": api.http.get(f"/v1/nodes/{victim.node.id}/desired", headers=steal),
        "register": api.http.post("/v1/nodes/register", json={"name": "gpu-victim"}, headers=steal),
    }
    for call, response in attempts.items():
        assert response.status_code == 403, (call, response.text)
        assert "gpu-attacker" in problem(response)["detail"], call
    after = api.node("gpu-victim")
    assert (after.id, after.labels, after.deployments, after.last_seen) == (
        before.id,
        before.labels,
        before.deployments,
        before.last_seen,
    )
    # Its own node is fine.
    own = bearer(attacker.token)
    assert api.http.post(f"/v1/nodes/{attacker.node.id}/heartbeat", json={}, headers=own).status_code == 204
    assert api.http.get(f"/v1/nodes/{attacker.node.id}/desired", headers=own).status_code == 200
    assert api.http.post("/v1/nodes/register", json={"name": "gpu-attacker"}, headers=own).status_code == 200


def test_an_enrolment_token_cannot_act_for_any_node(api: API) -> None:
    enrolment = api.token("provisioning")["token"]
    node = api.enrolled(enrolment, "gpu-1")
    attempts = {
        "heartbeat": api.http.post(f"/v1/nodes/{node.node.id}/heartbeat", json={}, headers=bearer(enrolment)),
        "desired": api.http.get(f"/v1/nodes/{node.node.id}/desired", headers=bearer(enrolment)),
        "register": api.http.post("/v1/nodes/register", json={"name": "gpu-1"}, headers=bearer(enrolment)),
        "register a new name": api.http.post("/v1/nodes/register", json={"name": "gpu-2"}, headers=bearer(enrolment)),
    }
    for call, response in attempts.items():
        assert response.status_code == 403, (call, response.text)
        assert "enrolment token" in problem(response)["detail"], call
    assert [n["name"] for n in api.http.get("/v1/nodes", headers=ADMIN).json()] == ["gpu-1"]


def test_an_enrolment_token_cannot_hijack_an_enrolled_node(api: API) -> None:
    enrolment = api.token("provisioning")["token"]
    owner = api.enrolled(enrolment, "gpu-1", labels={"zone": "a"}, deployments=["chat"])
    before = api.node("gpu-1")

    for token in (enrolment, api.token("another-enrolment")["token"]):
        hijack = api.enrol(token, "gpu-1", labels={"zone": "evil"}, deployments=[])
        assert hijack.status_code == 409, hijack.text
        message = problem(hijack)["detail"]
        assert "already enrolled" in message
        assert "weightship token revoke" in message
    after = api.node("gpu-1")
    assert (after.id, after.labels, after.deployments) == (before.id, before.labels, before.deployments)
    assert [t.id for t in api.node_tokens(owner.node.id)] == [owner.token_id]
    assert api.http.post("/v1/nodes/register", json={"name": "gpu-1"}, headers=bearer(owner.token)).status_code == 200


def test_concurrent_enrolments_of_one_name_bind_exactly_one_token(api: API, controlplane: ControlPlaneProcess) -> None:
    enrolment = api.token("provisioning")["token"]
    statuses: list[int] = []
    start = threading.Barrier(8)

    def race() -> None:
        with httpx.Client(base_url=controlplane.url, timeout=60) as http:
            start.wait(timeout=30)
            response = http.post("/v1/nodes/enrol", json={"name": "gpu-race"}, headers=bearer(enrolment))
            statuses.append(response.status_code)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert sorted(statuses) == [201] + [409] * 7
    assert len(api.node_tokens(api.node("gpu-race").id)) == 1


def test_a_revoked_node_token_is_refused_and_frees_the_name_for_enrolment(api: API) -> None:
    enrolment = api.token("provisioning")["token"]
    old = api.enrolled(enrolment, "gpu-1", labels={"zone": "a"})
    revoked = api.http.delete(f"/v1/tokens/{old.token_id}", headers=ADMIN)
    assert revoked.status_code == 204

    for response in (
        api.http.post(f"/v1/nodes/{old.node.id}/heartbeat", json={}, headers=bearer(old.token)),
        api.http.get(f"/v1/nodes/{old.node.id}/desired", headers=bearer(old.token)),
        api.http.post("/v1/nodes/register", json={"name": "gpu-1"}, headers=bearer(old.token)),
    ):
        assert response.status_code == 401, response.text
    # The admin's revocation is how a replaced machine gets the name back: same node, new token.
    new = api.enrolled(enrolment, "gpu-1", labels={"zone": "b"})
    assert new.node.id == old.node.id
    assert new.token != old.token
    assert [t.id for t in api.node_tokens(old.node.id)] == [new.token_id]
    assert api.http.post(f"/v1/nodes/{old.node.id}/heartbeat", json={}, headers=bearer(new.token)).status_code == 204
    assert api.http.post(f"/v1/nodes/{old.node.id}/heartbeat", json={}, headers=bearer(old.token)).status_code == 401


# --- the agent's side (real agent processes) ------------------------------------------------------


@pytest.fixture
async def agents(tmp_path: Path) -> AsyncIterator[list[AgentProcess]]:
    """Agent processes a test starts (appended to the list); all stopped at the end."""
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        await agent.close()


def start_agent(
    agents: list[AgentProcess], workdir: Path, name: str, cp: ControlPlaneProcess, token: str, *extra: str
) -> AgentProcess:
    """Start an agent process (``workdir/name`` is its data directory)."""
    workdir.mkdir(parents=True, exist_ok=True)
    agent = AgentProcess(workdir, name, cp.url, token, ["chat"], list(extra))
    agent.start()
    agents.append(agent)
    return agent


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_the_agent_enrols_stores_its_node_token_and_reuses_it_after_a_restart(
    tmp_path: Path, api: API, controlplane: ControlPlaneProcess, agents: list[AgentProcess]
) -> None:
    enrolment = api.token("provisioning")
    agent = start_agent(agents, tmp_path / "agents", "gpu-1", controlplane, enrolment["token"])
    await agent.ready()
    node = await eventually(lambda: api.node("gpu-1") if api.node("gpu-1").last_seen else None, 30, "gpu-1 to register")
    (bound,) = await eventually(lambda: api.node_tokens(node.id), 30, "gpu-1's node token")

    # The agent logs the enrolment after storing the node id: the token row can exist a moment earlier.
    await eventually(lambda: "identity.enrolled" in agent.log(), 30, "gpu-1 to log its enrolment")
    stored = agent.data_dir / "state" / "node-token.json"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert enrolment["token"] not in stored.read_text()

    # With the enrolment token revoked, only the stored node token can bring the node back.
    assert api.http.delete(f"/v1/tokens/{enrolment['id']}", headers=ADMIN).status_code == 204
    agent.stop()
    seen = api.node("gpu-1").last_seen
    assert seen is not None
    agent.start()
    await agent.ready()
    await eventually(lambda: (api.node("gpu-1").last_seen or seen) > seen, 30, "gpu-1 to heartbeat after restart")
    assert api.node("gpu-1").id == node.id
    assert [t.id for t in api.node_tokens(node.id)] == [bound.id]
    assert agent.log().count("identity.enrolled") == 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_second_agent_with_the_enrolment_token_cannot_take_over_a_running_node(
    tmp_path: Path, api: API, controlplane: ControlPlaneProcess, agents: list[AgentProcess]
) -> None:
    enrolment = api.token("provisioning")["token"]
    owner = start_agent(agents, tmp_path / "owner", "gpu-1", controlplane, enrolment, "--zone", "a")
    await owner.ready()
    node = await eventually(lambda: api.node("gpu-1") if api.node("gpu-1").last_seen else None, 30, "gpu-1 to register")

    intruder = start_agent(agents, tmp_path / "intruder", "gpu-1", controlplane, enrolment, "--zone", "evil")
    await intruder.ready()
    await eventually(lambda: "already enrolled" in intruder.log(), 30, "the intruder's enrolment to be refused")
    seen = api.node("gpu-1").last_seen
    assert seen is not None
    # The owner keeps reporting, under its own labels; the intruder never got a token.
    await eventually(lambda: (api.node("gpu-1").last_seen or seen) > seen, 30, "the owner's next heartbeat")
    after = api.node("gpu-1")
    assert (after.id, after.labels.zone) == (node.id, "a")
    assert len(api.node_tokens(node.id)) == 1
    assert "identity.enrolled" not in intruder.log()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_an_agent_whose_node_token_is_revoked_is_refused_then_enrols_again(
    tmp_path: Path, api: API, controlplane: ControlPlaneProcess, agents: list[AgentProcess]
) -> None:
    enrolment = api.token("provisioning")["token"]
    agent = start_agent(agents, tmp_path / "agents", "gpu-1", controlplane, enrolment)
    await agent.ready()
    node = await eventually(lambda: api.node("gpu-1") if api.node("gpu-1").last_seen else None, 30, "gpu-1 to register")
    (old,) = await eventually(lambda: api.node_tokens(node.id), 30, "gpu-1's node token")

    assert api.http.delete(f"/v1/tokens/{old.id}", headers=ADMIN).status_code == 204
    (new,) = await eventually(
        lambda: [t for t in api.node_tokens(node.id) if t.id != old.id], 30, "gpu-1 to enrol again"
    )
    assert new.created_by == "provisioning"  # enrolled again with the enrolment token
    assert "identity.token_refused" in agent.log()
    assert api.node("gpu-1").id == node.id
    seen = api.node("gpu-1").last_seen
    assert seen is not None
    await eventually(lambda: (api.node("gpu-1").last_seen or seen) > seen, 30, "gpu-1 to heartbeat with its new token")
