"""The chart gives every agent (nodes and caches) and the control plane the signing policy, from values, a ConfigMap or a Secret."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.kubernetes.chart_parts import REQUIRED, find, merged, objects, validate
from weightship.signing_policy import parse_policy

pytestmark = pytest.mark.timeout(120)

POLICY = {"models": {"llama": {"require_signature": False}}, "default": {"require_signature": False}}


def _workloads(values: dict[str, Any]) -> list[dict[str, Any]]:
    objs = objects(values)
    found = [find(objs, "DaemonSet", "-agent"), find(objs, "Deployment", "-controlplane")]
    found += [obj for _path, obj in objs if obj.get("kind") == "StatefulSet" and "-cache-" in obj["metadata"]["name"]]
    return found


def _policy_env_and_volume(workload: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    spec = workload["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    volume = next((v for v in spec.get("volumes", []) if v["name"] == "signing-policy"), None)
    mounted = any(m["name"] == "signing-policy" for m in container.get("volumeMounts", []))
    assert mounted == (volume is not None), "the policy volume is mounted exactly when it exists"
    variable = "WEIGHTSHIP_SIGNING_POLICY" if workload["kind"] == "Deployment" else "WEIGHTSHIP_AGENT_SIGNING_POLICY"
    return env.get(variable), volume


def test_a_policy_in_values_becomes_a_configmap_every_agent_and_cache_mounts() -> None:
    values = merged(REQUIRED, {"signing": {"policy": POLICY}, "caches": {"enabled": True}})
    objs = objects(values)
    config = find(objs, "ConfigMap", "-signing-policy")
    validate(config)
    parse_policy(config["data"]["policy.json"].encode())  # what the chart wrote is a policy the agents read
    workloads = _workloads(values)
    assert len(workloads) >= 3, "the node agents, the control plane and at least one cache tier"
    for workload in workloads:
        path, volume = _policy_env_and_volume(workload)
        assert path == "/etc/weightship/signing/policy.json"
        assert volume == {"name": "signing-policy", "configMap": {"name": config["metadata"]["name"], "defaultMode": 0o444}}
    assert json.loads(config["data"]["policy.json"]) == POLICY


def test_an_existing_secret_is_mounted_instead_and_no_policy_means_no_mount() -> None:
    values = merged(REQUIRED, {"signing": {"existingSecret": "fleet-signing", "key": "trust.json"}})
    for workload in _workloads(values):
        path, volume = _policy_env_and_volume(workload)
        assert path == "/etc/weightship/signing/trust.json"
        assert volume == {"name": "signing-policy", "secret": {"secretName": "fleet-signing", "defaultMode": 0o444}}
    for workload in _workloads(REQUIRED):
        assert _policy_env_and_volume(workload) == (None, None)
