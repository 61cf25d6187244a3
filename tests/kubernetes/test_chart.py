"""The Helm chart, rendered by Helm's own Go SDK and checked against Kubernetes' own schemas.

``helm-python-sdk`` binds Helm's Go SDK (template engine, ``required``/``fail``, values schema, lint),
so what renders here renders the same under ``helm install``. Every rendered object is validated
strictly (unknown fields are errors) against the OpenAPI schemas of its kind for the oldest and the
newest Kubernetes release the chart supports (``kubernetes-validate``, offline). Objects of kinds
that other projects define (Prometheus Operator, KEDA) are checked against the subset of their
CRD schema this chart writes, kept below; ModelRollouts against our CRD
(``crds/modelrollout.yaml``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from agent.config import LABEL_KEYS, AgentConfig, load_config

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "weightship"
CRD = CHART / "crds" / "modelrollout.yaml"
DOCS = REPO / "docs" / "kubernetes.md"
RELEASE, NAMESPACE = "ws", "weightship"
KUBE_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())  # Chart.yaml: kubeVersion >=1.29

# The values with no safe default: nothing renders without them.
REQUIRED: dict[str, Any] = {
    "controlplane": {
        "database": {"secretName": "weightship-database"},
        "store": {"url": "s3://model-weights/weightship", "s3": {"region": "eu-west-1"}},
        "secretName": "weightship-controlplane",
    },
    "agent": {"enrolmentSecretName": "weightship-enrolment"},
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


def eks_values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "examples" / "eks-values.yaml").read_text())
    return loaded


# Every switch in the other position, so every template and branch renders in some scenario.
EVERYTHING_ELSE = {
    "controlplane": {
        "migrations": {"mode": "initContainer"},
        "store": {"s3": {"endpointUrl": "https://minio.storage:9000", "credentialsSecretName": "minio"}},
    },
    "caches": {"enabled": True, "region": {"enabled": True}},
    "operator": {"trafficRouter": "service", "watchNamespaces": ["models-a", "models-b"]},
    "autoscaling": {"scaleTargetRef": {"name": "chat"}, "hpa": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True}},
}

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": REQUIRED,
    "eks-example": eks_values(),
    "everything-else": merged(REQUIRED, EVERYTHING_ELSE),
}


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


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """All containers (init ones too) of a workload object."""
    spec = obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_names(container: dict[str, Any]) -> list[str]:
    return [e["name"] for e in container.get("env", [])]


def find(objs: list[tuple[str, dict[str, Any]]], kind: str, suffix: str) -> dict[str, Any]:
    matches = [o for _, o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(matches) == 1, f"expected one {kind} named *{suffix}, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


# --- the subset of other projects' CRD schemas that this chart writes --------------------------

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


def crd_schema() -> dict[str, Any] | None:
    """The served version's openAPIV3Schema of our ModelRollout CRD, when the CRD is present."""
    if not CRD.exists():
        return None
    crd = yaml.safe_load(CRD.read_text())
    served = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    schema: dict[str, Any] = served[0]["schema"]["openAPIV3Schema"]
    return schema


