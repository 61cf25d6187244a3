"""The Helm chart rendered and its objects found, for the chart and install tests."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


CHART = REPO / "deploy" / "helm" / "weightship"


CRD = CHART / "crds" / "modelrollout.yaml"


#: the prefix of every object's name (the chart's fullname for RELEASE)
#: the agent's host data directory by default (instance-store NVMe as EKS AL2023 mounts it)
DATA_DIR = "/mnt/k8s-disks/0/weightship"


KUBE_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())  # Chart.yaml: kubeVersion >=1.29


# The values with no safe default: nothing renders without them.
REQUIRED: dict[str, Any] = {
    "controlplane": {
        "database": {"secretName": "weightship-database"},
        "store": {"url": "s3://model-weights/weightship", "s3": {"region": "eu-west-1"}},
    },
}


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested mappings key by key (like helm -f a -f b)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


DOCS = REPO / "docs" / "kubernetes.md"


def docs_release() -> tuple[str, str]:
    """(release, namespace) of the ``helm install`` command in docs/kubernetes.md."""
    found = re.search(r"^helm install (\S+) deploy/helm/weightship -n (\S+)", DOCS.read_text(), re.MULTILINE)
    assert found, "docs/kubernetes.md has no `helm install RELEASE deploy/helm/weightship -n NAMESPACE` line"
    return found[1], found[2]


RELEASE, NAMESPACE = docs_release()


def render(values: dict[str, Any]) -> dict[str, str]:
    """Template path -> rendered text, as ``helm template`` would produce it."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def objects(values: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(template path, object) for every object the chart renders with ``values``."""
    found = []
    for path, text in render(values).items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                found.append((path, doc))
    return found


def find(objs: list[tuple[str, dict[str, Any]]], kind: str, suffix: str) -> dict[str, Any]:
    matches = [o for _, o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(matches) == 1, f"expected one {kind} named *{suffix}, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}


_METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _LABELS},
}


_TARGET_REF = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"}},
}


def _resource(required: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    """A custom resource's schema: named metadata and a closed ``spec``."""
    return {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "metadata": _METADATA,
            "spec": {"type": "object", "required": required, "additionalProperties": False, "properties": spec},
        },
    }


THIRD_PARTY: dict[tuple[str, str], dict[str, Any]] = {
    # monitoring.coreos.com/v1 ServiceMonitor (prometheus-operator)
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _resource(
        ["selector", "endpoints"],
        {
            "selector": {
                "type": "object",
                "properties": {"matchLabels": _LABELS},
                "additionalProperties": False,
            },
            "namespaceSelector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                    "any": {"type": "boolean"},
                },
            },
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "interval": {
                            "type": "string",
                            "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                        },
                    },
                },
            },
        },
    ),
    # keda.sh/v1alpha1 ScaledObject (KEDA)
    ("keda.sh/v1alpha1", "ScaledObject"): _resource(
        ["scaleTargetRef", "triggers"],
        {
            "scaleTargetRef": _TARGET_REF,
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer"},
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["type", "metadata"],
                    "additionalProperties": False,
                    "properties": {
                        "type": {"type": "string"},
                        # KEDA trigger metadata is map[string]string: a number here is refused.
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                },
            },
        },
    ),
}


def crd_schema() -> dict[str, Any]:
    """The served version's openAPIV3Schema of our ModelRollout CRD (a missing CRD is a failure)."""
    assert CRD.exists(), f"{CRD.relative_to(REPO)} is missing: the chart must ship the ModelRollout CRD"
    crd = yaml.safe_load(CRD.read_text())
    served = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    schema: dict[str, Any] = served[0]["schema"]["openAPIV3Schema"]
    return schema


def validate(obj: dict[str, Any]) -> None:
    """Strict schema validation for ``obj``'s kind; an unknown kind is a failure, not a skip."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    if api_version.startswith("weightship.io/"):
        jsonschema.validate(obj, crd_schema())
        return
    if (api_version, kind) in THIRD_PARTY:
        jsonschema.validate(obj, THIRD_PARTY[(api_version, kind)])
        return
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = ".".join(str(p) for p in err.path)
            pytest.fail(
                f"{kind} {obj['metadata']['name']} is invalid for Kubernetes {version} at {where}: {err.message}"
            )
        except kubernetes_validate.SchemaNotFoundError as err:
            pytest.fail(f"no schema to check {kind} {obj['metadata']['name']} against: {err.message}")
