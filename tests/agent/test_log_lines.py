"""Every line the control plane and an agent log in a real run splits back into its fields.

``weightship.logs`` promises that an event line (``<event> key=value ...``, values quoted where
they need it) parses back with ``parse_fields``; this runs a control plane and an agent as
processes through publish, deploy, a pointer move and a rollback, and parses every line they
logged from our packages.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.agent.agent_processes import Spawn
from tests.agent.fleet import Fleet
from weightship.logs import parse_fields
from weightship.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

#: ``logging``'s "%(asctime)s %(levelname)s %(name)s %(message)s", as both processes write it
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ (?P<logger>\S+) (?P<message>.*)$")
_EVENT_NAME = re.compile(r"^[a-z0-9_]+(?:\.[a-z0-9_]+)+$")
_OURS = ("controlplane", "agent", "gpu_loader", "weightship")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The fleet of ``tests/agent/conftest.py``, its control plane logging at info level."""
    world = Fleet(tmp_path_factory.mktemp("fleet"))
    world.cp.log_level = "info"
    try:
        world.start()
        yield world
    finally:
        world.close()


def events(log: str) -> list[tuple[str, dict[str, str]]]:
    """Every record our packages logged, parsed; anything else (tracebacks, uvicorn's lines) is skipped."""
    found = []
    for line in log.splitlines():
        record = _RECORD.match(line)
        if record is None or record["logger"].split(".")[0] not in _OURS:
            continue
        name, fields = parse_fields(record["message"])
        assert _EVENT_NAME.match(name), f"event name {name!r} is not snake.event: {line}"
        found.append((name, fields))
    return found


async def test_every_log_line_of_a_real_run_parses_back_into_fields(
    spawn: Spawn, fleet: Fleet, versions: dict[str, Manifest], model: str, deployment: str
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    fleet.point(deployment, model, "v1")
    agent = spawn("node-logs")
    await agent.ready()
    await agent.serving(v1.digest)
    fleet.point(deployment, model, "v2")
    await agent.serving(v2.digest)
    fleet.rollback(deployment)
    await agent.serving(v1.digest)

    control_plane = events(fleet.cp.log())
    node = events(agent.log())
    changes = [fields for name, fields in control_plane if name == "pointer.changed" and fields["deployment"] == deployment]
    assert [c["stable"] for c in changes] == [v1.digest, v2.digest, v1.digest], changes
    assert any(name == "version.committed" and fields["model"] == model for name, fields in control_plane)
    assert node, "the agent logged no event"
