"""The operator's built-in analysis provider (``controlplane.k8s.analysis``) against a live control plane.

The serving counters themselves and their judgement are tested with the control plane's own
provider (``tests/controlplane/rollouts/providers``) and end to end with pods
(``test_e2e_pods.py``); here: the operator checks settings as the control plane does, asks it over
REST with its operator token, and the control plane's refusals reach it as errors.
"""

from __future__ import annotations

import httpx
import pytest

from controlplane.k8s.analysis import RemoteBuiltinProvider
from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.providers import ProviderSpecError, RolloutContext
from weightship.client import Client
from weightship.errors import WeightshipError

pytestmark = pytest.mark.timeout(60)


def action(settings: dict[str, object]) -> MeasureMetric:
    return MeasureMetric("run-1", "error-rate", 0, "builtin", settings)


async def test_the_operator_measures_through_the_control_plane_and_no_counters_yet_is_no_data(
    controlplane: tuple[str, dict[str, str]], operator_token: str
) -> None:
    url, digests = controlplane
    with Client(url, operator_token) as client:
        provider = RemoteBuiltinProvider(client)
        context = RolloutContext("chat", "chat-prod", digests["v2"], digests["v1"])
        assert await provider.measure(action({"metric": "errorRate", "window": "30s"}), context) is None


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"metric": "accuracy"}, "metric"),
        ({"metric": "errorRate", "windw": "1m"}, "windw"),
        ({"metric": "validation", "minRequests": 5}, "minRequests"),
    ],
)
async def test_settings_the_builtin_provider_refuses_are_refused_before_asking_and_by_the_control_plane(
    controlplane: tuple[str, dict[str, str]], operator_token: str, settings: dict[str, object], names: str
) -> None:
    url, digests = controlplane
    with Client(url, operator_token) as client:
        provider = RemoteBuiltinProvider(client)
        with pytest.raises(ProviderSpecError, match=names):
            provider.parse(settings, "metric 'error-rate'")
        with pytest.raises(WeightshipError, match=names):  # the control plane checks them too
            client.measure_builtin("chat-prod", metric="error-rate", provider=settings, canary=digests["v2"], stable=None)


def test_only_an_operator_may_ask_for_a_measurement(
    controlplane: tuple[str, dict[str, str]], role_headers: dict[object, dict[str, str]]
) -> None:
    from weightship.schemas import Role

    url, digests = controlplane
    body = {"metric": "m", "provider": {"metric": "errorRate"}, "canary": digests["v2"]}
    path = f"{url}/v1/deployments/chat-prod/analysis/builtin"
    assert httpx.post(path, json=body, headers=role_headers[Role.publisher]).status_code == 403
    assert httpx.post(path, json=body, headers=role_headers[Role.operator]).status_code == 200
