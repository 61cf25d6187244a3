"""Open status pages share one reader: a change is one summary read however many pages watch, and none when nobody does."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from controlplane.ui.routes import UiState
from tests.controlplane.conftest import ADMIN_HEADERS, ADMIN_TOKEN, LiveControlPlane, SeedVersions
from tests.controlplane.sse_events import events
from weightship.testing import eventually

pytestmark = pytest.mark.timeout(60)

PAGES = 20


def test_twenty_open_pages_cost_one_read_per_change_and_none_once_closed(
    live_controlplane: LiveControlPlane, cp_client: httpx.Client, seed_versions: SeedVersions
) -> None:
    seed_versions("llama")
    cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=ADMIN_HEADERS)
    cp_client.post("/ui/login", data={"token": ADMIN_TOKEN})
    with contextlib.ExitStack() as pages:
        streams = [events(pages.enter_context(cp_client.stream("GET", "/ui/events", timeout=10))) for _ in range(PAGES)]
        for stream in streams:
            assert next(stream)[0] == "summary"
        ui = live_controlplane.app.state.ui
        assert isinstance(ui, UiState)
        assert ui.hub.watchers == PAGES
        before = ui.hub.reads
        moved = cp_client.put(
            "/v1/deployments/chat/pointer", json={"stable": "v1"}, headers={**ADMIN_HEADERS, "If-Match": '"0"'}
        )
        assert moved.status_code == 200
        for stream in streams:
            name, data = next(stream)
            assert name == "summary"
            assert 'data-epoch="1"' in json.loads(data)["html"]["deployments"]
        assert ui.hub.reads == before + 1, "every page got the one summary read after the change"
    eventually(lambda: ui.hub.watchers == 0, 10, "the closed pages' streams to end")
    closed = ui.hub.reads
    cp_client.put("/v1/deployments/chat/pointer", json={"stable": "v2"}, headers={**ADMIN_HEADERS, "If-Match": '"1"'})
    cp_client.put("/v1/deployments/chat/pointer", json={"stable": "v3"}, headers={**ADMIN_HEADERS, "If-Match": '"2"'})
    assert ui.hub.reads == closed, "nobody watches: changes cost the page nothing"
