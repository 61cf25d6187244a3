"""Pointer compare-and-swap under real concurrency: threads against a real uvicorn server.

Each request runs in the server's thread pool on its own database connection, so SQLite and
PostgreSQL see genuinely concurrent transactions.
"""

from __future__ import annotations

import itertools
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from controlplane.persistence.rows import DeploymentRow, PointerEventRow
from controlplane.state import AppState
from weightship.schemas import Role

pytestmark = pytest.mark.timeout(120)

RACERS = 12
ROUNDS = 4


@pytest.fixture
def chat(
    cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]], seed_versions: Any
) -> tuple[str, dict[str, str], dict[str, str]]:
    """A deployment ``chat`` of model ``llama`` (v1..v3 ready): (name, operator headers, digests)."""
    digests = seed_versions("llama")
    operator = role_headers[Role.operator]
    response = cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=operator)
    assert response.status_code == 201
    return "chat", operator, digests


def _race(url: str, headers: dict[str, str], name: str, epoch: int, refs: list[str]) -> list[httpx.Response]:
    """``len(refs)`` PUTs with the same ``If-Match``, released together by a barrier."""
    barrier = threading.Barrier(len(refs))

    def one(ref: str) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=60) as client:
            client.get("/healthz")  # connect before the barrier, so the PUTs leave together
            barrier.wait(timeout=30)
            return client.put(
                f"/v1/deployments/{name}/pointer",
                json={"stable": ref, "reason": f"racer {ref}"},
                headers={**headers, "If-Match": f'"{epoch}"'},
            )

    with ThreadPoolExecutor(max_workers=len(refs)) as pool:
        return list(pool.map(one, refs))


def test_concurrent_updates_with_the_same_if_match_have_exactly_one_winner(
    live_controlplane: Any, cp_state: AppState, chat: tuple[str, dict[str, str], dict[str, str]]
) -> None:
    name, operator, digests = chat
    labels = sorted(digests)
    for round_ in range(ROUNDS):
        refs = [labels[(round_ + i) % len(labels)] for i in range(RACERS)]
        responses = _race(live_controlplane.url, operator, name, round_, refs)
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200] + [412] * (RACERS - 1), [r.text for r in responses if r.status_code not in (200, 412)]
        (winner,) = [r.json() for r in responses if r.status_code == 200]
        assert winner["epoch"] == round_ + 1
        with cp_state.sessions() as session:
            row = session.get(DeploymentRow, name)
            assert row is not None
            assert (row.epoch, row.stable) == (round_ + 1, winner["stable"])
            events = session.query(PointerEventRow).filter_by(deployment=name, epoch=round_ + 1).all()
            assert [e.to_stable for e in events] == [winner["stable"]]


def test_read_modify_write_clients_form_one_unbroken_chain_of_epochs(
    live_controlplane: Any, chat: tuple[str, dict[str, str], dict[str, str]]
) -> None:
    """A linearizability check in miniature: every committed change saw the one before it."""
    name, operator, digests = chat
    workers, attempts = 6, 8
    labels = sorted(digests)

    def client_loop(seed: int) -> list[tuple[int, int | None]]:
        rng = random.Random(seed)
        outcomes: list[tuple[int, int | None]] = []
        with httpx.Client(base_url=live_controlplane.url, timeout=60) as client:
            for _ in range(attempts):
                current = client.get(f"/v1/deployments/{name}", headers=operator)
                epoch = int(current.headers["etag"].strip('"'))
                response = client.put(
                    f"/v1/deployments/{name}/pointer",
                    json={"stable": rng.choice(labels)},
                    headers={**operator, "If-Match": f'"{epoch}"'},
                )
                outcomes.append(
                    (response.status_code, response.json()["epoch"] if response.status_code == 200 else None)
                )
        return outcomes

    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = list(itertools.chain.from_iterable(pool.map(client_loop, range(workers))))

    assert {status for status, _ in outcomes} <= {200, 412}
    won = sorted(epoch for status, epoch in outcomes if status == 200 and epoch is not None)
    assert won == list(range(1, len(won) + 1)), "every success took the next epoch, none twice"
    with httpx.Client(base_url=live_controlplane.url, timeout=60) as client:
        final = client.get(f"/v1/deployments/{name}", headers=operator).json()
        history = client.get(f"/v1/deployments/{name}/history", params={"limit": 1000}, headers=operator).json()
    assert final["epoch"] == len(won)
    chain = history[::-1]
    assert [e["epoch"] for e in chain] == won
    assert chain[0]["from_stable"] is None
    for before, after in itertools.pairwise(chain):
        assert after["from_stable"] == before["to_stable"], "a change was computed from a stale read"
    assert chain[-1]["to_stable"] == final["stable"]
