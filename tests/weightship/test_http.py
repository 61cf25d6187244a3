"""The HTTP core shared by every client: one error mapping, one retry engine, sync and async.

The mapping is checked as a table over both error-body shapes a server may send (RFC 9457 problem
details and the older ``{"error": {...}}`` body), and the same answers are then sent through each
real client (the CLI's ``Client``, the agent's ``ControlPlaneClient``, ``gpu_loader``'s
``LocalAgent``) over an ``httpx.MockTransport``, the core's test seam.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from agent.controlplane_client import ControlPlaneClient
from gpu_loader.agent_api import LocalAgent
from gpu_loader.errors import AgentUnavailableError
from weightship.backoff import Backoff
from weightship.client import Client
from weightship.errors import (
    AuthError,
    ConflictError,
    DatabaseUnavailable,
    ForbiddenError,
    IntegrityError,
    ManifestError,
    NotFoundError,
    PayloadTooLarge,
    PermanentError,
    PreconditionFailed,
    TemporaryError,
    ValidationError,
    WeightshipError,
)
from weightship.http import AsyncSession, Session
from weightship.problems import LEGACY_CODES, MAX_RETRY_AFTER, error_from_response, retry_after

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[httpx.Request], httpx.Response]
PROBLEM = "application/problem+json"


def problem(status: int, code: str | None, detail: str, **headers: str) -> httpx.Response:
    """An RFC 9457 answer as the control plane sends it (``code`` is our extension)."""
    body: dict[str, object] = {"type": "about:blank", "title": "Some Title", "status": status, "detail": detail}
    if code is not None:
        body["code"] = code
    return httpx.Response(status, json=body, headers={"content-type": PROBLEM, **headers})


def legacy(status: int, code: str, message: str, **headers: str) -> httpx.Response:
    """The older error body, still sent by servers of the previous version."""
    return httpx.Response(status, json={"error": {"code": code, "message": message}}, headers=headers)


# (status, code, message, expected class): every row is sent in both body shapes.
MAPPING = [
    (400, "invalid", "bad name", ValidationError),
    (400, "invalid_manifest", "path '..'", ManifestError),
    (401, "unauthenticated", "no token", AuthError),
    (403, "forbidden", "role agent", ForbiddenError),
    (404, "not_found", "no model 'x'", NotFoundError),
    (409, "conflict", "label taken", ConflictError),
    (412, "precondition_failed", "epoch 5, not 3", PreconditionFailed),
    (413, "too_large", "body over 1 MiB", PayloadTooLarge),
    (422, "integrity", "chunk 3 differs", IntegrityError),
    (422, "invalid_request", "body.x: missing", ValidationError),
    (503, "unavailable", "db busy", TemporaryError),
    (503, "database_unavailable", "db locked", DatabaseUnavailable),
    (418, "no_such_code_yet", "from a newer server", WeightshipError),
]


@pytest.mark.parametrize("shape", [problem, legacy], ids=["problem+json", "legacy"])
@pytest.mark.parametrize(("status", "code", "message", "expected"), MAPPING, ids=[row[1] for row in MAPPING])
def test_both_error_body_shapes_map_to_the_same_error(
    shape: Callable[..., httpx.Response], status: int, code: str, message: str, expected: type[WeightshipError]
) -> None:
    error = error_from_response(shape(status, code, message), "GET http://cp.test/v1/x")
    assert type(error) is expected
    assert error.message == message


def test_problem_details_without_our_code_map_by_status_and_use_the_detail() -> None:
    error = error_from_response(problem(409, None, "label v1 names another version"), "POST /v1/labels")
    assert type(error) is ConflictError
    assert error.message == "label v1 names another version"


@pytest.mark.parametrize(("old", "new"), sorted(LEGACY_CODES.items()))
def test_a_previous_release_s_kebab_case_code_reads_as_today_s_snake_case(old: str, new: str) -> None:
    error = error_from_response(problem(409, old, "rollout r-1 is active"), "POST /v1/deployments/chat/rollouts")
    assert (type(error), error.code, error.message) == (ConflictError, new, "rollout r-1 is active")


def test_problem_details_without_a_detail_fall_back_to_the_title() -> None:
    response = httpx.Response(
        404, json={"type": "about:blank", "title": "Not Found", "status": 404}, headers={"content-type": PROBLEM}
    )
    error = error_from_response(response, "GET /v1/nowhere")
    assert (type(error), error.message) == (NotFoundError, "Not Found")


def test_problem_details_relabelled_as_plain_json_by_a_proxy_still_map() -> None:
    response = httpx.Response(403, json={"status": 403, "code": "forbidden", "detail": "role reader"})
    error = error_from_response(response, "DELETE /v1/tokens/t")
    assert (type(error), error.message) == (ForbiddenError, "role reader")


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b"\xff\xfe", b'{"error": "flat string"}', b"<html>502</html>"])
def test_unreadable_error_bodies_still_give_one_of_our_errors_naming_the_call(body: bytes) -> None:
    error = error_from_response(httpx.Response(500, content=body), "GET http://cp.test/v1/x")
    assert isinstance(error, TemporaryError)
    assert "GET http://cp.test/v1/x answered HTTP 500" in error.message


@pytest.mark.parametrize("shape", [problem, legacy], ids=["problem+json", "legacy"])
def test_retry_after_seconds_become_the_temporary_delay(shape: Callable[..., httpx.Response]) -> None:
    error = error_from_response(shape(503, "unavailable", "busy", **{"Retry-After": "7"}), "GET /v1/x")
    assert isinstance(error, TemporaryError)
    assert error.delay == 7.0


def test_retry_after_is_kept_by_temporary_subclasses() -> None:
    error = error_from_response(problem(503, "database_unavailable", "locked", **{"Retry-After": "2"}), "PUT /x")
    assert isinstance(error, TemporaryError)
    assert error.delay == 2.0
    assert type(error) is DatabaseUnavailable


@pytest.mark.parametrize(
    ("header", "expected"),
    [("7", 7.0), ("0.5", 0.5), ("", 0.0), ("-3", 0.0), ("nan", 0.0), ("soon", 0.0), ("86400", MAX_RETRY_AFTER)],
)
def test_retry_after_values_are_read_and_bounded(header: str, expected: float) -> None:
    assert retry_after(httpx.Response(429, headers={"Retry-After": header} if header else {})) == expected


def test_retry_after_as_an_http_date_counts_from_now() -> None:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    response = httpx.Response(503, headers={"Retry-After": format_datetime(now + timedelta(seconds=12), usegmt=True)})
    assert retry_after(response, now=now.timestamp()) == pytest.approx(12.0)


def test_every_error_class_is_either_temporary_or_permanent() -> None:
    kinds = [ValidationError, ManifestError, PayloadTooLarge, IntegrityError, NotFoundError, ConflictError]
    kinds += [PreconditionFailed, AuthError, ForbiddenError]
    assert all(issubclass(k, PermanentError) and not issubclass(k, TemporaryError) for k in kinds)
    assert not issubclass(TemporaryError, PermanentError)


# --- the retry engine, through the sessions --------------------------------------------------------


def _counting(answers: list[httpx.Response]) -> tuple[Handler, list[str]]:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        return answers.pop(0) if len(answers) > 1 else answers[0]

    return handler, calls


@pytest.mark.parametrize("shape", [problem, legacy], ids=["problem+json", "legacy"])
def test_retries_stop_at_the_first_permanent_error(shape: Callable[..., httpx.Response]) -> None:
    sleeps: list[float] = []
    handler, calls = _counting([shape(503, "unavailable", "busy"), shape(404, "not_found", "gone")])
    session = Session("http://cp.test", transport=httpx.MockTransport(handler), backoff=Backoff(5, sleep=sleeps.append))
    with pytest.raises(NotFoundError, match="gone"):
        session.send("GET", "/v1/x")
    session.close()
    assert len(calls) == 2
    assert len(sleeps) == 1


def test_the_wait_between_retries_honours_retry_after() -> None:
    sleeps: list[float] = []
    handler, calls = _counting([problem(503, "unavailable", "busy", **{"Retry-After": "6"}), httpx.Response(204)])
    session = Session(
        "http://cp.test", transport=httpx.MockTransport(handler), backoff=Backoff(3, base=0.01, sleep=sleeps.append)
    )
    assert session.send("GET", "/v1/x").status_code == 204
    session.close()
    assert sleeps == [6.0]
    assert len(calls) == 2


def test_the_async_session_retries_temporary_errors_on_a_fake_clock() -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    handler, calls = _counting(
        [problem(503, "unavailable", "busy", **{"Retry-After": "3"})] * 2 + [httpx.Response(200)]
    )

    async def run() -> int:
        session = AsyncSession(
            "http://cp.test",
            transport=httpx.MockTransport(handler),
            backoff=Backoff(attempts=4, base=0.01, async_sleep=fake_sleep),
        )
        try:
            return (await session.send("GET", "/v1/x")).status_code
        finally:
            await session.aclose()

    assert asyncio.run(run()) == 200
    assert slept == [3.0, 3.0]
    assert len(calls) == 3


def test_the_async_session_does_not_retry_a_permanent_error() -> None:
    handler, calls = _counting([legacy(409, "conflict", "taken")])

    async def run() -> None:
        session = AsyncSession("http://cp.test", transport=httpx.MockTransport(handler), backoff=Backoff(attempts=5))
        try:
            await session.send("GET", "/v1/x")
        finally:
            await session.aclose()

    with pytest.raises(ConflictError, match="taken"):
        asyncio.run(run())
    assert len(calls) == 1


def test_the_token_reaches_only_the_sessions_own_origin() -> None:
    seen: dict[str, str | None] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[f"{request.url.host}:{request.url.port}"] = request.headers.get("authorization")
        return httpx.Response(204)

    session = Session("http://cp.test:8080", "ws_secret", transport=httpx.MockTransport(handler))
    session.send("GET", "/v1/x")
    session.send("PUT", "http://s3.test/bucket/key?X-Amz-Signature=s", content=b"x")
    session.send("GET", "http://cp.test:9999/elsewhere")  # same host, other port: another origin
    session.close()
    assert seen == {"cp.test:8080": "Bearer ws_secret", "s3.test:None": None, "cp.test:9999": None}


# --- every client, one mapping ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [problem, legacy], ids=["problem+json", "legacy"])
def test_the_cli_client_maps_both_shapes(shape: Callable[..., httpx.Response]) -> None:
    answer = shape(412, "precondition_failed", "deployment 'chat' is at epoch 5, not 3")
    transport = httpx.MockTransport(lambda r: answer)
    with Client("http://cp.test", "t", transport=transport) as client, pytest.raises(PreconditionFailed, match="5"):
        client.set_pointer("chat", "sha256:" + "a" * 64, expected_epoch=3)


@pytest.mark.parametrize("shape", [problem, legacy], ids=["problem+json", "legacy"])
def test_the_agents_control_plane_client_maps_both_shapes_and_never_retries(
    shape: Callable[..., httpx.Response],
) -> None:
    handler, calls = _counting([shape(503, "unavailable", "overloaded", **{"Retry-After": "4"})])

    async def run() -> None:
        client = ControlPlaneClient("http://cp.test", "node-token", transport=httpx.MockTransport(handler))
        try:
            await client.blob_urls(["b" * 64])
        finally:
            await client.aclose()

    with pytest.raises(TemporaryError, match="overloaded") as caught:
        asyncio.run(run())
    assert caught.value.delay == 4.0
    assert calls == ["POST"]  # the daemon's loops own the backoff


def test_the_agents_client_refuses_a_manifest_that_does_not_hash_to_its_digest() -> None:
    async def run() -> None:
        answer = httpx.Response(200, content=b'{"not": "the manifest"}')
        client = ControlPlaneClient("http://cp.test", "t", transport=httpx.MockTransport(lambda r: answer))
        try:
            await client.manifest("llama", "sha256:" + "c" * 64)
        finally:
            await client.aclose()

    with pytest.raises(IntegrityError, match="hashes to sha256:"):
        asyncio.run(run())


@pytest.mark.parametrize("shape", [problem, legacy], ids=["problem+json", "legacy"])
def test_the_model_servers_agent_client_maps_both_shapes(shape: Callable[..., httpx.Response]) -> None:
    async def run() -> None:
        agent = LocalAgent(
            "http://agent.test", transport=httpx.MockTransport(lambda r: shape(404, "not_found", "no chat"))
        )
        try:
            await agent.deployment("chat")
        finally:
            await agent.aclose()

    with pytest.raises(NotFoundError, match="no chat"):
        asyncio.run(run())


def test_an_unreachable_agent_is_agent_unavailable_naming_the_address() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    async def run() -> None:
        agent = LocalAgent("http://127.0.0.1:1", transport=httpx.MockTransport(refuse))
        try:
            await agent.wait("chat", 0, 1.0)
        finally:
            await agent.aclose()

    with pytest.raises(AgentUnavailableError, match=r"agent at http://127\.0\.0\.1:1") as caught:
        asyncio.run(run())
    assert caught.value.delay >= 1.0