def validate(obj: dict[str, Any]) -> None:
    """Strict schema validation for ``obj``'s kind; an unknown kind is a failure, not a skip."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    if api_version.startswith("weightship.io/"):
        schema = crd_schema()
        if schema is None:
            pytest.skip(f"{CRD.relative_to(REPO)} is not on this branch yet (it comes with the operator)")
        jsonschema.validate(obj, schema)
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


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_chart_lints_clean(scenario: str) -> None:
    report = helm.lint(CHART, SCENARIOS[scenario], strict=True, namespace=NAMESPACE, kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"], report
    assert not problems, report


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_rendered_object_validates_against_its_schema(scenario: str) -> None:
    objs = objects(SCENARIOS[scenario])
    assert objs
    for _, obj in objs:
        validate(obj)


def test_every_template_renders_in_some_scenario() -> None:
    rendered: set[str] = set()
    for values in SCENARIOS.values():
        rendered |= {path.removeprefix("weightship/") for path, _ in objects(values)}
    templates = {f"templates/{p.name}" for p in (CHART / "templates").glob("*.yaml")}
    assert templates - rendered == set()


def test_crd_is_a_valid_custom_resource_definition() -> None:
    if not CRD.exists():
        pytest.skip(f"{CRD.relative_to(REPO)} is not on this branch yet (it comes with the operator)")
    with helm.Chart.load(CHART) as chart:
        crds = [yaml.safe_load(c["data"]) for c in chart.crds]
    assert [c["spec"]["names"]["kind"] for c in crds] == ["ModelRollout"]
    for crd in crds:
        validate(crd)


def test_docs_modelrollout_example_satisfies_the_crd() -> None:
    """The ModelRollout in docs/kubernetes.md is accepted by the CRD the chart installs."""
    examples = [
        doc
        for block in re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL)
        for doc in yaml.safe_load_all(block)
        if isinstance(doc, dict) and doc.get("kind") == "ModelRollout"
    ]
    assert examples, "docs/kubernetes.md shows no ModelRollout"
    for example in examples:
        example.setdefault("metadata", {}).setdefault("namespace", "models")
        validate(example)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (("controlplane", "database", "secretName"), "controlplane.database.secretName is required"),
        (("controlplane", "store", "url"), "controlplane.store.url is required"),
        (("controlplane", "store", "s3", "region"), "controlplane.store.s3.region is required"),
        (("controlplane", "secretName"), "controlplane.secretName is required"),
        (("agent", "enrolmentSecretName"), "agent.enrolmentSecretName is required"),
    ],
)
def test_missing_required_value_fails_rendering_with_its_name(drop: tuple[str, ...], message: str) -> None:
    values = copy.deepcopy(REQUIRED)
    parent = values
    for key in drop[:-1]:
        parent = parent[key]
    del parent[drop[-1]]
    with pytest.raises(helm.HelmRenderError) as err:
        render(values)
    assert message in str(err.value)


def test_no_values_at_all_fail_with_a_required_value_message() -> None:
    with pytest.raises(helm.HelmRenderError, match="is required"):
        render({})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"controlplane": {"store": {"url": "local:/data"}}}, "does not match pattern"),
        ({"operator": {"trafficRouter": "istio"}}, "trafficRouter"),
        ({"agent": {"quota": "lots"}}, "quota"),
        ({"controlplane": {"replicaz": 3}}, "replicaz"),
    ],
)
def test_bad_values_are_refused_by_the_values_schema(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=message):
        render(merged(REQUIRED, values))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_no_environment_variable_is_ever_set_empty(scenario: str) -> None:
    """An empty variable would override the program's embedded default (the old crash loop)."""
    for path, obj in objects(SCENARIOS[scenario]):
        if "template" not in obj.get("spec", {}):
            continue
        for container in containers(obj):
            for env in container.get("env", []):
                assert "valueFrom" in env or env.get("value"), f"{path}: {container['name']} sets {env['name']} empty"


