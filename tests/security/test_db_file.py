"""A SQLite database file deleted or replaced under a running control plane is noticed at once.

SQLite keeps writing to the file it opened even after it was unlinked, so before the guard the
control plane stayed "ready" and acknowledged writes that vanished on the next start (every epoch
back to 0). Now ``/readyz`` fails and every write is refused with 503, so nothing acknowledged
can be lost; restoring the file properly (stop, restore, start) brings it back. A real
``python -m controlplane serve`` process.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agent.controlplane_process import ADMIN_TOKEN, ControlPlaneProcess
from tests.controlplane.conftest import problem
from weightship.testing import eventually as poll_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def controlplane(tmp_path: Path) -> Iterator[ControlPlaneProcess]:
    """A control plane on SQLite, ready."""
    cp = ControlPlaneProcess(tmp_path / "cp")
    cp.start()
    try:
        cp.wait_ready()
        yield cp
    finally:
        cp.stop()


def _mint(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/tokens", json={"name": name, "role": "agent"}, headers=ADMIN)


def _token_names(http: httpx.Client) -> set[str]:
    response = http.get("/v1/tokens", headers=ADMIN)
    assert response.status_code == 200, response.text
    return {token["name"] for token in response.json()}


def _assert_refuses(http: httpx.Client) -> list[str]:
    """``/readyz`` fails and writes are refused with the database problem; returns what was acknowledged."""
    ready = http.get("/readyz")
    assert ready.status_code == 503, ready.text
    assert problem(ready)["code"] == "database_unavailable"
    acknowledged = []
    for attempt in range(5):
        response = _mint(http, f"after-{attempt}")
        if response.is_success:
            acknowledged.append(f"after-{attempt}")
        else:
            assert response.status_code == 503, response.text
            assert problem(response)["code"] == "database_unavailable"
            assert "restore" in problem(response)["detail"]
    return acknowledged


def test_a_deleted_database_fails_readyz_and_acknowledges_no_write(controlplane: ControlPlaneProcess) -> None:
    with httpx.Client(base_url=controlplane.url, timeout=30) as http:
        assert _mint(http, "before").status_code == 201
        controlplane.database.unlink()

        assert _assert_refuses(http) == [], "writes were acknowledged into a deleted database"
        assert not controlplane.database.exists(), "the control plane created a new, empty database in its place"


def test_a_replaced_database_is_refused_until_restored_and_restarted(
    controlplane: ControlPlaneProcess, tmp_path: Path
) -> None:
    backup = tmp_path / "backup.db"
    with httpx.Client(base_url=controlplane.url, timeout=30) as http:
        assert _mint(http, "in-backup").status_code == 201
        controlplane.backup(backup)
        assert _mint(http, "after-backup").status_code == 201
        # Copied over the live file while it runs: another inode at the same path.
        staged = controlplane.database.with_suffix(".staged")
        shutil.copyfile(backup, staged)
        os.replace(staged, controlplane.database)

        assert _assert_refuses(http) == [], "writes were acknowledged into a database that is no longer the file"

    controlplane.stop()
    controlplane.restore(backup)
    controlplane.start()
    controlplane.wait_ready()
    with httpx.Client(base_url=controlplane.url, timeout=30) as http:
        poll_until(lambda: http.get("/readyz").status_code == 200, 30, "readyz after the restore")
        assert _token_names(http) >= {"in-backup"}
        assert _mint(http, "after-restore").status_code == 201
