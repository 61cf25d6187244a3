"""The CRD's structural schema refuses malformed ModelRollouts before the operator ever sees them.

kmock stores whatever it is sent, so the schema is checked here with a real JSON-schema validator
(``jsonschema``), as the API server would with the CRD's ``openAPIV3Schema``.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest

from tests.kubernetes.conftest import crd
from tests.kubernetes.rollout_parts import rollout


def validator() -> jsonschema.Draft7Validator:
    """The openAPIV3Schema of v1alpha1, as a JSON-schema validator (x-kubernetes-* keywords are ignored)."""
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema)


def test_a_valid_rollout_passes_the_schema() -> None:
    spec = rollout("v7", [{"setWeight": 10}, {"pause": {"duration": "5m"}}, {"prefetch": {"percent": 100}}])
    assert list(validator().iter_errors(spec)) == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s.pop("replicas"), "replicas"),
        (lambda s: s.update(replicas=0), "replicas"),
        (lambda s: s.update(version="v7; rm -rf /"), "version"),
        (lambda s: s.update(steps=[{"setWeight": 150}]), "setWeight"),
        (lambda s: s.update(steps=[{"setWeight": 10, "pause": {}}]), "steps"),
        (lambda s: s.update(steps=[{"wait": {}}]), "steps"),
        (lambda s: s.update(steps=[{"pause": {"duration": "forever"}}]), "duration"),
        (lambda s: s.update(typo=1), "typo"),
        (lambda s: s["template"]["spec"].update(containers=[]), "containers"),
        (lambda s: s.update(trafficRouting={"services": {"stable": "a"}}), "canary"),
    ],
)
def test_an_invalid_spec_is_refused_by_the_crd_schema(change: Any, field: str) -> None:
    body = copy.deepcopy(rollout("v7", [{"setWeight": 10}]))
    change(body["spec"])
    errors = list(validator().iter_errors(body))
    assert errors, f"the schema accepted an invalid spec ({field})"
    assert any(field in (str(e.path) + e.message) for e in errors), [e.message for e in errors]


def test_the_crd_has_printer_columns_a_short_name_and_the_status_and_scale_subresources() -> None:
    definition = crd()
    version = definition["spec"]["versions"][0]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Stable", "Canary", "Weight", "Step", "Desired", "Ready", "Age"]
    # Labels (v2), not digests; DESIRED from the spec, READY from the pods the operator counted.
    assert (columns["Stable"], columns["Canary"]) == (".status.stableLabel", ".status.canaryLabel")
    assert (columns["Desired"], columns["Ready"]) == (".spec.replicas", ".status.readyReplicas")
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    assert "mro" in definition["spec"]["names"]["shortNames"]
