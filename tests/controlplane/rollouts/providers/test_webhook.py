"""The webhook provider against a real local HTTP server whose answers each test scripts."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from aiohttp import web

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.analysis import is_no_data
from controlplane.rollouts.providers import MeasurementError, ProviderRegistry, RolloutContext, WebhookProvider
from controlplane.rollouts.providers.endpoint import MAX_ANSWER_BYTES
from tests.controlplane.rollouts.providers.conftest import StubServer
from weightship.errors import TemporaryError

pytestmark = pytest.mark.timeout(60)

CONTEXT = RolloutContext("rollout-7", "chat", "sha256:" + "c" * 64, "sha256:" + "s" * 64)


def action(settings: dict[str, Any], index: int = 0) -> MeasureMetric:
    return MeasureMetric("run-1", "golden-check", index, "webhook", settings)


def answering(body: bytes | str | object, status: int = 200, content_type: str = "application/json") -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        raw = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else json.dumps(body).encode()
        return web.Response(body=raw, status=status, content_type=content_type)

    return handler


async def measure(stub: StubServer, environ: dict[str, str] | None = None, **settings: Any) -> object:
    provider = WebhookProvider(environ=environ)
    try:
        return await provider.measure(action({"url": stub.url + "/judge", **settings}), CONTEXT)
    finally:
        await provider.aclose()


async def test_success_posts_the_context_and_selects_the_value(stub: StubServer) -> None:
    stub.handler = answering({"result": {"errorRate": 0.004, "samples": [1, 2, 3]}})
    value = await measure(
        stub,
        {"HOOK_TOKEN": "Bearer t0k"},
        jsonPath="$.result.errorRate",
        headers={"Authorization": {"fromEnv": "HOOK_TOKEN"}},
    )
    assert value == 0.004
    (received,) = stub.received
    assert (received.method, received.path) == ("POST", "/judge")
    assert received.headers["Content-Type"] == "application/json"
    assert received.headers["Authorization"] == "Bearer t0k"
    assert json.loads(received.body) == {
        "rollout": "rollout-7",
        "deployment": "chat",
        "canary": CONTEXT.canary,
        "stable": CONTEXT.stable,
        "metric": "golden-check",
        "run_id": "run-1",
        "index": 0,
    }


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("$", {"result": {"errorRate": 0.004, "samples": [1, 2, 3]}, "ok": True}),
        ("$.result.samples", [1, 2, 3]),
        ("$.result.samples[-1]", 3),
        ("$['result']['errorRate']", 0.004),
        ("$.ok", True),
    ],
)
async def test_selector_picks_the_value(stub: StubServer, path: str, expected: object) -> None:
    stub.handler = answering({"result": {"errorRate": 0.004, "samples": [1, 2, 3]}, "ok": True})
    assert await measure(stub, jsonPath=path) == expected


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"result": {}}, "$.result.errorRate"),  # missing field
        ({"result": {"errorRate": None}}, "$.result.errorRate"),  # null
        ({"result": [1]}, "$.result[3]"),  # index out of range
        ({"result": [1]}, "$.result.errorRate"),  # a key asked of a list
        ({"result": []}, "$.result"),  # empty list
        ("NaN", "$"),  # JSON's NaN extension
    ],
)
async def test_missing_or_empty_value_is_no_data(stub: StubServer, body: object, path: str) -> None:
    stub.handler = answering(body)
    assert is_no_data(await measure(stub, jsonPath=path))


@pytest.mark.parametrize(
    ("status", "error", "match"),
    [
        (500, TemporaryError, "HTTP 500: boom"),
        (503, TemporaryError, "HTTP 503"),
        (429, TemporaryError, "HTTP 429"),
        (404, MeasurementError, "HTTP 404: boom"),
        (401, MeasurementError, "HTTP 401"),
    ],
)
async def test_non_2xx_is_an_error_temporary_or_not(
    stub: StubServer, status: int, error: type[Exception], match: str
) -> None:
    stub.handler = answering("boom", status=status, content_type="text/plain")
    with pytest.raises(error, match=match):
        await measure(stub)


async def test_redirect_is_not_followed(stub: StubServer) -> None:
    async def redirect(request: web.Request) -> web.StreamResponse:
        if request.path == "/judge":
            raise web.HTTPFound("/elsewhere")
        return web.json_response(1)

    stub.handler = redirect
    with pytest.raises(MeasurementError, match=r"HTTP 302.*redirects are not followed"):
        await measure(stub)
    assert [r.path for r in stub.received] == ["/judge"]


async def test_hook_that_never_answers_times_out_as_temporary(stub: StubServer) -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        await stub.release.wait()
        return web.json_response(1)

    stub.handler = hang
    started = time.monotonic()
    with pytest.raises(TemporaryError, match=r"did not answer within 0.3s"):
        await measure(stub, timeout="300ms")
    assert time.monotonic() - started < 3


async def test_trickling_answer_is_cut_at_the_whole_exchange_deadline(stub: StubServer) -> None:
    # Each byte arrives well within a per-read timeout; only a deadline over the whole answer stops it.
    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        while not stub.release.is_set():
            await response.write(b" ")
            await asyncio.sleep(0.05)  # ok-sleep: the slow server is the behaviour under test
        return response

    stub.handler = trickle
    started = time.monotonic()
    with pytest.raises(TemporaryError, match=r"did not answer within 0.5s"):
        await measure(stub, timeout="500ms")
    assert time.monotonic() - started < 3


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"<html>not json</html>", "not JSON: '<html>not json</html>'"),
        (b"", "not JSON"),
        (b'{"a": 1', "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),  # nested past the parser's recursion limit
    ],
)
async def test_malformed_json_is_a_permanent_error(stub: StubServer, body: bytes, match: str) -> None:
    stub.handler = answering(body)
    with pytest.raises(MeasurementError, match=match):
        await measure(stub)


async def test_oversized_answer_is_refused(stub: StubServer) -> None:
    stub.handler = answering(b"[" + b"1," * (MAX_ANSWER_BYTES // 2) + b"1]")
    with pytest.raises(MeasurementError, match="more than 4194304 bytes"):
        await measure(stub)


async def test_missing_secret_is_an_error_naming_the_variable_and_nothing_is_sent(stub: StubServer) -> None:
    with pytest.raises(MeasurementError, match="HOOK_TOKEN") as caught:
        await measure(stub, {}, headers={"Authorization": {"fromEnv": "HOOK_TOKEN"}})
    assert "Bearer" not in caught.value.message
    assert stub.received == []


async def test_registry_turns_failures_into_error_results_and_values_into_values(stub: StubServer) -> None:
    stub.handler = answering({"value": 0.5})
    stamp = datetime(2026, 12, 1, tzinfo=UTC)
    async with ProviderRegistry.default(clock=lambda: stamp) as providers:
        good = await providers.measure(action({"url": stub.url, "jsonPath": "$.value"}, index=3), CONTEXT)
        stub.handler = answering("down", status=502)
        failed = await providers.measure(action({"url": stub.url}, index=4), CONTEXT)
        unknown = await providers.measure(MeasureMetric("run-1", "m", 0, "builtin", {}), CONTEXT)
    assert (good.run_id, good.metric, good.index, good.value, good.error, good.taken_at) == (
        "run-1", "golden-check", 3, 0.5, None, stamp,
    )  # fmt: skip
    assert failed.value is None
    assert failed.error is not None
    assert "HTTP 502: down" in failed.error
    assert unknown.error is not None
    assert "no 'builtin' provider" in unknown.error
