"""Operator verbs refuse what does not apply, and say which verb does."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import pytest

from controlplane.rollouts import verbs
from controlplane.rollouts.phases import Phase
from controlplane.rollouts.spec import RolloutSpec, parse_spec
from controlplane.rollouts.status import RolloutStatus
from tests.controlplane.rollouts.simulation import CANARY, World

pytestmark = pytest.mark.timeout(10)

Verb = Callable[[RolloutSpec, RolloutStatus, datetime], RolloutStatus]
SPEC = parse_spec({"version": CANARY, "steps": [{"setWeight": 10}, {"pause": {}}, {"setWeight": 50}]})


def at(phase: str) -> World:
    world = World(SPEC)
    if phase == "paused-step":
        world.run(until=Phase.PAUSED)
    elif phase == "aborted":
        world.tick()
        assert world.status is not None
        world.status = verbs.abort_rollout(SPEC, world.status, world.now)
    elif phase == "complete":
        world.run(until=Phase.PAUSED)
        assert world.status is not None
        world.status = verbs.promote_full(SPEC, world.status, world.now)
        world.run()
    else:
        world.tick()
    return world


@pytest.mark.parametrize(
    ("state", "verb", "complaint"),
    [
        ("aborted", verbs.promote, "aborted (AbortedByOperator); use 'retry'"),
        ("aborted", verbs.promote_full, "use 'retry'"),
        ("aborted", verbs.pause, "use 'retry'"),
        ("aborted", verbs.abort_rollout, "use 'retry'"),
        ("complete", verbs.promote, "use 'weightship rollback'"),
        ("complete", verbs.abort_rollout, "is complete"),
        ("complete", verbs.retry, "is Healthy, not aborted"),
        ("progressing", verbs.retry, "is Progressing, not aborted"),
        ("progressing", verbs.resume, "is not paused"),
        ("paused-step", verbs.resume, "paused by an operator but by PauseStep; use 'promote'"),
    ],
)
def test_verbs_that_do_not_apply_are_refused_with_the_way_forward(state: str, verb: Verb, complaint: str) -> None:
    world = at(state)
    assert world.status is not None
    with pytest.raises(verbs.VerbError) as caught:
        verb(SPEC, world.status, world.now)
    assert complaint in caught.value.message


def test_pausing_twice_is_refused() -> None:
    world = at("progressing")
    assert world.status is not None
    paused = verbs.pause(SPEC, world.status, world.now)
    with pytest.raises(verbs.VerbError, match="already paused"):
        verbs.pause(SPEC, paused, world.now)


def test_verbs_on_a_status_of_another_spec_are_refused() -> None:
    world = at("progressing")
    assert world.status is not None
    other = parse_spec({"version": CANARY, "steps": [{"setWeight": 20}]})
    with pytest.raises(verbs.VerbError, match="spec changed"):
        verbs.promote(other, world.status, world.now)