def test_unset_optional_value_renders_no_env_var() -> None:
    objs = objects(REQUIRED)
    controlplane = find(objs, "Deployment", "-controlplane")["spec"]["template"]["spec"]["containers"][0]
    agent = next(c for c in containers(find(objs, "DaemonSet", "-agent")) if c["name"] == "agent")
    optional_cp = {
        "WEIGHTSHIP_S3_ENDPOINT_URL",
        "WEIGHTSHIP_BLOB_URL_TTL",
        "WEIGHTSHIP_UPLOAD_TTL",
        "WEIGHTSHIP_NODE_STALE_SECONDS",
        "WEIGHTSHIP_LONG_POLL_MAX",
        "WEIGHTSHIP_DATABASE_POOL_SIZE",
        "WEIGHTSHIP_DATABASE_STATEMENT_TIMEOUT",
        "WEIGHTSHIP_MAX_BODY_BYTES",
        "AWS_ACCESS_KEY_ID",
    }
    assert optional_cp & set(env_names(controlplane)) == set()
    optional_agent = {"WEIGHTSHIP_AGENT_DEPLOYMENTS", "WEIGHTSHIP_AGENT_QUOTA_BYTES", "WEIGHTSHIP_AGENT_MIN_FREE_BYTES"}
    assert optional_agent & set(env_names(agent)) == set()

    given = merged(REQUIRED, {"controlplane": {"config": {"blobUrlTtlSeconds": 900}}, "agent": {"quota": "800GiB"}})
    objs = objects(given)
    controlplane = find(objs, "Deployment", "-controlplane")["spec"]["template"]["spec"]["containers"][0]
    agent = next(c for c in containers(find(objs, "DaemonSet", "-agent")) if c["name"] == "agent")
    assert {"name": "WEIGHTSHIP_BLOB_URL_TTL", "value": "900"} in controlplane["env"]
    assert {"name": "WEIGHTSHIP_AGENT_QUOTA_BYTES", "value": "800GiB"} in agent["env"]


