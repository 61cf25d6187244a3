"""The status page with 5,000 nodes and 50 versions: summarised, bounded in size, the nodes paged on the server."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

import httpx
import pytest

from controlplane.persistence.rows import DeploymentRow, NodeRow, PointerEventRow
from controlplane.state import AppState
from tests.controlplane.conftest import ADMIN_TOKEN, SeedVersions

pytestmark = pytest.mark.timeout(120)

NODES = 5000
VERSIONS = 50
STUCK_EVERY = 50


def seed_fleet(state: AppState, seed_versions: SeedVersions) -> dict[str, str]:
    """50 versions, one deployment that moved through all of them, 5,000 nodes; every 50th stuck on a corrupt chunk."""
    digests = seed_versions("llama", tuple(f"v{i}" for i in range(VERSIONS)))
    ordered = [digests[f"v{i}"] for i in range(VERSIONS)]
    stable, previous = ordered[-1], ordered[-2]
    now = datetime.now(UTC)
    with state.sessions() as session:
        session.add(DeploymentRow(name="chat", model="llama", stable=stable, previous_stable=previous, canary=None, canary_share=0.0, epoch=VERSIONS, updated_at=now))
        session.flush()
        for i, digest in enumerate(ordered):
            session.add(PointerEventRow(deployment="chat", epoch=i + 1, action="set", actor="test", reason="", from_stable=ordered[i - 1] if i else None, to_stable=digest, from_canary=None, to_canary=None, canary_share=0.0, at=now))
        for n in range(NODES):
            stuck = n % STUCK_EVERY == 0
            item: dict[str, object] = {"digest": stable, "state": "fetching" if stuck else "ready", "bytes_total": 1000, "bytes_present": 300 if stuck else 1000}
            if stuck:
                item["problem"] = {"reason": "corrupt_origin", "message": "chunk 7 never matched", "since": now.isoformat(), "attempts": 2, "blob": "ab" * 32, "file": "model.safetensors", "chunk_index": 7}
            report = {"inventory": [item], "deployments": [{"name": "chat", "digest": previous if stuck else stable, "epoch": VERSIONS}]}
            labels = {"region": f"r{n % 4}", "cluster": f"c{n % 40}"}
            session.add(NodeRow(id=f"n{n:05d}", name=f"gpu-{n:05d}", labels=labels, role="node", deployments=["chat"], registered_at=now, last_seen=now, report=report))
        session.commit()
    return digests


# what is measured is rendering and paging, the same on either database: SQLite keeps the seeding quick
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_five_thousand_nodes_and_fifty_versions_render_summarised_and_paged(
    cp_client: httpx.Client, cp_state: AppState, seed_versions: SeedVersions
) -> None:
    seed_fleet(cp_state, seed_versions)
    cp_client.post("/ui/login", data={"token": ADMIN_TOKEN})
    started = time.monotonic()
    page = cp_client.get("/ui/")
    took = time.monotonic() - started
    assert page.status_code == 200
    # about 0.5 s on an idle 2-core machine (bench/ui_idle.py); the bound only catches a stall
    assert took < 30, f"the page took {took:.1f} s with {NODES} nodes"
    # bounded whatever the fleet: a summary per version and place, 50 problem nodes, one page of nodes
    assert len(page.content) < 256 * 1024, len(page.content)
    assert "stable <span" in page.text
    stuck = NODES // STUCK_EVERY
    assert f"{NODES - stuck} ready · {stuck} fetching · 0 failed · {NODES - stuck} serving" in page.text
    assert f"and {stuck - 50} more" in page.text
    assert page.text.count('<li class="event') == 20  # the newest of the 50 pointer moves
    assert "page 1 of 100 · 5000 nodes" in page.text

    last = cp_client.get("/ui/nodes", params={"page": 100})
    assert "page 100 of 100" in last.text
    assert len(re.findall(r'<b class="node">', last.text)) == 50
    assert "gpu-04999" in last.text
    problems = cp_client.get("/ui/nodes", params={"filter": "problems", "page": 2})
    assert f"page 2 of 2 · {stuck} nodes" in problems.text
    assert "corrupt_origin: chunk 7 never matched" in problems.text
    found = cp_client.get("/ui/nodes", params={"q": "gpu-0123"})
    assert "10 nodes" in found.text
