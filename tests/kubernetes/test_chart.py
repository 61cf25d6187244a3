"""The Helm chart, rendered by Helm's own Go SDK and checked against Kubernetes' own schemas.

``helm-python-sdk`` binds Helm's Go SDK (template engine, ``required``/``fail``, values schema, lint),
so what renders here renders the same under ``helm install``. Every rendered object is validated
strictly (unknown fields are errors) against the OpenAPI schemas of its kind for the oldest and the
newest Kubernetes release the chart supports (``kubernetes-validate``, offline). Objects of kinds
that other projects define (Prometheus Operator, KEDA) are checked against the subset of their
CRD schema this chart writes, kept below; ModelRollouts against our CRD
(``crds/modelrollout.yaml``), which must be there.

Rendered with the release name and namespace of ``docs/kubernetes.md``'s ``helm install`` line, so
the object names a test checks are the ones the docs tell users to type.
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
import pytest
import yaml

from agent.config import LABEL_KEYS, AgentConfig, load_config
from tests.kubernetes.chart_parts import (
    CHART,
    CRD,
    DATA_DIR,
    DOCS,
    NAMESPACE,
    RELEASE,
    REPO,
    REQUIRED,
    find,
    merged,
    objects,
    render,
    validate,
)
from tests.kubernetes.rbac import Rbac, attributes, service_account_user

FULLNAME = RELEASE if "weightship" in RELEASE else f"{RELEASE}-weightship"


def eks_values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "examples" / "eks-values.yaml").read_text())
    return loaded


# Every switch in the other position, so every template and branch renders in some scenario.
EVERYTHING_ELSE = {
    "controlplane": {
        "migrations": {"mode": "initContainer"},
        "store": {"s3": {"endpointUrl": "https://minio.storage:9000", "credentialsSecretName": "minio"}},
        "secretName": "weightship-controlplane",
    },
    "agent": {"enrolmentSecretName": "weightship-enrolment"},
    "bootstrap": {"existingSecret": "weightship-credentials"},
    "caches": {"enabled": True, "region": {"enabled": True}},
    "operator": {
        "trafficRouter": "service",
        "watchNamespaces": ["models-a", "models-b"],
        "tokenSecretName": "weightship-operator",
    },
    "autoscaling": {"scaleTargetRef": {"name": "chat"}, "hpa": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True}},
    "signing": {"policy": {"models": {"llama": {"require_signature": False}}}},
}

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": REQUIRED,
    "eks-example": eks_values(),
    "everything-else": merged(REQUIRED, EVERYTHING_ELSE),
}


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """All containers (init ones too) of a workload object."""
    spec = obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_names(container: dict[str, Any]) -> list[str]:
    return [e["name"] for e in container.get("env", [])]


# --- the subset of other projects' CRD schemas that this chart writes --------------------------


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
    templates = {str(p.relative_to(CHART)) for p in (CHART / "templates").rglob("*.yaml")}
    assert templates - rendered == set()


def test_crd_is_a_valid_custom_resource_definition() -> None:
    assert CRD.exists(), f"{CRD.relative_to(REPO)} is missing: the chart must ship the ModelRollout CRD"
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
    # No Secret of the user's but the database's: the signing key and the tokens are bootstrapped.
    assert env["WEIGHTSHIP_URL_SIGNING_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{FULLNAME}-bootstrap",
        "key": "url-signing-key",
    }
    assert "WEIGHTSHIP_ADMIN_TOKEN" not in env
    assert env["WEIGHTSHIP_BOOTSTRAP_TOKENS_DIR"]["value"] == "/etc/weightship/bootstrap"
    given = find(objects(SCENARIOS["everything-else"]), "Deployment", "-controlplane")["spec"]["template"]["spec"]
    given_env = {e["name"]: e for e in given["containers"][0]["env"]}
    assert given_env["WEIGHTSHIP_URL_SIGNING_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "weightship-controlplane"
    assert given_env["WEIGHTSHIP_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
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
    assert volumes["data"]["hostPath"]["path"] == DATA_DIR
    assert {"name": "data", "mountPath": DATA_DIR} in agent["volumeMounts"]
    assert env["WEIGHTSHIP_AGENT_DATA_DIR"]["value"] == DATA_DIR  # same path as on the node
    assert env["WEIGHTSHIP_AGENT_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The enrolment token arrives as a file from its Secret, never as a plain value.
    assert env["WEIGHTSHIP_AGENT_TOKEN_FILE"]["value"] == "/etc/weightship/enrolment/token"
    assert volumes["enrolment"]["secret"]["secretName"] == f"{FULLNAME}-bootstrap"
    assert volumes["enrolment"]["secret"]["items"] == [{"key": "agent", "path": "token"}]
    assert "WEIGHTSHIP_AGENT_TOKEN" not in env
    assert "WEIGHTSHIP_TOKEN" not in env


def test_model_server_mount_path_is_stated_in_notes_values_and_docs() -> None:
    notes = render(REQUIRED)["weightship/templates/NOTES.txt"]
    assert f"hostPath {DATA_DIR}/versions  ->  mountPath {DATA_DIR}/versions  (readOnly: true)" in notes
    assert "unix:/run/weightship/agent.sock" in notes
    assert "MODEL SERVERS mount <hostDataDir>/versions READ-ONLY at the" in (CHART / "values.yaml").read_text()
    docs = DOCS.read_text()
    assert f"{DATA_DIR}/versions" in docs
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
    assert env["cluster"]["WEIGHTSHIP_AGENT_UPSTREAM"] == f"http://{FULLNAME}-cache-region.{NAMESPACE}.svc:7071"
    assert "WEIGHTSHIP_AGENT_UPSTREAM" not in env["region"]  # the origin
    # A cache enrols with the token minted for caches: the role is bound to it, never self-declared.
    cache_volumes = {v["name"]: v for v in find(objs, "StatefulSet", "-cache-cluster")["spec"]["template"]["spec"]["volumes"]}
    assert cache_volumes["enrolment"]["secret"]["items"] == [{"key": "cache", "path": "token"}]
    node = next(c for c in containers(find(objs, "DaemonSet", "-agent")) if c["name"] == "agent")
    node_env = {e["name"]: e.get("value") for e in node["env"]}
    assert node_env["WEIGHTSHIP_AGENT_CLUSTER_CACHE"] == f"http://{FULLNAME}-cache-cluster.{NAMESPACE}.svc:7071"
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
    # ...and the API server lets the agent's ServiceAccount make that request (chart RBAC, evaluated).
    account = find(objs, "ServiceAccount", "-agent")["metadata"]
    sent = attributes("GET", "/api/v1/nodes/gpu-1", {}, *service_account_user(NAMESPACE, account["name"]))
    assert Rbac([o for _, o in objs]).authorize(sent), f"the chart does not let {sent.user} get nodes"
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


# --- the first hour on EKS ----------------------------------------------------------------------


def docs_created_secrets() -> set[str]:
    """The Secrets docs/kubernetes.md tells users to create before ``helm install``."""
    return set(re.findall(r"kubectl -n \S+ create secret generic (\S+)", DOCS.read_text()))


def referenced_secrets(objs: list[tuple[str, dict[str, Any]]]) -> set[str]:
    """Every Secret a rendered pod reads (variables and volumes), hooks included."""
    names: set[str] = set()
    for _, obj in objs:
        spec = obj.get("spec", {})
        pod = spec.get("template", {}).get("spec") if "template" in spec else spec if obj["kind"] == "Pod" else None
        if not pod:
            continue
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    names.add(ref["name"])
        names |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    return names


@pytest.mark.parametrize("scenario", ["defaults", "eks-example"])
def test_install_needs_only_the_secrets_the_docs_create_first(scenario: str) -> None:
    """``helm install --wait`` cannot hang on a Secret nobody made: each is the chart's own or made before it."""
    objs = objects(SCENARIOS[scenario])
    rendered = {o["metadata"]["name"] for _, o in objs if o["kind"] == "Secret"}
    assert rendered == {f"{FULLNAME}-bootstrap"}
    assert referenced_secrets(objs) - rendered <= docs_created_secrets() == {"weightship-database"}


