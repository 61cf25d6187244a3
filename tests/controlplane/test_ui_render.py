"""The status page's HTML: each analysis measurement beside its condition, and every value escaped."""

from __future__ import annotations

from datetime import UTC, datetime

from controlplane.ui.render import render_sections
from controlplane.ui.summary import DeploymentView, Summary
from weightship.schemas import (
    Deployment,
    PointerEvent,
    Rollout,
    RolloutAnalysisRun,
    RolloutMeasurement,
    RolloutMetric,
    RolloutStep,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
V1, V2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def summary(reason: str) -> Summary:
    spec = {
        "version": V2,
        "steps": [
            {"setWeight": 25},
            {"analysis": {"metrics": [{"name": "quality", "successCondition": "result <= 0.1", "failureCondition": "result > 0.1"}]}},
        ],
    }
    measurements = [
        RolloutMeasurement(index=0, phase="Successful", value=0.05, started_at=NOW, finished_at=NOW),
        RolloutMeasurement(index=1, phase="Failed", value=0.9, started_at=NOW, finished_at=NOW, message="above the limit"),
    ]
    rollout = Rollout(
        id="r1", deployment="chat", model="m", version=V2, stable=V1, phase="Degraded", message="AnalysisFailed",
        completed=False, aborted=True, step_index=1, steps_total=2,
        steps=[
            RolloutStep(index=0, kind="setWeight", summary="setWeight 25", state="done"),
            RolloutStep(index=1, kind="analysis", summary="analysis quality", state="current"),
        ],
        weight=0.0, attempt=1,
        analysis_runs=[RolloutAnalysisRun(id="a1", step_index=1, phase="Failed", metrics=[RolloutMetric(name="quality", phase="Failed", measurements=measurements)])],
        nodes={}, staged_nodes=0, target_nodes=4, spec=spec, status={}, created_at=NOW, created_by="ops",
        updated_at=NOW,
    )  # fmt: skip
    event = PointerEvent(
        epoch=3, action="abort", actor="rollout:r1", reason=reason, from_stable=V1, to_stable=V1,
        from_canary=V2, to_canary=None, canary_share=0.0, at=NOW,
    )  # fmt: skip
    deployment = Deployment(name="chat", model="m", stable=V1, previous_stable=None, canary=None, canary_share=0.0, epoch=3, updated_at=NOW)
    view = DeploymentView(deployment=deployment, history=[event], versions={}, rollout=rollout, preheats=[])
    return Summary(at=NOW, deployments=[view], nodes=[], labels={V1: ["v1"], V2: ["v2"]})


def test_each_measurement_shows_beside_its_condition_and_verdict() -> None:
    html = render_sections(summary("bad canary"))["deployments"]
    assert "step 2 of 2" in html
    assert '<li class="step current" data-index="1">analysis: analysis quality</li>' in html
    for value, verdict in (("0.05", "Successful"), ("0.9", "Failed")):
        row = f'<td>quality</td><td>{value}</td><td>success result &lt;= 0.1; failure result &gt; 0.1</td><td><span class="phase {verdict}">{verdict}</span></td>'
        assert row in html
    assert "above the limit" in html


def test_what_people_and_agents_wrote_is_shown_as_text_never_as_markup() -> None:
    html = render_sections(summary('<script>alert("x")</script>'))["deployments"]
    assert "<script>" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
