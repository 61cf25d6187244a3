"""The fleet driver in real control-plane processes: one drives at a time, and a crash loses nothing.

Each ``python -m controlplane serve`` runs its own rollout driver (ticking every 0.2 s, leases of
2 s). With two processes on one PostgreSQL database exactly one holds the rollout's lease and moves
the pointer; when it is killed (SIGKILL, mid-rollout) the other takes the lease over once it
lapses and carries on from the stored status: no step is repeated, the attempt stays 1, every
pointer move is in the history once. A single process on SQLite killed and started again does the
same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from controlplane.persistence.engine import make_engine, make_sessionmaker
from controlplane.persistence.rows import RolloutRow
from tests.agent.controlplane_process import ADMIN_TOKEN, ControlPlaneProcess
from tests.controlplane.replica_parts import seed
from weightship.testing import eventually as poll_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
#: no step waits on nodes: two timed pauses between weights keep the rollout going for ~4 s
SPEC = {
    "version": "v2",
    "steps": [{"setWeight": 25}, {"pause": {"duration": "2s"}}, {"setWeight": 50}, {"pause": {"duration": "2s"}}],
}


@pytest.fixture(autouse=True)
def fast_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes started by these tests tick often and hold short leases."""
    monkeypatch.setenv("WEIGHTSHIP_ROLLOUT_TICK_SECONDS", "0.2")
    monkeypatch.setenv("WEIGHTSHIP_ROLLOUT_LEASE_SECONDS", "2")


def holder(database_url: str, rollout_id: str) -> str | None:
    """Who holds the rollout's lease now, read from the database."""
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            return session.scalar(select(RolloutRow.lease_holder).where(RolloutRow.id == rollout_id))
    finally:
        engine.dispose()


def pid_of(lease_holder: str) -> int:
    """The process id in a lease holder name (``host:pid:suffix``)."""
    return int(lease_holder.split(":")[-2])


def start_rollout(url: str, database_url: str) -> str:
    """Deployment ``chat`` on v1, and a rollout of v2 started."""
    seed(database_url, "m", ("v1", "v2"))
    with httpx.Client(base_url=url, timeout=30, headers=ADMIN) as http:
        assert http.post("/v1/deployments", json={"name": "chat", "model": "m"}).status_code == 201
        put = http.put("/v1/deployments/chat/pointer", json={"stable": "v1"}, headers={"If-Match": '"0"'})
        assert put.status_code == 200, put.text
        created = http.post("/v1/deployments/chat/rollouts", json={"spec": SPEC})
        assert created.status_code == 201, created.text
        rollout_id: str = created.json()["id"]
        return rollout_id


def rollout(url: str, rollout_id: str) -> dict[str, Any]:
    """The rollout as the API shows it."""
    body: dict[str, Any] = httpx.get(
        f"{url}/v1/deployments/chat/rollouts/{rollout_id}", headers=ADMIN, timeout=10
    ).json()
    return body


def moves(url: str, rollout_id: str) -> list[float | str]:
    """The rollout's pointer moves, oldest first: the canary share, or ``promote``."""
    events = httpx.get(f"{url}/v1/deployments/chat/history", headers=ADMIN, timeout=10).json()
    ours = [e for e in reversed(events) if e["actor"] == f"rollout:{rollout_id}"]
    return [e["action"] if e["action"] == "promote" else e["canary_share"] for e in ours]


@pytest.fixture
def two(database_url: str, tmp_path: Path) -> Iterator[tuple[ControlPlaneProcess, ControlPlaneProcess]]:
    """Two control-plane processes on one fresh database."""
    first = ControlPlaneProcess(tmp_path / "a", database_url=database_url)
    second = ControlPlaneProcess(tmp_path / "b", database_url=database_url)
    try:
        for process in (first, second):
            process.start()
        for process in (first, second):
            process.wait_ready()
        yield first, second
    finally:
        for process in (first, second):
            process.stop()


@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_two_processes_one_drives_and_the_other_takes_over_when_it_is_killed(
    two: tuple[ControlPlaneProcess, ControlPlaneProcess], database_url: str
) -> None:
    rollout_id = start_rollout(two[0].url, database_url)
    by_pid = {p.proc.pid: p for p in two if p.proc is not None}

    first_holder = str(poll_until(lambda: holder(database_url, rollout_id), 30, "a process to lease the rollout"))
    driving = by_pid[pid_of(first_holder)]
    other = next(p for p in two if p is not driving)
    poll_until(lambda: rollout(other.url, rollout_id)["weight"] == 25.0, 30, "the canary at 25 %")
    seen = {holder(database_url, rollout_id) for _ in range(10)}
    assert seen == {first_holder}, seen  # the other process never took the lease while it was renewed

    driving.kill()  # mid-rollout: in the first pause, or at the second weight
    poll_until(lambda: rollout(other.url, rollout_id)["completed"], 60, "the rollout to complete")

    done = rollout(other.url, rollout_id)
    assert done["phase"] == "Healthy"
    assert done["attempt"] == 1
    assert moves(other.url, rollout_id) == [0.25, 0.5, "promote"]  # resumed: nothing repeated
    assert holder(database_url, rollout_id) is None  # released when done


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_control_plane_killed_mid_rollout_resumes_from_the_stored_status(database_url: str, tmp_path: Path) -> None:
    process = ControlPlaneProcess(tmp_path / "cp", database_url=database_url)
    process.start()
    try:
        process.wait_ready()
        rollout_id = start_rollout(process.url, database_url)
        poll_until(lambda: rollout(process.url, rollout_id)["step_index"] >= 1, 30, "the first pause")
        before = rollout(process.url, rollout_id)

        process.kill()
        process.start()
        process.wait_ready()

        poll_until(lambda: rollout(process.url, rollout_id)["completed"], 60, "the rollout to complete")
        done = rollout(process.url, rollout_id)
        assert done["attempt"] == before["attempt"] == 1
        assert moves(process.url, rollout_id) == [0.25, 0.5, "promote"]
        assert done["status"]["revision"] == before["status"]["revision"]
    finally:
        process.stop()