def test_bootstrap_secret_is_generated_once_and_kept() -> None:
    objs = objects(REQUIRED)
    secret = find(objs, "Secret", "-bootstrap")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert set(secret["data"]) == {"admin", "agent", "cache", "operator", "url-signing-key"}
    template = (CHART / "templates" / "bootstrap-secret.yaml").read_text()
    assert 'lookup "v1" "Secret"' in template  # an upgrade reads the values back instead of new ones
    other = find(objects(REQUIRED), "Secret", "-bootstrap")
    assert other["data"]["agent"] != secret["data"]["agent"]  # random per install, never a constant
    # Who uses which token: the agents enrol with `agent`, the operator calls with `operator`.
    operator = find(objs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    token = next(e for e in operator["env"] if e["name"] == "WEIGHTSHIP_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-bootstrap", "key": "operator"}
    cp = find(objs, "Deployment", "-controlplane")["spec"]["template"]["spec"]
    (bootstrap,) = [v for v in cp["volumes"] if v["name"] == "bootstrap"]
    assert {i["key"]: i["path"] for i in bootstrap["secret"]["items"]} == {
        "admin": "admin",
        "agent": "agent",
        "cache": "cache",
        "operator": "operator",
    }
    # A Secret of the user's replaces it everywhere (Argo CD, helm template: no lookup there).
    given = objects(merged(REQUIRED, {"bootstrap": {"existingSecret": "mine"}}))
    assert not [o for _, o in given if o["kind"] == "Secret"]
    assert referenced_secrets(given) == {"mine", "weightship-database"}


def test_helm_test_hook_checks_controlplane_agent_and_operator() -> None:
    objs = objects(REQUIRED)
    pod = find(objs, "Pod", "-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert find(objs, "ConfigMap", "-test")["metadata"]["annotations"]["helm.sh/hook"] == "test"
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["WEIGHTSHIP_URL"]["value"] == f"http://{FULLNAME}-controlplane.{NAMESPACE}.svc:8080"
    assert env["WEIGHTSHIP_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "operator"
    assert env["WEIGHTSHIP_TEST_OPERATOR_URL"]["value"] == f"http://{FULLNAME}-operator.{NAMESPACE}.svc:8081/healthz"
    service = find(objs, "Service", "-operator")
    assert service["spec"]["ports"][0]["targetPort"] == "health"


def irsa_service_accounts_in_docs() -> list[tuple[str, str]]:
    """(namespace, name) of every ServiceAccount docs/kubernetes.md binds an IAM role to."""
    found = []
    for command in re.findall(r"eksctl create iamserviceaccount.*?(?=\n\n|\n```)", DOCS.read_text(), re.DOTALL):
        namespace = re.search(r"--namespace (\S+)", command)
        name = re.search(r"--name (\S+)", command)
        assert namespace, command
        assert name, command
        found.append((namespace[1], name[1]))
    return found


def test_every_serviceaccount_the_docs_bind_an_iam_role_to_exists() -> None:
    accounts = irsa_service_accounts_in_docs()
    assert accounts, "docs/kubernetes.md binds no IAM role (eksctl create iamserviceaccount)"
    rendered = {
        (o["metadata"]["namespace"], o["metadata"]["name"]): o
        for _, o in objects(SCENARIOS["eks-example"])
        if o["kind"] == "ServiceAccount"
    }
    for account in accounts:
        assert account in rendered, f"docs bind an IAM role to {account}; the chart makes {sorted(rendered)}"
    assert "eks.amazonaws.com/role-arn" in rendered[(NAMESPACE, f"{FULLNAME}-controlplane")]["metadata"]["annotations"]


# Node scheduling as the scheduler evaluates it: nodeSelector (all), required nodeAffinity (terms
# ORed, expressions in a term ANDed) and taints with effect NoSchedule/NoExecute (each tolerated).


def _expression_matches(expr: dict[str, Any], labels: dict[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values", [])
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        if key not in labels:
            return False
        have, want = int(labels[key]), int(values[0])
        return have > want if op == "Gt" else have < want
    raise AssertionError(f"unknown operator {op}")


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def schedules_on(pod: dict[str, Any], node: dict[str, Any]) -> bool:
    """Whether the scheduler may place ``pod`` (a pod spec) on ``node`` (labels and taints only)."""
    labels: dict[str, str] = node["metadata"].get("labels", {})
    if any(labels.get(k) != v for k, v in pod.get("nodeSelector", {}).items()):
        return False
    required = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None:
        terms = required["nodeSelectorTerms"]
        if not any(all(_expression_matches(e, labels) for e in t.get("matchExpressions", [])) for t in terms):
            return False
    taints = [t for t in node.get("spec", {}).get("taints", []) if t["effect"] in ("NoSchedule", "NoExecute")]
    return all(_tolerates(pod.get("tolerations", []), t) for t in taints)


def node(labels: dict[str, str], taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    base = {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64", "topology.kubernetes.io/zone": "eu-west-1a"}
    return {"metadata": {"labels": {**base, **labels}}, "spec": {"taints": taints or []}}


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
NODES: dict[str, tuple[dict[str, Any], bool]] = {
    # Karpenter: its well-known labels, an instance type the chart's list may not know yet.
    "karpenter": (
        node(
            {
                "karpenter.sh/nodepool": "gpu",
                "karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia",
                "karpenter.k8s.aws/instance-gpu-name": "h200",
                "node.kubernetes.io/instance-type": "p5x.future",
            },
            [GPU_TAINT],
        ),
        True,
    ),
    # A managed node group with only the NVIDIA device plugin: instance type and node group, nothing else.
    "managed-node-group": (
        node(
            {
                "eks.amazonaws.com/nodegroup": "gpu-a10g",
                "eks.amazonaws.com/capacityType": "ON_DEMAND",
                "node.kubernetes.io/instance-type": "g5.12xlarge",
            },
            [GPU_TAINT],
        ),
        True,
    ),
    # GPU Feature Discovery on a node whose instance type says nothing.
    "gpu-feature-discovery": (
        node({"nvidia.com/gpu.present": "true", "node.kubernetes.io/instance-type": "custom-gpu"}, [GPU_TAINT]),
        True,
    ),
    "eks-auto-mode": (
        node({"eks.amazonaws.com/instance-gpu-manufacturer": "nvidia", "node.kubernetes.io/instance-type": "g6.xlarge"}),
        True,
    ),
    # Not GPU nodes: no agent.
    "cpu-node-group": (
        node({"eks.amazonaws.com/nodegroup": "system", "node.kubernetes.io/instance-type": "m6i.large"}),
        False,
    ),
    "karpenter-cpu": (
        node({"karpenter.sh/nodepool": "general", "node.kubernetes.io/instance-type": "c7g.xlarge"}),
        False,
    ),
    # GFD says no GPU: only the instance type could still say yes, and m7i does not.
    "gfd-without-gpu": (
        node({"nvidia.com/gpu.present": "false", "node.kubernetes.io/instance-type": "m7i.2xlarge"}),
        False,
    ),
}


@pytest.mark.parametrize("scenario", ["defaults", "eks-example"])
@pytest.mark.parametrize("case", sorted(NODES))
def test_agent_lands_on_gpu_nodes_as_stock_eks_labels_them(scenario: str, case: str) -> None:
    pod = find(objects(SCENARIOS[scenario]), "DaemonSet", "-agent")["spec"]["template"]["spec"]
    the_node, gpu = NODES[case]
    assert schedules_on(pod, the_node) is gpu


def test_node_matcher_follows_the_schedulers_rules() -> None:
    """The matcher itself: terms ORed, expressions ANDed, taints need a toleration of their effect."""
    terms = [
        {"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}, {"key": "b", "operator": "Exists"}]},
        {"matchExpressions": [{"key": "c", "operator": "Gt", "values": ["4"]}]},
    ]
    required = {"nodeSelectorTerms": terms}
    pod: dict[str, Any] = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}}
    assert schedules_on(pod, node({"a": "1", "b": ""}))
    assert not schedules_on(pod, node({"a": "1"}))
    assert schedules_on(pod, node({"c": "5"}))
    assert not schedules_on(pod, node({"c": "4"}))
    assert not schedules_on(pod, node({"a": "1", "b": ""}, [GPU_TAINT]))
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}]
    assert not schedules_on(pod, node({"a": "1", "b": ""}, [GPU_TAINT]))
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert schedules_on(pod, node({"a": "1", "b": ""}, [GPU_TAINT, {**GPU_TAINT, "effect": "NoExecute"}]))


def test_agent_data_is_on_instance_store_not_the_root_volume() -> None:
    pod = find(objects(REQUIRED), "DaemonSet", "-agent")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"]["hostPath"]["path"] == DATA_DIR
    # The pod does not start where the instance store is not mounted (the kubelet checks type Directory)...
    assert volumes["disk"]["hostPath"] == {"path": "/mnt/k8s-disks/0", "type": "Directory"}
    prepare = next(c for c in pod["initContainers"] if c["name"] == "prepare-host-dirs")
    assert "disk" in {m["name"] for m in prepare["volumeMounts"]}
    # ...instead of creating its directory on the root EBS volume.
    assert not DATA_DIR.startswith(("/var/", "/opt/", "/home/"))
    assert "#data-directory" in (CHART / "values.yaml").read_text()
    assert "## Data directory" in DOCS.read_text()


def test_default_agent_stages_what_its_pods_ask_for() -> None:
    """No deployment is named by default: each node stages what its pods and rollouts ask for."""
    agent = next(c for c in containers(find(objects(REQUIRED), "DaemonSet", "-agent")) if c["name"] == "agent")
    assert "WEIGHTSHIP_AGENT_DEPLOYMENTS" not in env_names(agent)
    assert "--deployment" not in agent.get("args", []) + agent["command"]
    assert "deployments" not in yaml.safe_load((CHART / "examples" / "eks-values.yaml").read_text())["agent"]


LONG_RUNNING = ("Deployment", "StatefulSet", "DaemonSet")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_long_running_container_has_liveness_and_readiness_probes(scenario: str) -> None:
    for _, obj in objects(SCENARIOS[scenario]):
        if obj["kind"] in LONG_RUNNING:
            for container in obj["spec"]["template"]["spec"]["containers"]:
                name = f"{obj['kind']} {obj['metadata']['name']} container {container['name']}"
                assert "livenessProbe" in container, name
                assert "readinessProbe" in container, name


@pytest.mark.parametrize("suffix", ["-controlplane", "-operator", "-cache-cluster", "-cache-region"])
def test_replicated_components_have_a_disruption_budget_and_spread(suffix: str) -> None:
    objs = objects(SCENARIOS["everything-else"])
    workload = next(o for _, o in objs if o["kind"] in LONG_RUNNING and o["metadata"]["name"].endswith(suffix))
    budget = find(objs, "PodDisruptionBudget", suffix)
    assert budget["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
    assert budget["spec"]["maxUnavailable"] == 1  # never blocks a drain, even with one replica
    anti = workload["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    spread = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert {t["podAffinityTerm"]["topologyKey"] for t in spread} == {
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    }
    for term in spread:
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]


def test_users_get_modelrollouts_through_the_aggregated_view_edit_admin_roles() -> None:
    def granted(aggregate_to: str) -> dict[str, set[str]]:
        verbs: dict[str, set[str]] = {}
        for _, obj in objects(REQUIRED):
            labels = obj["metadata"].get("labels", {})
            if obj["kind"] == "ClusterRole" and labels.get(f"rbac.authorization.k8s.io/aggregate-to-{aggregate_to}"):
                for rule in obj["rules"]:
                    assert rule["apiGroups"] == ["weightship.io"]
                    for resource in rule["resources"]:
                        verbs.setdefault(resource, set()).update(rule["verbs"])
        return verbs

    read = {"get", "list", "watch"}
    write = {"create", "update", "patch", "delete", "deletecollection"}
    assert granted("view") == {"modelrollouts": read, "modelrollouts/status": read, "modelrollouts/scale": read}
    assert granted("edit") == {
        "modelrollouts": read | write,
        "modelrollouts/status": read,
        "modelrollouts/scale": read | {"update", "patch"},
    }
    assert granted("admin") == {**granted("edit"), "modelrollouts/status": read | {"update", "patch"}}


def test_autoscaling_example_targets_the_docs_modelrollout_in_its_namespace() -> None:
    (example,) = [
        doc
        for block in re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL)
        for doc in yaml.safe_load_all(block)
        if isinstance(doc, dict) and doc.get("kind") == "ModelRollout"
    ]
    keda = find(objects(SCENARIOS["eks-example"]), "ScaledObject", "-queue-depth")
    assert keda["metadata"]["namespace"] == example["metadata"]["namespace"]
    assert keda["spec"]["scaleTargetRef"] == {
        "apiVersion": example["apiVersion"],
        "kind": "ModelRollout",
        "name": example["metadata"]["name"],
    }
    assert f'namespace="{example["metadata"]["namespace"]}"' in keda["spec"]["triggers"][0]["metadata"]["query"]
    # The CRD has the scale subresource the ScaledObject (an HPA underneath) needs.
    crd = yaml.safe_load(CRD.read_text())
    served = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    assert served["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


def test_troubleshooting_table_names_every_reason_the_operator_sets() -> None:
    """Each condition reason the operator can write on a ModelRollout has a row in the docs' table."""
    from controlplane.rollouts.steps import AbortReason

    code = {p.name: p.read_text() for p in (REPO / "controlplane" / "k8s").glob("*.py")}
    reasons = {v for k, v in vars(AbortReason).items() if k.isupper()}
    reasons |= set(re.findall(r'Failure\("(\w+)"', code["driver.py"]))
    reasons |= set(re.findall(r'_refuse\(obj, "(\w+)"', code["driver.py"]))
    reasons |= {r for pair in re.findall(r'(?:reason|why) = "(\w+)" if .* else "(\w+)"', code["status.py"]) for r in pair}
    # KubeApiError's reason is the API server's own: the ones a refused write carries, and no answer at all.
    assert '"KubernetesUnreachable" if exc.status == 0 else exc.reason' in code["driver.py"]
    reasons |= {"KubernetesUnreachable", "Forbidden", "Invalid"}
    assert {"AnalysisFailed", "ControlPlaneUnreachable", "UnknownVersion", "PodsNotReady", "RolledBackOutside"} <= reasons
    docs = DOCS.read_text()
    table = docs[docs.index("## Troubleshooting") :].split("\n## ", 1)[0]
    missing = sorted(r for r in reasons if f"`{r}`" not in table)
    assert missing == [], f"docs/kubernetes.md#troubleshooting has no row for reason(s) {missing}"
