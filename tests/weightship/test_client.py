"""The REST client: request shapes, where the token goes, retries, and errors mapped to ours.

Every test routes the client through an ``httpx.MockTransport`` (the client's test seam), so
these check exactly what goes on the wire; the end-to-end tests (``test_cli_e2e.py``) check
the same calls against the real control plane.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

import weightship.backoff
import weightship.client
import weightship.http
import weightship.problems
import weightship.publishing
from weightship.backoff import Backoff
from weightship.client import Client
from weightship.errors import (
    AuthError,
    ConflictError,
    DiskFullError,
    ForbiddenError,
    IntegrityError,
    ManifestError,
    NotFoundError,
    PreconditionFailed,
    PreconditionRequired,
    StoreError,
    TemporaryError,
    ValidationError,
    WeightshipError,
)
from weightship.problems import error_from_response
from weightship.schemas import Deployment, NodeHeartbeat, PartUpload, Role

pytestmark = pytest.mark.timeout(30)

BASE = "http://cp.test:8080/api"
TOKEN = "ws_secret"
DIGEST = "sha256:" + "a" * 64
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
Handler = Callable[[httpx.Request], httpx.Response]


def _client(handler: Handler, token: str | None = TOKEN, sleeps: list[float] | None = None) -> Client:
    record = sleeps if sleeps is not None else []
    return Client(
        BASE,
        token,
        transport=httpx.MockTransport(handler),
        backoff=Backoff(attempts=3, sleep=record.append),
    )


def _deployment(epoch: int = 3) -> dict[str, Any]:
    return Deployment(
        name="chat",
        model="llama",
        stable=DIGEST,
        previous_stable=None,
        canary=None,
        canary_share=0.0,
        epoch=epoch,
        updated_at=NOW,
    ).model_dump(mode="json")


def _error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


@pytest.mark.parametrize(
    ("module", "names"),
    [
        (weightship.client, {"DEFAULT_URL", "Backoff", "Client"}),
        (weightship.backoff, {"Backoff", "DelaySequence", "capped_exponential", "is_temporary"}),
        (
            weightship.publishing,
            {"PublishProgress", "PublishResult", "SilentProgress", "UploadAPI", "directory_size", "publish_directory"},
        ),
        (
            weightship.problems,
            {
                "LEGACY_CODES",
                "MAX_RETRY_AFTER",
                "PROBLEM_MEDIA_TYPE",
                "error_from_response",
                "error_problem",
                "problem_document",
                "retry_after",
                "status_title",
            },
        ),
        (
            weightship.http,
            {
                "VERSION",
                "AsyncSession",
                "Params",
                "RequestOptions",
                "Session",
                "SessionOptions",
                "parse",
                "parse_list",
                "segment",
            },
        ),
    ],
    ids=["client", "backoff", "publishing", "problems", "http"],
)
def test_public_surface_is_exactly_all(module: Any, names: set[str]) -> None:
    assert set(module.__all__) == names
    for name in names:
        assert getattr(module, name) is not None


ERROR_CASES = [
    pytest.param(_error(400, "invalid", "bad name"), ValidationError, "bad name", id="400-invalid"),
    pytest.param(_error(400, "invalid_manifest", "path '..'"), ManifestError, "path '..'", id="400-manifest"),
    pytest.param(_error(401, "unauthenticated", "no token"), AuthError, "no token", id="401"),
    pytest.param(_error(403, "forbidden", "role agent"), ForbiddenError, "role agent", id="403"),
    pytest.param(_error(404, "not_found", "no model"), NotFoundError, "no model", id="404"),
    pytest.param(_error(409, "conflict", "label taken"), ConflictError, "label taken", id="409"),
    pytest.param(_error(412, "precondition_failed", "epoch 4"), PreconditionFailed, "epoch 4", id="412"),
    pytest.param(_error(422, "integrity", "chunk 3 differs"), IntegrityError, "chunk 3 differs", id="422-integrity"),
    pytest.param(_error(422, "invalid_request", "body.x: missing"), ValidationError, "body.x", id="422-request"),
    pytest.param(_error(428, "precondition_required", "send If-Match"), PreconditionRequired, "If-Match", id="428"),
    pytest.param(_error(502, "store", "S3 said no"), StoreError, "S3 said no", id="502"),
    pytest.param(_error(503, "unavailable", "db busy"), TemporaryError, "db busy", id="503"),
    pytest.param(_error(507, "disk_full", "no room"), DiskFullError, "no room", id="507"),
    pytest.param(httpx.Response(500, text="Internal Server Error"), TemporaryError, "HTTP 500", id="500-text"),
    pytest.param(httpx.Response(418, text="teapot"), WeightshipError, "HTTP 418: teapot", id="418-unknown"),
    pytest.param(httpx.Response(404, json={"detail": "Not Found"}), NotFoundError, "no such route", id="404-no-route"),
    pytest.param(
        httpx.Response(
            400, text="<?xml version='1.0'?><Error><Code>BadDigest</Code><Message>sha mismatch</Message></Error>"
        ),
        IntegrityError,
        "BadDigest: sha mismatch",
        id="s3-bad-digest",
    ),
    pytest.param(
        httpx.Response(403, text="<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"),
        ForbiddenError,
        "Request has expired",
        id="s3-expired",
    ),
]


@pytest.mark.parametrize(("response", "expected", "text"), ERROR_CASES)
def test_error_answers_map_to_our_exception_tree(
    response: httpx.Response, expected: type[WeightshipError], text: str
) -> None:
    error = error_from_response(response, "GET http://cp.test/v1/x")
    assert type(error) is expected
    assert text in error.message


def test_retry_after_header_becomes_the_temporary_delay() -> None:
    response = httpx.Response(
        503, headers={"Retry-After": "7"}, json={"error": {"code": "unavailable", "message": "x"}}
    )
    error = error_from_response(response, "GET /v1/x")
    assert isinstance(error, TemporaryError)
    assert error.delay == 7.0


def test_token_goes_to_the_api_origin_but_never_to_presigned_urls() -> None:
    seen: dict[str, str | None] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[str(request.url)] = request.headers.get("authorization")
        return httpx.Response(204)

    part = PartUpload(number=1, offset=0, length=3, sha256="b" * 64, url="http://s3.test/bucket/key?X-Amz-Signature=s")
    relative = part.model_copy(update={"url": "/v1/uploads/u1/blobs/" + "b" * 64 + "/parts/1"})
    with _client(handler) as client:
        client.upload_part(part, b"abc")
        client.upload_part(relative, b"abc")
    assert seen["http://s3.test/bucket/key?X-Amz-Signature=s"] is None
    assert seen[f"{BASE}/v1/uploads/u1/blobs/{'b' * 64}/parts/1"] == "Bearer ws_secret"


def test_part_upload_sends_the_headers_the_session_asked_for() -> None:
    captured: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        captured.append(request)
        return httpx.Response(200)

    part = PartUpload(
        number=2,
        offset=4,
        length=3,
        sha256="c" * 64,
        url="http://s3.test/k?partNumber=2",
        headers={"x-amz-checksum-sha256": "q83vEjRWeJA="},
    )
    with _client(handler) as client:
        client.upload_part(part, b"xyz")
    (request,) = captured
    assert request.method == "PUT"
    assert request.content == b"xyz"
    assert request.headers["x-amz-checksum-sha256"] == "q83vEjRWeJA="


def test_set_pointer_is_a_compare_and_swap_on_the_epoch() -> None:
    captured: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        captured.append(request)
        return httpx.Response(200, json=_deployment(epoch=4), headers={"ETag": '"4"'})

    with _client(handler) as client:
        result = client.set_pointer("chat", "v2", expected_epoch=3, canary="v3", canary_share=0.25, reason="try v3")
    (request,) = captured
    assert (request.method, request.url.path) == ("PUT", "/api/v1/deployments/chat/pointer")
    assert request.headers["if-match"] == '"3"'
    assert json.loads(request.content) == {"stable": "v2", "canary": "v3", "canary_share": 0.25, "reason": "try v3"}
    assert result.epoch == 4


def test_rollback_sends_if_match_only_when_an_epoch_is_expected() -> None:
    captured: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        captured.append(request)
        return httpx.Response(200, json=_deployment(epoch=5))

    with _client(handler) as client:
        client.rollback("chat", reason="p99")
        client.rollback("chat", to="v1", expected_epoch=5)
    first, second = captured
    assert "if-match" not in first.headers
    assert json.loads(first.content) == {"to": None, "reason": "p99"}
    assert second.headers["if-match"] == '"5"'
    assert json.loads(second.content)["to"] == "v1"


def test_a_stale_pointer_update_raises_precondition_failed_without_retrying() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return _error(412, "precondition_failed", "deployment 'chat' is at epoch 5, not 3")

    with _client(handler) as client, pytest.raises(PreconditionFailed, match="epoch 5, not 3"):
        client.set_pointer("chat", "v2", expected_epoch=3)
    assert len(calls) == 1


def test_reads_are_retried_with_backoff_on_temporary_failures() -> None:
    answers = [_error(503, "unavailable", "busy"), httpx.Response(502, text="bad gateway"), None]
    sleeps: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, httpx.Response) and answer.status_code == 502:
            raise httpx.ConnectError("connection reset", request=request)
        return answer or httpx.Response(200, json=_deployment())

    with _client(handler, sleeps=sleeps) as client:
        assert client.get_deployment("chat").epoch == 3
    assert len(sleeps) == 2
    assert all(0 < s <= 8.0 for s in sleeps)


def test_writes_are_not_retried() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return _error(503, "unavailable", "busy")

    with _client(handler) as client, pytest.raises(TemporaryError):
        client.commit_upload("u1")
    assert calls == ["/api/v1/uploads/u1/commit"]


def test_reads_give_up_after_the_last_attempt() -> None:
    sleeps: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        return _error(503, "unavailable", "still busy")

    with _client(handler, sleeps=sleeps) as client, pytest.raises(TemporaryError, match="still busy"):
        client.list_models()
    assert len(sleeps) == 2  # three attempts


def test_an_unreachable_control_plane_says_which_url_and_what_to_check() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    with _client(handler) as client, pytest.raises(TemporaryError) as caught:
        client.list_models()
    message = caught.value.message
    assert "cp.test:8080" in message
    assert "WEIGHTSHIP_URL" in message


def test_a_timeout_is_a_temporary_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    with _client(handler) as client, pytest.raises(TemporaryError, match="timed out"):
        client.list_nodes()


def test_an_answer_that_breaks_the_schema_names_a_version_mismatch() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"name": "chat"})

    with _client(handler) as client, pytest.raises(WeightshipError, match="different versions"):
        client.get_deployment("chat")


def test_names_are_escaped_as_single_path_segments() -> None:
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.raw_path.decode())
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "nope"}})

    with _client(handler) as client, pytest.raises(NotFoundError):
        client.get_version("llama", "../../tokens")
    assert paths == ["/api/v1/models/llama/versions/..%2F..%2Ftokens"]


def test_calls_without_a_token_send_no_authorization() -> None:
    headers: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("authorization"))
        return httpx.Response(200, json=[])

    with _client(handler, token=None) as client:
        assert client.list_models() == []
    assert headers == [None]


ROUTES = [
    pytest.param(lambda c: c.list_models(), "GET", "/v1/models", [], id="models"),
    pytest.param(lambda c: c.list_versions("llama"), "GET", "/v1/models/llama/versions", [], id="versions"),
    pytest.param(lambda c: c.list_deployments(), "GET", "/v1/deployments", [], id="deployments"),
    pytest.param(lambda c: c.history("chat"), "GET", "/v1/deployments/chat/history", [], id="history"),
    pytest.param(lambda c: c.list_nodes("chat"), "GET", "/v1/nodes", [], id="nodes"),
    pytest.param(lambda c: c.list_tokens(), "GET", "/v1/tokens", [], id="tokens"),
    pytest.param(lambda c: c.revoke_token("t1"), "DELETE", "/v1/tokens/t1", None, id="revoke"),
    pytest.param(lambda c: c.abort_upload("u1"), "DELETE", "/v1/uploads/u1", None, id="abort"),
    pytest.param(lambda c: c.heartbeat("n1", NodeHeartbeat()), "POST", "/v1/nodes/n1/heartbeat", None, id="heartbeat"),
    pytest.param(
        lambda c: c.get_manifest("llama", "v1"), "GET", "/v1/models/llama/versions/v1/manifest", None, id="manifest"
    ),
]


@pytest.mark.parametrize(("call", "method", "path", "answer"), ROUTES)
def test_each_route_is_called_with_its_method_and_path(call: Any, method: str, path: str, answer: Any) -> None:
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        return httpx.Response(204) if answer is None else httpx.Response(200, json=answer)

    with _client(handler) as client:
        call(client)
    assert seen == [(method, "/api" + path)]


def test_desired_state_long_polls_with_after_and_wait() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"node_id": "n1", "revision": "r2", "deployments": []})

    with _client(handler) as client:
        state = client.desired_state("n1", after="r1", wait=20)
    assert state.revision == "r2"
    assert dict(seen[0].url.params) == {"wait": "20", "after": "r1"}


def test_create_token_sends_the_role() -> None:
    bodies: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(201, json={"id": "t1", "name": "ci", "role": "publisher", "token": "ws_x"})

    with _client(handler) as client:
        created = client.create_token("ci", "publisher")
    assert bodies == [{"name": "ci", "role": "publisher", "deployments": None, "node_role": None}]
    assert created.role is Role.publisher
