"""The status page at /ui/: a token signs in once and stays server-side; nothing but the login form without it; it updates live.

Real HTTP against the app under uvicorn (``live_controlplane``); the browser's side is in
``test_ui_browser.py``.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from controlplane.ui.sessions import COOKIE
from tests.controlplane.conftest import ADMIN_HEADERS, SeedVersions
from tests.controlplane.sse_events import events
from weightship.schemas import Role

pytestmark = pytest.mark.timeout(60)


def sign_in(client: httpx.Client, token: str) -> httpx.Response:
    """POST the login form as a browser does."""
    return client.post("/ui/login", data={"token": token}, follow_redirects=False)


def secret(headers: dict[str, str]) -> str:
    return headers["Authorization"].removeprefix("Bearer ")


def test_without_a_session_only_the_login_form_is_served(cp_client: httpx.Client, seed_versions: SeedVersions) -> None:
    seed_versions("llama")
    cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=ADMIN_HEADERS)
    page = cp_client.get("/ui/")
    assert page.status_code == 200
    assert '<form method="post" action="/ui/login"' in page.text
    assert "chat" not in page.text
    assert "llama" not in page.text
    assert cp_client.get("/ui/nodes").status_code == 401
    assert cp_client.get("/ui/events").status_code == 401
    cp_client.cookies.set(COOKIE, "not-a-session", path="/ui")
    forged = cp_client.get("/ui/")
    assert "/ui/login" in forged.text
    assert "chat" not in forged.text
    # the script, styles and chart library are code, not data: served to anyone
    assert cp_client.get("/ui/static/ui.js").status_code == 200
    assert cp_client.get("/ui/static/vendor/uPlot.iife.min.js").status_code == 200


def test_a_read_token_signs_in_once_and_never_leaves_the_server(
    cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]], seed_versions: SeedVersions
) -> None:
    seed_versions("llama")
    cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=ADMIN_HEADERS)
    token = secret(role_headers[Role.read])
    answer = sign_in(cp_client, token)
    assert answer.status_code == 303
    assert answer.headers["location"] == "/ui/"
    cookie = answer.headers["set-cookie"]
    for attribute in ("HttpOnly", "SameSite=strict", "Path=/ui"):
        assert attribute in cookie, cookie
    assert token not in cookie
    assert token not in answer.headers["location"]
    page = cp_client.get("/ui/")
    assert page.status_code == 200
    assert 'data-name="chat"' in page.text
    assert "test-read (read)" in page.text
    assert token not in page.text
    assert page.headers["cache-control"] == "no-store"
    # nothing on the page writes: every form posts to the page's own login or logout
    assert page.text.count("<form") == page.text.count('action="/ui/logout"') + page.text.count('id="node-filter"')


@pytest.mark.parametrize(
    ("which", "status", "says"),
    [("forged", 401, "not valid"), ("empty", 401, "missing"), ("enrolment", 403, "enrolment token")],
)
def test_a_token_that_may_not_read_gets_the_form_again_with_why(
    cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]], which: str, status: int, says: str
) -> None:
    token = {"forged": "ws_forged", "empty": "", "enrolment": secret(role_headers[Role.agent])}[which]
    answer = sign_in(cp_client, token)
    assert answer.status_code == status
    assert says in answer.text
    assert "set-cookie" not in answer.headers
    assert cp_client.get("/ui/nodes").status_code == 401


def test_signing_out_or_revoking_the_token_ends_the_session(
    cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]]
) -> None:
    sign_in(cp_client, secret(role_headers[Role.operator]))
    assert cp_client.get("/ui/nodes").status_code == 200
    cp_client.post("/ui/logout", follow_redirects=False)
    assert cp_client.get("/ui/nodes").status_code == 401

    sign_in(cp_client, secret(role_headers[Role.read]))
    with cp_client.stream("GET", "/ui/events", timeout=10) as stream:
        received = events(stream)
        assert next(received)[0] == "summary"
        revoked = cp_client.delete("/v1/tokens/test-read", headers=ADMIN_HEADERS)
        assert revoked.status_code == 204
        assert next(received)[0] == "logout"
    assert cp_client.get("/ui/nodes").status_code == 401
    assert "/ui/login" in cp_client.get("/ui/").text


def test_the_stream_shows_a_pointer_move_within_a_second(
    cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]], seed_versions: SeedVersions
) -> None:
    digests = seed_versions("llama")
    cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=ADMIN_HEADERS)
    sign_in(cp_client, secret(role_headers[Role.read]))
    with cp_client.stream("GET", "/ui/events", timeout=10) as stream:
        received = events(stream)
        first = json.loads(next(received)[1])
        assert 'data-epoch="0"' in first["html"]["deployments"]
        moved_at = time.monotonic()
        moved = cp_client.put(
            "/v1/deployments/chat/pointer", json={"stable": "v2"}, headers={**ADMIN_HEADERS, "If-Match": '"0"'}
        )
        assert moved.status_code == 200, moved.text
        name, data = next(received)
        assert time.monotonic() - moved_at < 1.0
        assert name == "summary"
        html = json.loads(data)["html"]["deployments"]
        assert 'data-epoch="1"' in html
        assert f'title="{digests["v2"]}">v2<' in html