def test_controlplane_settings_come_from_secrets_and_name_real_variables() -> None:
    objs = objects(SCENARIOS["eks-example"])
    pod = find(objs, "Deployment", "-controlplane")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["WEIGHTSHIP_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "weightship-database", "key": "url"}
    assert env["WEIGHTSHIP_URL_SIGNING_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "weightship-controlplane"
    assert env["WEIGHTSHIP_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert env["WEIGHTSHIP_S3_REGION"]["value"] == "eu-west-1"
    # Every WEIGHTSHIP_* variable the chart sets is one the control plane reads.
    source = (REPO / "controlplane" / "settings.py").read_text() + (REPO / "controlplane" / "__main__.py").read_text()
    unknown = [name for name in env if name.startswith("WEIGHTSHIP_") and f'"{name}"' not in source]
    assert unknown == []
    migrate = find(objs, "Job", "-migrate")
    assert migrate["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert migrate["spec"]["template"]["spec"]["containers"][0]["command"] == ["weightship-controlplane", "migrate"]


def test_service_accounts_carry_the_irsa_role() -> None:
    objs = objects(SCENARIOS["eks-example"])
    account = find(objs, "ServiceAccount", "-controlplane")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == (
        "arn:aws:iam::123456789012:role/weightship-controlplane"
    )
    pod = find(objs, "Deployment", "-controlplane")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert "annotations" not in find(objs, "ServiceAccount", "-agent")["metadata"]


def test_agent_env_names_only_settings_the_agent_reads() -> None:
    daemonset = find(objects(REQUIRED), "DaemonSet", "-agent")
    agent = next(c for c in containers(daemonset) if c["name"] == "agent")
    known = {f.name for f in fields(AgentConfig)} | set(LABEL_KEYS) | {"token_file", "config"}
    unknown = [
        n
        for n in env_names(agent)
        if n.startswith("WEIGHTSHIP_AGENT_") and n.removeprefix("WEIGHTSHIP_AGENT_").lower() not in known
    ]
    assert unknown == []


def test_agent_keeps_its_data_and_identity_in_the_host_directory() -> None:
    pod = find(objects(REQUIRED), "DaemonSet", "-agent")["spec"]["template"]["spec"]
    agent = next(c for c in pod["containers"] if c["name"] == "agent")
    env = {e["name"]: e for e in agent["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"]["hostPath"]["path"] == "/var/lib/weightship"
    assert {"name": "data", "mountPath": "/var/lib/weightship"} in agent["volumeMounts"]
    assert env["WEIGHTSHIP_AGENT_DATA_DIR"]["value"] == "/var/lib/weightship"  # same path as on the node
    assert env["WEIGHTSHIP_AGENT_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The enrolment token arrives as a file from its Secret, never as a plain value.
    assert env["WEIGHTSHIP_AGENT_TOKEN_FILE"]["value"] == "/etc/weightship/enrolment/token"
    assert volumes["enrolment"]["secret"]["secretName"] == "weightship-enrolment"
    assert "WEIGHTSHIP_AGENT_TOKEN" not in env
    assert "WEIGHTSHIP_TOKEN" not in env


def test_model_server_mount_path_is_stated_in_notes_values_and_docs() -> None:
    notes = render(REQUIRED)["weightship/templates/NOTES.txt"]
    assert (
        "hostPath /var/lib/weightship/versions  ->  mountPath /var/lib/weightship/versions  (readOnly: true)" in notes
    )
    assert "unix:/run/weightship/agent.sock" in notes
    assert "MODEL SERVERS mount <hostDataDir>/versions READ-ONLY at the" in (CHART / "values.yaml").read_text()
    docs = DOCS.read_text()
    assert "/var/lib/weightship/versions" in docs
    assert "readOnly: true" in docs
    moved = render(merged(REQUIRED, {"agent": {"hostDataDir": "/mnt/nvme/weightship/"}}))[
        "weightship/templates/NOTES.txt"
    ]
    assert "mountPath /mnt/nvme/weightship/versions  (readOnly: true)" in moved


def operator_rules(values: dict[str, Any]) -> dict[str, set[str]]:
    """resource -> verbs the operator is granted where ModelRollouts live."""
    objs = objects(values)
    kinds = ("ClusterRole", "Role")
    granted: dict[str, set[str]] = {}
    for _, obj in objs:
        if obj["kind"] in kinds and obj["metadata"]["name"].endswith("-operator"):
            for rule in obj["rules"]:
                for resource in rule["resources"]:
                    granted.setdefault(resource, set()).update(rule["verbs"])
    return granted


def test_operator_rbac_is_least_privilege() -> None:
    granted = operator_rules(REQUIRED)
    assert granted == {  # what the operator sends (test_rbac.py checks each request and each verb)
        "modelrollouts": {"get", "list", "watch"},
        "modelrollouts/status": {"patch"},
        "replicasets": {"list", "create", "patch", "delete"},
        "events": {"create"},
    }
    assert "services" in operator_rules(merged(REQUIRED, {"operator": {"trafficRouter": "service"}}))
    assert "httproutes" in operator_rules(merged(REQUIRED, {"operator": {"trafficRouter": "gatewayapi"}}))
    objs = objects(REQUIRED)
    leader = find(objs, "Role", "-operator-leader")
    assert leader["metadata"]["namespace"] == NAMESPACE
    assert {"leases"} <= {r for rule in leader["rules"] for r in rule["resources"]}
    for _, obj in objs:
        for rule in obj.get("rules", []):
            assert "*" not in rule["verbs"], obj["metadata"]["name"]
            assert "*" not in rule["resources"], obj["metadata"]["name"]
    operator = find(objs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert operator["command"] == ["weightship-operator"]


def test_namespaced_operator_gets_a_role_per_watched_namespace() -> None:
    objs = objects(SCENARIOS["everything-else"])
    roles = sorted(
        o["metadata"]["namespace"]
        for _, o in objs
        if o["kind"] == "Role" and o["metadata"]["name"].endswith("-operator")
    )
    assert roles == ["models-a", "models-b"]
    assert not [o for _, o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-operator")]


def test_cache_tiers_chain_cluster_to_region() -> None:
    objs = objects(SCENARIOS["everything-else"])
    env = {
        tier: {
            e["name"]: e.get("value")
            for e in find(objs, "StatefulSet", f"-cache-{tier}")["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        for tier in ("cluster", "region")
    }
    assert env["cluster"]["WEIGHTSHIP_AGENT_ROLE"] == "cache"
    assert env["cluster"]["WEIGHTSHIP_AGENT_TIER"] == "cluster"
    assert env["cluster"]["WEIGHTSHIP_AGENT_UPSTREAM"] == f"http://ws-weightship-cache-region.{NAMESPACE}.svc:7071"
    assert "WEIGHTSHIP_AGENT_UPSTREAM" not in env["region"]  # the origin
    node = next(c for c in containers(find(objs, "DaemonSet", "-agent")) if c["name"] == "agent")
    node_env = {e["name"]: e.get("value") for e in node["env"]}
    assert node_env["WEIGHTSHIP_AGENT_CLUSTER_CACHE"] == f"http://ws-weightship-cache-cluster.{NAMESPACE}.svc:7071"
    assert not [o for _, o in objects(REQUIRED) if o["kind"] == "StatefulSet"]


def test_autoscaling_examples_scale_on_queue_depth() -> None:
    keda = find(objects(SCENARIOS["eks-example"]), "ScaledObject", "chat-queue-depth")
    assert "weightship_serve_queue_depth" in keda["spec"]["triggers"][0]["metadata"]["query"]
    hpa = find(objects(SCENARIOS["everything-else"]), "HorizontalPodAutoscaler", "chat-queue-depth")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "weightship_serve_queue_depth"
    with pytest.raises(helm.HelmRenderError, match="enable one"):
        render(merged(SCENARIOS["everything-else"], {"autoscaling": {"keda": {"enabled": True}}}))


class _NodeApi(BaseHTTPRequestHandler):
    """Answers GET /api/v1/nodes/gpu-1 like an API server; anything else is 404."""

    node: ClassVar[dict[str, Any]] = {
        "kind": "Node",
        "metadata": {
            "name": "gpu-1",
            "labels": {
                "topology.kubernetes.io/region": "eu-west-1",
                "topology.kubernetes.io/zone": "eu-west-1b",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            },
        },
    }

    def do_GET(self) -> None:
        found = self.path == "/api/v1/nodes/gpu-1" and self.headers.get("Authorization") == "Bearer sa-token"
        body = json.dumps(self.node if found else {"kind": "Status", "code": 404}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def node_api() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _NodeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def run_script(script: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The init container's command, in a process with only ``env`` (and PATH)."""
    return subprocess.run(
        [sys.executable, str(script), str(out)],
        env={"PATH": os.environ.get("PATH", ""), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_node_labels_become_agent_labels(node_api: str, tmp_path: Path) -> None:
    """The init step, as the chart ships it, writes a config file the real agent accepts."""
    objs = objects(merged(REQUIRED, {"clusterName": "gpu-prod"}))
    script = find(objs, "ConfigMap", "-agent")["data"]["node-labels.py"]
    init = next(c for c in containers(find(objs, "DaemonSet", "-agent")) if c["name"] == "node-labels")
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    (tmp_path / "node-labels.py").write_text(script)
    (tmp_path / "token").write_text("sa-token\n")
    env.update(NODE_NAME="gpu-1", KUBERNETES_API_URL=node_api, KUBERNETES_TOKEN_FILE=str(tmp_path / "token"))
    out = tmp_path / "agent.json"
    done = run_script(tmp_path / "node-labels.py", out, env)
    assert done.returncode == 0, done.stderr
    config = load_config(["--config", str(out), "--control-plane", "http://cp:8080", "--name", "gpu-1"], environ={})
    assert config.labels.region == "eu-west-1"
    assert config.labels.zone == "eu-west-1b"
    assert config.labels.gpu_type == "NVIDIA-H100-80GB-HBM3"
    assert config.labels.cluster == "gpu-prod"
    assert config.labels.rack == "default"  # not mapped: the agent's default

    env["NODE_NAME"] = "gpu-2"  # not there: a clear error, non-zero, no config written
    missing = tmp_path / "missing.json"
    failed = run_script(tmp_path / "node-labels.py", missing, env)
    assert failed.returncode == 1
    assert "cannot read node gpu-2" in failed.stderr
    assert not missing.exists()
