"""Pins on a fake clock: asks and leases lapse, a release ends a lease at once, a restart keeps them."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.pins import ASK_SECONDS, Pins
from weightship.testing import ManualClock

V1 = "sha256:" + "1" * 64
V2 = "sha256:" + "2" * 64

pytestmark = pytest.mark.timeout(10)


def test_an_ask_holds_its_version_and_follows_its_deployment_until_it_lapses() -> None:
    clock = ManualClock()
    pins = Pins(clock=clock)
    pins.ask("chat", V1)
    pins.ask(None, V2)  # without a deployment: held, but nothing to follow
    assert (pins.digests(), pins.deployments(), pins.asked()) == ({V1, V2}, {"chat"}, {"chat": {V1}})
    clock.now += ASK_SECONDS - 1
    pins.ask("chat", V1)  # asking again renews
    clock.now += 2
    assert pins.digests() == {V1}
    assert [p.digest for p in pins.prune()] == [V2]


def test_a_lease_lapses_unless_renewed_and_a_release_ends_it_at_once() -> None:
    clock = ManualClock()
    pins = Pins(clock=clock)
    pins.lease("server-a", "chat", V1, 6)
    pins.lease("server-b", "chat", V2, 6)
    clock.now += 5
    pins.lease("server-a", "chat", V1, 6)
    clock.now += 2
    assert pins.digests() == {V1}  # b stopped renewing (it died)
    assert pins.release("server-a")
    assert not pins.release("server-a")
    assert pins.digests() == set()
    assert pins.deployments() == set()


def test_a_restarted_agent_gives_stored_pins_a_fresh_lifetime(tmp_path: Path) -> None:
    clock = ManualClock()
    pins = Pins(tmp_path / "pins.json", clock=clock)
    pins.lease("server-a", "chat", V1, 30)
    data = pins.to_save()
    assert data is not None
    pins.save(data)
    pins.lease("server-a", "chat", V1, 30)
    assert pins.to_save() is None  # a renewal changes no holder: nothing to write

    clock.now += 3600  # long after: the old lease would have lapsed, but the server may still run
    restarted = Pins(tmp_path / "pins.json", clock=clock)
    restarted.load()
    assert restarted.digests() == {V1}
    clock.now += 31
    assert restarted.digests() == set()


def test_an_unreadable_pins_file_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "pins.json").write_text("{not json")
    pins = Pins(tmp_path / "pins.json")
    pins.load()
    assert pins.digests() == set()
