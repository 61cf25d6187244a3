"""``weightship preheat`` and ``weightship deploy --warm-pool`` against the real control plane over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.weightship.cli_parts import ADMIN, ControlPlane, _publish
from weightship.client import Client
from weightship.schemas import NodeEnrolRequest, NodeHeartbeat, NodeLabels, VersionInventory, VersionState

pytestmark = [pytest.mark.timeout(90), pytest.mark.parametrize("controlplane", ["local"], indirect=True)]


def _node(cp: ControlPlane, name: str, rack: str, **held: VersionState) -> str:
    """Enrol a node in ``rack`` serving nothing and report ``held`` (digest -> state); its id."""
    with Client(cp.url, cp.token(f"enrol-{name}", "agent")) as enrolment:
        enrolled = enrolment.enrol_node(NodeEnrolRequest(name=name, labels=NodeLabels(rack=rack)))
    with Client(cp.url, enrolled.token) as agent:
        inventory = [VersionInventory(digest=d, state=s, bytes_total=1, bytes_present=1) for d, s in held.items()]
        agent.heartbeat(enrolled.node.id, NodeHeartbeat(inventory=inventory))
    return enrolled.node.id


def test_preheat_lists_progress_waits_for_staged_nodes_and_cancels(
    controlplane: ControlPlane, models: dict[str, Path]
) -> None:
    cp = controlplane
    _publish(cp, models["v1"], "v1", ADMIN)
    v2 = _publish(cp, models["v2"], "v2", ADMIN)
    cp.json("deploy", "create", "chat", "--model", "llama")
    cp.json("deploy", "set", "chat", "--stable", "v1")
    _node(cp, "gpu-1", "r1", **{v2["digest"]: VersionState.ready})
    _node(cp, "gpu-2", "r2")

    made = cp.json("preheat", "chat", "v2", "--selector", "rack=r1", "--wait")
    assert (made["digest"], made["selector"], made["nodes_matched"], made["nodes_staged"]) == (
        v2["digest"], {"rack": "r1"}, 1, 1,
    )  # fmt: skip
    (listed,) = cp.json("preheat", "chat", "--list")
    assert listed["id"] == made["id"]
    people = cp.cli("preheat", "chat", "--list")
    assert people.exit_code == 0
    assert made["id"] in people.stdout
    assert "rack=r1" in people.stdout

    assert cp.json("preheat", "chat", "--cancel", made["id"]) == {"cancelled": made["id"]}
    assert cp.json("preheat", "chat", "--list") == []


def test_preheat_wait_stops_with_a_clear_error_when_a_node_failed(
    controlplane: ControlPlane, models: dict[str, Path]
) -> None:
    cp = controlplane
    v1 = _publish(cp, models["v1"], "v1", ADMIN)
    cp.json("deploy", "create", "chat", "--model", "llama")
    _node(cp, "gpu-1", "r1", **{v1["digest"]: VersionState.failed})
    result = cp.cli("preheat", "chat", "v1", "--wait")
    assert result.exit_code == 3
    assert "1 of 1 nodes failed" in result.stderr
    assert "weightship nodes" in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("preheat", "chat", "v1", "--selector", "rack"), "--selector takes node labels as k=v"),
        (("preheat", "chat", "v1", "--selector", "colour=blue"), "not a node label"),
        (("preheat", "chat"), "exactly one of VERSION, --list or --cancel"),
        (("preheat", "chat", "v1", "--list"), "exactly one of VERSION, --list or --cancel"),
        (("preheat", "chat", "--cancel", "nope"), "has no preheat 'nope'"),
        (("deploy", "warm-pool", "chat"), "either --selector k=v,... or --off"),
    ],
)
def test_bad_preheat_and_warm_pool_commands_fail_with_one_clear_line(
    controlplane: ControlPlane, models: dict[str, Path], args: tuple[str, ...], says: str
) -> None:
    cp = controlplane
    _publish(cp, models["v1"], "v1", ADMIN)
    cp.json("deploy", "create", "chat", "--model", "llama")
    result = cp.cli(*args)
    assert result.exit_code != 0
    assert says in result.stderr
    assert cp.json("preheat", "chat", "--list") == []


def test_deploy_declares_changes_and_drops_a_warm_pool(controlplane: ControlPlane, models: dict[str, Path]) -> None:
    cp = controlplane
    _publish(cp, models["v1"], "v1", ADMIN)
    created: Any = cp.json("deploy", "create", "chat", "--model", "llama", "--warm-pool", "cluster=warm")
    assert created["warm_pool"] == {"selector": {"cluster": "warm"}}
    changed = cp.json("deploy", "warm-pool", "chat", "--selector", "cluster=spare,gpu_type=h100")
    assert changed["warm_pool"] == {"selector": {"cluster": "spare", "gpu_type": "h100"}}
    shown = cp.cli("deploy", "warm-pool", "chat", "--selector", "*")
    assert shown.exit_code == 0
    assert "warm pool" in shown.stdout
    assert cp.json("deploy", "warm-pool", "chat", "--off")["warm_pool"] is None
