"""The CLI words the control plane's common problems in CLI terms: commands and flags, never routes or JSON fields.

Runs the real CLI against the real control plane (``tests/weightship/test_cli_e2e.py``'s
fixtures) and drives it into each common error: unknown model, version, label and deployment,
a stale pointer, a label already taken, no token, a token of the wrong role.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.weightship.cli_parts import CHUNK, ControlPlane
from weightship.cli.errors import WORDING
from weightship.errors import NotFoundError, PreconditionFailed, TemporaryError, WeightshipError
from weightship.problems import error_from_response

pytestmark = pytest.mark.timeout(120)


#: what a CLI message must never show: REST routes, HTTP verbs and headers, JSON field names
REST_WORDS = ("/v1/", "GET ", "POST ", "PUT ", "DELETE ", "If-Match", "ETag", "Authorization", "canary_share", "'to'")


@pytest.mark.parametrize("controlplane", ["local"], indirect=True)
def test_common_errors_name_cli_commands_and_flags(controlplane: ControlPlane, models: dict[str, Path]) -> None:
    cp = controlplane
    cp.json("publish", str(models["v1"]), "--model", "llama", "--label", "v1", "--chunk-size", CHUNK)
    cp.json("deploy", "create", "chat", "--model", "llama")
    cp.json("deploy", "set", "chat", "--stable", "v1")
    agent = cp.token("node-1", "agent")
    cases: list[tuple[str, list[str], str, str]] = [
        # (what, argv, token, what the line must say)
        ("unknown model", ["versions", "ghost"], "", "`weightship models`"),
        ("unknown label", ["show", "llama@v9"], "", "`weightship versions llama`"),
        ("unknown version", ["show", "llama@sha256:" + "0" * 64], "", "`weightship versions llama`"),
        ("unknown label to roll back to", ["rollback", "chat", "--to", "v9"], "", "`weightship versions llama`"),
        ("unknown deployment", ["status", "ghost"], "", "`weightship deploy list`"),
        ("deployment of an unknown model", ["deploy", "create", "new", "--model", "ghost"], "", "`weightship models`"),
        ("deployment that exists", ["deploy", "create", "chat", "--model", "llama"], "", "`weightship status chat`"),
        ("nothing to roll back to", ["rollback", "chat"], "", "`weightship rollback chat --to VERSION`"),
        (
            "stale pointer",
            ["deploy", "set", "chat", "--stable", "v1", "--expect-epoch", "0"],
            "",
            "weightship status chat",
        ),
        (
            "label taken",
            ["publish", str(models["v2"]), "--model", "llama", "--label", "v1", "--chunk-size", CHUNK],
            "",
            "--label",
        ),
        ("missing token", ["models"], "none", "--token"),
        ("unknown token", ["models"], "ws_not_a_token", "--token"),
        ("wrong role", ["deploy", "create", "other", "--model", "llama"], "agent", "role 'agent'"),
    ]
    tokens = {"": None, "none": "", "agent": agent, "ws_not_a_token": "ws_not_a_token"}
    failures: list[str] = []
    for what, argv, who, says in cases:
        token = tokens[who]
        result = cp.cli(*argv) if token is None else cp.cli(*argv, token=token)
        line = result.stderr.strip()
        if result.exit_code == 0:
            failures.append(f"{what}: `weightship {' '.join(argv)}` succeeded")
            continue
        if says not in line:
            failures.append(f"{what}: {line!r} does not say {says!r}")
        leaked = [word for word in REST_WORDS if word in line]
        if leaked:
            failures.append(f"{what}: {line!r} names REST terms {leaked}")
    assert not failures, "\n".join(failures)


def test_every_worded_code_names_no_rest_terms_even_without_fields() -> None:
    for code, wording in WORDING.items():
        line = wording({})
        assert "None" not in line, (code, line)
        assert not [word for word in REST_WORDS if word in line], (code, line)


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (404, "model_not_found", NotFoundError),
        (412, "pointer_stale", PreconditionFailed),
        (500, "internal", TemporaryError),
    ],
)
def test_the_client_keeps_a_problems_code_and_fields(status: int, code: str, kind: type[WeightshipError]) -> None:
    body = {"type": "t", "title": "x", "status": status, "detail": "what happened", "instance": "/v1/x", "code": code}
    response = httpx.Response(
        status, json=body | {"model": "chat", "epoch": 4}, headers={"content-type": "application/problem+json"}
    )
    error = error_from_response(response, "GET /v1/x")
    assert isinstance(error, kind)
    assert (error.code, error.message, error.fields) == (code, "what happened", {"model": "chat", "epoch": 4})
