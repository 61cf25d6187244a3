"""``weightship rollout`` in-process against the REST contract (docs/api.md, rollouts).

Requests go through an ``httpx.MockTransport`` (the CLI's test seam) that answers as the control
plane's rollout routes do; ``--watch`` runs on a fake clock whose sleep advances it, so nothing
waits. The same commands run against the real control plane in ``tests/controlplane`` and against
ModelRollouts in ``tests/kubernetes``.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from weightship.cli import CliSeams, app
from weightship.schemas import Rollout
from weightship.testing import ManualClock

pytestmark = pytest.mark.timeout(30)

NOW = datetime(2026, 12, 1, 7, 0, tzinfo=UTC)
V1 = "sha256:" + "1" * 64
V2 = "sha256:" + "2" * 64
Handler = Callable[[httpx.Request], httpx.Response]


def invoke(handler: Handler, *args: str, clock: ManualClock | None = None) -> Result:
    clock = clock or ManualClock(0.0)
    seams = CliSeams(transport=httpx.MockTransport(handler), sleep=clock.sleep, clock=clock)
    return CliRunner().invoke(app, list(args), obj=seams, env={"COLUMNS": "200"}, catch_exceptions=False)


def rollout(**changes: Any) -> Rollout:
    """A fleet rollout at step 2 of 3 (setWeight 25 done, analysis running)."""
    data: dict[str, Any] = {
        "id": "r-7f3a",
        "deployment": "chat-prod",
        "model": "chat",
        "version": V2,
        "stable": V1,
        "phase": "Progressing",
        "message": "analysis error-rate running",
        "completed": False,
        "aborted": False,
        "step_index": 1,
        "steps_total": 3,
        "steps": [
            {"index": 0, "kind": "setWeight", "summary": "set canary weight to 25%", "state": "done"},
            {"index": 1, "kind": "analysis", "summary": "analysis: error-rate", "state": "current"},
            {"index": 2, "kind": "setWeight", "summary": "set canary weight to 100%", "state": "pending"},
        ],
        "weight": 25.0,
        "attempt": 1,
        "analysis_runs": [
            {
                "id": "r-7f3a-1-1",
                "step_index": 1,
                "phase": "Running",
                "metrics": [
                    {
                        "name": "error-rate",
                        "phase": "Running",
                        "measurements": [
                            {"index": 0, "phase": "Successful", "value": 0.0042, "started_at": NOW.isoformat(),
                             "finished_at": NOW.isoformat(), "message": ""},
                        ],
                    }
                ],
            }
        ],
        "nodes": {V1: 3, V2: 1},
        "staged_nodes": 4,
        "target_nodes": 4,
        "spec": {"version": V2, "steps": [{"setWeight": 25}, {"analysis": {}}, {"setWeight": 100}]},
        "status": {"schema": 1},
        "created_at": NOW.isoformat(),
        "created_by": "alice",
        "updated_at": NOW.isoformat(),
    }  # fmt: skip
    data.update(changes)
    return Rollout.model_validate(data)


def answer(model: Rollout | list[Rollout], status: int = 200) -> httpx.Response:
    if isinstance(model, list):
        return httpx.Response(status, json={"rollouts": [m.model_dump(mode="json") for m in model]})
    return httpx.Response(status, content=model.model_dump_json())


def problem(status: int, code: str, detail: str) -> httpx.Response:
    body = {"type": "about:blank", "title": "Conflict", "status": status, "code": code, "detail": detail}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})


def test_start_posts_the_version_and_the_steps_given_as_shorthand() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(rollout(step_index=0), 201)

    args = ["rollout", "start", "chat-prod", "v2", "--step", "prefetch=100", "--step", "setWeight=25"]
    result = invoke(handler, *args, "--step", "pause=10m", "--step", "pause", "--progress-deadline", "900", "--json")
    assert result.exit_code == 0, result.stderr
    (post,) = seen
    assert (post.method, post.url.path) == ("POST", "/v1/deployments/chat-prod/rollouts")
    assert json.loads(post.content) == {
        "spec": {
            "version": "v2",
            "steps": [{"prefetch": {"percent": 100}}, {"setWeight": 25}, {"pause": {"duration": "10m"}}, {"pause": {}}],
            "progressDeadlineSeconds": 900,
        }
    }
    assert json.loads(result.stdout)["id"] == "r-7f3a"


def test_start_reads_a_spec_file_and_refuses_one_naming_another_version(tmp_path: Any) -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return answer(rollout(), 201)

    spec = {"steps": [{"setWeight": 10}, {"analysis": {"metrics": [{"name": "error-rate"}]}}]}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert invoke(handler, "rollout", "start", "chat-prod", "v2", "--spec", str(path)).exit_code == 0
    assert seen == [{"spec": {**spec, "version": "v2"}}]

    path.write_text(json.dumps({**spec, "version": "v3"}))
    result = invoke(handler, "rollout", "start", "chat-prod", "v2", "--spec", str(path))
    assert result.exit_code == 1
    assert "names version 'v3'" in result.stderr
    assert len(seen) == 1  # nothing was sent


@pytest.mark.parametrize("bad", ["setWeight=a", "jump=3", "setWeight"])
def test_a_malformed_step_shorthand_is_refused_before_any_request(bad: str) -> None:
    result = invoke(lambda r: pytest.fail("no request expected"), "rollout", "start", "d", "v2", "--step", bad)
    assert result.exit_code == 1
    assert f"--step {bad!r} is not a step" in result.stderr


def test_a_second_rollout_is_refused_with_the_servers_message() -> None:
    message = "deployment 'chat-prod' already has active rollout r-7f3a (Progressing): abort it or wait"
    result = invoke(lambda r: problem(409, "rollout_active", message), "rollout", "start", "chat-prod", "v3")
    assert result.exit_code == 3
    assert message in result.stderr


def test_status_shows_steps_weight_measurements_and_nodes_per_version_with_whole_digests() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return answer(rollout())

    result = invoke(handler, "rollout", "status", "chat-prod")
    assert result.exit_code == 0, result.stderr
    assert seen == ["/v1/deployments/chat-prod/rollouts/current"]
    out = result.stdout
    for expected in ("Progressing", "25% canary", "2/3", "set canary weight to 25%", "✓ done", "▶ current",
                     "error-rate", "0.0042", V1, V2, "4 of 4 target nodes"):  # fmt: skip
        assert expected in out, f"{expected!r} missing from:\n{out}"
    # off a terminal, a digest is never wrapped: each one lies whole on one line
    assert any(V2 in line for line in out.splitlines())


def test_status_json_is_the_rollout_schema_and_rollout_picks_one_by_id() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return answer(rollout(id="r-0001"))

    result = invoke(handler, "rollout", "status", "chat-prod", "--rollout", "r-0001", "--json")
    assert result.exit_code == 0, result.stderr
    assert Rollout.model_validate(json.loads(result.stdout)) == rollout(id="r-0001")
    assert seen == ["/v1/deployments/chat-prod/rollouts/r-0001"]


@pytest.mark.parametrize(
    ("args", "verb"),
    [(["promote"], "promote"), (["promote", "--full"], "promote-full"), (["pause"], "pause"),
     (["resume"], "resume"), (["abort"], "abort"), (["retry"], "retry")],
)  # fmt: skip
def test_each_verb_posts_its_action(args: list[str], verb: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(rollout())

    result = invoke(handler, "--json", "rollout", *args, "chat-prod")
    assert result.exit_code == 0, result.stderr
    (post,) = seen
    assert (post.method, post.url.path) == ("POST", "/v1/deployments/chat-prod/rollouts/current/actions")
    assert json.loads(post.content) == {"verb": verb}


def test_a_refused_verb_shows_the_servers_reason_and_exits_3() -> None:
    message = "rollout r-7f3a is not paused: resume fits only a paused rollout; use promote to move on"
    result = invoke(lambda r: problem(409, "rollout_verb", message), "rollout", "resume", "chat-prod")
    assert result.exit_code == 3
    assert message in result.stderr


def test_list_across_deployments_or_of_one() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url.copy_with(scheme="http", host="x", port=None)))
        return answer([rollout(), rollout(id="r-0001", phase="Healthy", completed=True)])

    result = invoke(handler, "rollout", "list", "--active")
    assert result.exit_code == 0, result.stderr
    assert "r-7f3a" in result.stdout
    assert "r-0001" in result.stdout
    result = invoke(handler, "--json", "rollout", "list", "chat-prod")
    assert [r["id"] for r in json.loads(result.stdout)] == ["r-7f3a", "r-0001"]
    result = invoke(handler, "--json", "rollout", "list", "other", "--active")
    assert json.loads(result.stdout) == []  # the server's active ones, of that deployment only
    assert seen == [
        "http://x/v1/rollouts?active=true",
        "http://x/v1/deployments/chat-prod/rollouts",
        "http://x/v1/rollouts?active=true",
    ]


def test_watch_prints_a_json_line_per_change_and_ends_when_the_rollout_completes() -> None:
    states = [rollout(), rollout(), rollout(step_index=2, weight=100.0),
              rollout(step_index=3, weight=0.0, phase="Healthy", completed=True, message="promoted")]  # fmt: skip
    clock = ManualClock(0.0)

    def handler(request: httpx.Request) -> httpx.Response:
        return answer(states.pop(0))

    result = invoke(handler, "--json", "rollout", "status", "chat-prod", "--watch", "--interval", "2", clock=clock)
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(x["step_index"], x["phase"]) for x in lines] == [(1, "Progressing"), (2, "Progressing"), (3, "Healthy")]
    assert clock.sleeps == [2.0, 2.0, 2.0]
    assert not states


def test_watch_ends_non_zero_when_the_rollout_degrades() -> None:
    degraded = rollout(phase="Degraded", aborted=True, weight=0.0, message="analysis error-rate failed: 0.5 >= 0.01")
    states = [rollout(), degraded]
    result = invoke(lambda r: answer(states.pop(0)), "rollout", "status", "chat-prod", "--watch")
    assert result.exit_code == 1
    assert "Degraded" in result.stdout  # the last view is shown
    assert "is Degraded: analysis error-rate failed" in result.stderr
    assert "weightship rollout retry chat-prod" in result.stderr


def test_watch_gives_up_after_its_timeout_with_exit_5() -> None:
    clock = ManualClock(0.0)
    args = ["rollout", "status", "chat-prod", "--watch", "--interval", "1", "--timeout", "5"]
    result = invoke(lambda r: answer(rollout()), *args, clock=clock)
    assert result.exit_code == 5
    assert "still Progressing (step 2/3) after 5 s" in result.stderr
    assert clock.now == 5.0
    assert "`weightship rollout status --watch chat-prod`" in result.stderr


def test_start_with_watch_follows_the_new_rollout_by_its_id() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        if request.method == "POST":
            return answer(rollout(id="r-new"), 201)
        return answer(rollout(id="r-new", phase="Healthy", completed=True, step_index=3))

    result = invoke(handler, "--json", "rollout", "start", "chat-prod", "v2", "--step", "setWeight=50", "--watch")
    assert result.exit_code == 0, result.stderr
    assert seen == ["POST /v1/deployments/chat-prod/rollouts", "GET /v1/deployments/chat-prod/rollouts/r-new"]


def test_kube_mode_without_the_kubernetes_client_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_kubernetes(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "kubernetes" or name.startswith("kubernetes."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kubernetes)  # the library's absence, not our code, is faked
    result = invoke(lambda r: pytest.fail("no request expected"), "rollout", "status", "chat", "--kube")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "pip install 'weightship[kube]'" in result.stderr


def test_rollout_id_with_kube_is_refused() -> None:
    result = invoke(lambda r: pytest.fail("no request"), "rollout", "status", "chat", "-n", "m", "--rollout", "r-1")
    assert result.exit_code == 1
    assert "--rollout names a fleet rollout" in result.stderr


def test_watch_on_a_terminal_redraws_one_live_view() -> None:
    states = [rollout(), rollout(step_index=2, weight=50.0), rollout(step_index=3, phase="Healthy", completed=True)]
    clock = ManualClock(0.0)
    seams = CliSeams(transport=httpx.MockTransport(lambda r: answer(states.pop(0))), sleep=clock.sleep, clock=clock)
    env = {"COLUMNS": "120", "FORCE_COLOR": "1"}  # rich treats the output as a terminal
    result = CliRunner().invoke(app, ["rollout", "status", "chat-prod", "--watch"], obj=seams, env=env)
    assert result.exit_code == 0, result.stderr
    assert "\x1b[?25l" in result.stdout  # the cursor hidden while the view redraws in place
    assert "Healthy" in result.stdout
    assert not states
