"""End to end: the engine's analysis steps measured by the Prometheus provider on real scraped servers.

The engine runs as a driver would run it: each ``MeasureMetric`` it asks for goes to the provider
registry, which queries the real Prometheus; the answer goes back as an observation. The clock is
the simulation's fake one (measurements are real, waiting between them is not), and the pointer
and fleet are the in-memory ``World`` of the engine tests.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.analysis import AnalysisPhase
from controlplane.rollouts.phases import Phase
from controlplane.rollouts.providers import ProviderRegistry, RolloutContext
from controlplane.rollouts.spec import parse_spec
from controlplane.rollouts.status import RolloutStatus
from controlplane.rollouts.steps import AbortReason
from tests.controlplane.rollouts.providers.conftest import Fleet
from tests.controlplane.rollouts.simulation import World

pytestmark = pytest.mark.timeout(240)


def error_rate_rollout(fleet: Fleet, canary: str) -> World:
    """setWeight 25, then three error-rate measurements 30 s apart, then promotion."""
    served = 'and on(instance) weightship_serve_version_info{digest="{{canary}}"}'
    requests = f'weightship_serve_requests_total{{test="{fleet.label}"}} {served}'
    errors = f'weightship_serve_requests_total{{test="{fleet.label}", code!="200"}} {served}'
    metric = {
        "name": "error-rate",
        "provider": {
            "prometheus": {"address": fleet.prometheus.url, "query": f"(sum({errors}) or vector(0)) / sum({requests})"}
        },
        "interval": "30s",
        "count": 3,
        "successCondition": "result[0] <= 0.05",
    }
    spec = parse_spec({"version": canary, "steps": [{"setWeight": 25}, {"analysis": {"metrics": [metric]}}]})
    return World(spec=spec, stable=fleet.stable)


async def drive(world: World, deployment: str = "chat", ticks: int = 40) -> RolloutStatus:
    """Reconcile and carry out every action until the rollout completes, aborts or pauses with nothing to do."""
    context = RolloutContext("rollout-e2e", deployment, world.spec.version, world.stable)
    async with ProviderRegistry.default(clock=lambda: world.now) as providers:
        providers.check_spec(world.spec)
        for _ in range(ticks):
            result = world.reconcile()
            for action in result.actions:
                if isinstance(action, MeasureMetric):
                    world.results.append(await providers.measure(action, context))
                else:
                    world.apply(action)
            status = result.status
            if not result.actions and (status.completed or status.abort or status.phase is Phase.PAUSED):
                return status
            world.now += timedelta(seconds=30)
    raise AssertionError(f"the rollout did not settle in {ticks} ticks: {world.status}")


async def test_healthy_canary_passes_analysis_and_is_promoted(fleet: Fleet) -> None:
    world = error_rate_rollout(fleet, fleet.good)
    status = await drive(world)
    assert status.completed
    assert status.phase is Phase.HEALTHY
    (run,) = status.analysis_runs
    assert run.phase is AnalysisPhase.SUCCESSFUL
    assert [m.value for m in run.metrics[0].measurements] == [[0.0], [0.0], [0.0]]
    assert world.pointer == (fleet.good, None, 0.0)


async def test_failing_canary_fails_analysis_and_is_rolled_back(fleet: Fleet) -> None:
    world = error_rate_rollout(fleet, fleet.bad)
    status = await drive(world)
    assert status.abort
    assert status.abort_reason == AbortReason.ANALYSIS_FAILED
    assert status.phase is Phase.DEGRADED
    (run,) = status.analysis_runs
    assert run.phase is AnalysisPhase.FAILED
    (measurement,) = run.metrics[0].measurements  # failureLimit 0: the first failure ends the run
    assert measurement.value == [pytest.approx(0.4)]
    assert world.pointer == (fleet.stable, None, 0.0)
    assert [w.canary_share for w in world.pointer_writes] == [0.25, 0.0]


async def test_canary_without_data_pauses_instead_of_passing(fleet: Fleet) -> None:
    # A version no server runs: every query is empty, which must never count as healthy.
    world = error_rate_rollout(fleet, "sha256:" + "0" * 64)
    status = await drive(world)
    assert not status.completed
    assert status.phase is Phase.PAUSED
    (run,) = status.analysis_runs
    assert run.phase is AnalysisPhase.INCONCLUSIVE
    assert run.metrics[0].measurements[0].value == []
    assert world.pointer == (fleet.stable, "sha256:" + "0" * 64, 0.25)  # traffic held where it was
