"""The ``weightship`` CLI in-process: options, request flows, output modes and error handling.

Requests go through an ``httpx.MockTransport`` injected with ``CliSeams`` (the CLI's test seam);
``test_cli_e2e.py`` runs the same commands against the real control plane.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner, Result

import weightship.cli
from weightship.cli import CliSeams, app
from weightship.cli.commands import _parse_size
from weightship.cli.display import nodes_table
from weightship.digests import format_digest, sha256_hex
from weightship.manifest import build_manifest
from weightship.schemas import (
    Deployment,
    DeploymentState,
    DeploymentStatus,
    NodeCounters,
    NodeInfo,
    NodeLabels,
    PointerEvent,
    VersionInfo,
    VersionInventory,
    VersionState,
    VersionStatus,
)

pytestmark = pytest.mark.timeout(30)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
Handler = Callable[[httpx.Request], httpx.Response]


def invoke(handler: Handler, *args: str, env: dict[str, str] | None = None) -> Result:
    """Run the CLI with every request answered by ``handler``; no real sleeping."""
    seams = CliSeams(transport=httpx.MockTransport(handler), sleep=lambda _s: None)
    # A wide "terminal" so that table cells are not wrapped mid-word.
    return CliRunner().invoke(app, list(args), obj=seams, env={"COLUMNS": "200", **(env or {})}, catch_exceptions=False)


def deployment(epoch: int, stable: str | None = D2, previous: str | None = D1) -> Deployment:
    return Deployment(
        name="chat",
        model="llama",
        stable=stable,
        previous_stable=previous,
        canary=None,
        canary_share=0.0,
        epoch=epoch,
        updated_at=NOW,
    )


def answer(model: Any, status: int = 200) -> httpx.Response:
    if isinstance(model, list):
        return httpx.Response(status, json=[m.model_dump(mode="json") for m in model])
    return httpx.Response(status, content=model.model_dump_json())


def error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


def test_cli_public_surface_is_exactly_all() -> None:
    assert set(weightship.cli.__all__) == {"EXIT_CODES", "CliSeams", "app", "main"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("65536", 65536), ("64KiB", 65536), ("64k", 65536), ("64MiB", 64 << 20), ("1G", 1 << 30), ("2gib", 2 << 30)],
)
def test_chunk_sizes_accept_binary_units(text: str, expected: int) -> None:
    assert _parse_size(text) == expected


def test_a_malformed_chunk_size_is_a_usage_error(tmp_path: Any) -> None:
    result = invoke(lambda r: httpx.Response(500), "publish", str(tmp_path), "--model", "m", "--chunk-size", "lots")
    assert result.exit_code == 2
    assert "is not a number of bytes" in result.stderr


ERRORS = [
    pytest.param(error(404, "not_found", "deployment 'chat' does not exist"), 1, "does not exist", id="not-found"),
    pytest.param(error(409, "conflict", "no previous stable version"), 3, "no previous stable", id="conflict"),
    pytest.param(error(401, "unauthenticated", "missing Authorization header"), 4, "Authorization", id="auth"),
    pytest.param(error(403, "forbidden", "role 'agent'"), 4, "role 'agent'", id="forbidden"),
    pytest.param(error(503, "unavailable", "database is busy"), 5, "database is busy", id="temporary"),
]


@pytest.mark.parametrize(("response", "code", "text"), ERRORS)
def test_errors_end_with_one_red_line_and_an_exit_status_by_kind(
    response: httpx.Response, code: int, text: str
) -> None:
    result = invoke(lambda r: response, "history", "chat")
    assert result.exit_code == code
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ")
    assert text in lines[0]
    assert "Traceback" not in result.stderr


def test_json_mode_reports_errors_as_an_error_body_on_stderr() -> None:
    result = invoke(lambda r: error(404, "not_found", "model 'x' does not exist"), "--json", "versions", "x")
    assert result.exit_code == 1
    assert json.loads(result.stderr) == {"error": {"code": "not_found", "message": "model 'x' does not exist"}}


def test_an_unreachable_control_plane_is_retried_then_explained() -> None:
    calls: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    result = invoke(refuse, "--url", "http://10.9.9.9:8080", "models")
    assert result.exit_code == 5
    assert "10.9.9.9:8080" in result.stderr
    assert "WEIGHTSHIP_URL" in result.stderr
    assert len(calls) == 3


def test_url_and_token_come_from_the_environment() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=[])

    env = {"WEIGHTSHIP_URL": "http://cp.example:9000", "WEIGHTSHIP_TOKEN": "ws_env"}
    result = invoke(handler, "--json", "models", env=env)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == []
    assert str(seen[0].url) == "http://cp.example:9000/v1/models"
    assert seen[0].headers["authorization"] == "Bearer ws_env"


def test_deploy_set_reads_the_epoch_then_swaps_with_if_match() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "GET":
            return answer(deployment(epoch=7))
        return answer(deployment(epoch=8))

    result = invoke(handler, "--json", "deploy", "set", "chat", "--stable", "v2", "--reason", "ship it")
    assert result.exit_code == 0, result.stderr
    get, put = seen
    assert (get.method, get.url.path) == ("GET", "/v1/deployments/chat")
    assert (put.method, put.url.path, put.headers["if-match"]) == ("PUT", "/v1/deployments/chat/pointer", '"7"')
    assert json.loads(put.content) == {"stable": "v2", "canary": None, "canary_share": 0.0, "reason": "ship it"}
    assert json.loads(result.stdout)["epoch"] == 8


def test_deploy_set_with_an_expected_epoch_skips_the_read() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(deployment(epoch=4))

    args = ["deploy", "set", "chat", "--stable", "v2", "--canary", "v3", "--share", "0.1", "--expect-epoch", "3"]
    result = invoke(handler, *args)
    assert result.exit_code == 0, result.stderr
    assert [r.method for r in seen] == ["PUT"]
    assert seen[0].headers["if-match"] == '"3"'
    assert json.loads(seen[0].content)["canary_share"] == 0.1


def test_a_lost_compare_and_swap_tells_the_user_to_re_read_and_retry() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return error(412, "precondition_failed", "deployment 'chat' is at epoch 9, not 3")

    result = invoke(handler, "deploy", "set", "chat", "--stable", "v2", "--expect-epoch", "3")
    assert result.exit_code == 3
    assert "no longer at epoch 3" in result.stderr
    assert "weightship status chat" in result.stderr


@pytest.mark.parametrize("args", [["--canary", "v3"], ["--share", "0.2"]], ids=["canary-only", "share-only"])
def test_canary_and_share_must_come_together(args: list[str]) -> None:
    result = invoke(lambda r: answer(deployment(1)), "deploy", "set", "chat", "--stable", "v2", *args)
    assert result.exit_code == 1
    assert "--canary and --share go together" in result.stderr


def test_rollback_prints_where_the_pointer_went() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("POST", "/v1/deployments/chat/rollback")
        assert json.loads(request.content) == {"to": None, "reason": "latency"}
        return answer(deployment(epoch=5, stable=D1, previous=D2))

    result = invoke(handler, "rollback", "chat", "--reason", "latency")
    assert result.exit_code == 0, result.stderr
    assert "rolled back chat" in result.stdout
    assert "stable is now 111111111111" in result.stdout
    assert "epoch 5" in result.stdout


def test_show_refuses_a_manifest_that_does_not_hash_to_the_version(make_model: Any) -> None:
    manifest = build_manifest(make_model("m", tensors_mb=0.1), "llama", chunk_size=65536)
    version = VersionInfo(
        model="llama", digest=D1, labels=["v1"], state="ready", size=1, files=2, created_at=NOW, created_by="ci"
    )

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/manifest"):
            return httpx.Response(200, content=manifest.raw)
        return answer(version)

    result = invoke(handler, "show", "llama@v1")
    assert result.exit_code == 1
    assert "do not deploy it" in result.stderr


def test_show_lists_the_files_of_a_verified_manifest(make_model: Any) -> None:
    manifest = build_manifest(make_model("m", tensors_mb=0.1, shards=2), "llama", chunk_size=65536)
    digest = format_digest(sha256_hex(manifest.raw))
    version = VersionInfo(
        model="llama", digest=digest, labels=["v1"], state="ready", size=1, files=4, created_at=NOW, created_by="ci"
    )

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/manifest"):
            assert request.url.path == f"/v1/models/llama/versions/{digest}/manifest"
            return httpx.Response(200, content=manifest.raw)
        return answer(version)

    human = invoke(handler, "show", "llama@v1")
    assert human.exit_code == 0, human.stderr
    assert "model-00001-of-00002.safetensors" in human.stdout
    scripted = invoke(handler, "--json", "show", "llama@v1")
    assert json.loads(scripted.stdout)["manifest"]["files"][0]["path"] == "config.json"


@pytest.mark.parametrize("ref", ["llama", "@v1", "llama@"])
def test_show_needs_model_at_ref(ref: str) -> None:
    result = invoke(lambda r: httpx.Response(500), "show", ref)
    assert result.exit_code == 1
    assert "MODEL@LABEL" in result.stderr


def test_publish_of_a_missing_directory_fails_clearly(tmp_path: Any) -> None:
    result = invoke(lambda r: httpx.Response(500), "publish", str(tmp_path / "nope"), "--model", "llama")
    assert result.exit_code == 1
    assert "is not a directory" in result.stderr


def test_nodes_and_status_render_for_people() -> None:
    node = NodeInfo(
        id="n1",
        name="gpu-a1",
        labels=NodeLabels(region="eu", cluster="c1", zone="z1", rack="r1", gpu_type="h100"),
        role="node",
        address=None,
        deployments=["chat"],
        registered_at=NOW,
        last_seen=NOW,
        stale=True,
        inventory=[VersionInventory(digest=D1, state=VersionState.ready, bytes_total=10, bytes_present=10)],
        serving=[DeploymentState(name="chat", digest=D1, epoch=4)],
        counters=NodeCounters(bytes_downloaded=2048),
    )
    status = DeploymentStatus(
        deployment=deployment(epoch=4),
        versions=[
            VersionStatus(
                digest=D2,
                role="stable",
                nodes_desired=1,
                nodes_ready=0,
                nodes_fetching=1,
                nodes_failed=0,
                nodes_serving=0,
                bytes_present=5,
                bytes_total=10,
            )
        ],
        nodes=1,
        stale_nodes=1,
        lagging_nodes=["gpu-a1"],
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return answer([node]) if request.url.path == "/v1/nodes" else answer(status)

    nodes = invoke(handler, "nodes")
    assert nodes.exit_code == 0, nodes.stderr
    assert "gpu-a1" in nodes.stdout
    assert "stale" in nodes.stdout
    shown = invoke(handler, "status", "chat")
    assert shown.exit_code == 0, shown.stderr
    assert "gpu-a1" in shown.stdout
    assert "50%" in shown.stdout
    scripted = invoke(handler, "--json", "status", "chat")
    assert json.loads(scripted.stdout)["lagging_nodes"] == ["gpu-a1"]


def test_times_without_a_zone_are_shown_as_utc_not_local_time() -> None:
    naive = NOW.replace(tzinfo=None)
    node = NodeInfo(
        id="n1",
        name="gpu-a1",
        labels=NodeLabels(),
        role="node",
        address=None,
        deployments=[],
        registered_at=naive,
        last_seen=naive,
        stale=False,
    )
    console = Console(width=200, record=True)
    console.print(nodes_table([node], now=NOW + timedelta(seconds=42)))
    assert "42s ago" in console.export_text()


def test_user_text_is_shown_literally_never_as_markup() -> None:
    event = PointerEvent(
        epoch=2,
        action="rollback",
        actor="[bold]eve",
        reason="[/] broke [red]p99[/red]",
        from_stable=D2,
        to_stable=D1,
        from_canary=None,
        to_canary=None,
        canary_share=0.0,
        at=NOW,
    )
    result = invoke(lambda r: answer([event]), "history", "chat")
    assert result.exit_code == 0, result.stderr
    assert "[/] broke [red]p99[/red]" in result.stdout
    assert "[bold]eve" in result.stdout
    failed = invoke(lambda r: error(404, "not_found", "no [red]such[/] thing"), "history", "chat")
    assert "no [red]such[/] thing" in failed.stderr


def _version(digest: str, labels: list[str]) -> VersionInfo:
    return VersionInfo(
        model="llama", digest=digest, labels=labels, state="ready", size=3 << 30, files=9, created_at=NOW, created_by="ci"
    )


@pytest.mark.parametrize("columns", ["40", "80"])
def test_digests_are_never_wrapped_off_a_terminal(columns: str) -> None:
    versions = [_version(D1, ["v1", "2026-11-29.1"]), _version(D2, ["v2"])]

    def handler(request: httpx.Request) -> httpx.Response:
        return answer(versions) if request.url.path.endswith("/versions") else answer(deployment(epoch=3))

    listed = invoke(handler, "versions", "llama", env={"COLUMNS": columns})
    pointed = invoke(handler, "deploy", "set", "chat", "--stable", "v2", env={"COLUMNS": columns})
    for result in (listed, pointed):
        assert result.exit_code == 0, result.stderr
        assert D1 in result.stdout
        assert D2 in result.stdout


def test_digests_stay_whole_on_a_narrow_terminal() -> None:
    from weightship.cli.display import deployment_table, versions_table

    console = Console(width=90, force_terminal=True, record=True)
    console.print(versions_table("llama", [_version(D1, ["v1"]), _version(D2, ["v2"])]))
    console.print(deployment_table(deployment(epoch=3)))
    text = console.export_text()
    assert text.count(D1) == 2
    assert text.count(D2) == 2
