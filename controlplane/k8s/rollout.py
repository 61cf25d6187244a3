"""The ``ModelRollout`` resource: its names, the labels the operator puts on ReplicaSets, its checked spec.

A ``ModelRollout`` names a control-plane deployment (whose pointer the agents follow), the version
to roll out (a label of the deployment's model or a digest), the model-server pod template and its
replica count, and the engine's steps (``docs/rollouts.md``)::

    apiVersion: weightship.io/v1alpha1
    kind: ModelRollout
    metadata: {name: chat, namespace: models}
    spec:
      deployment: chat-prod
      version: v7
      replicas: 4
      template: {metadata: {labels: {app: chat}}, spec: {containers: [...]}}
      steps: [{setWeight: 25}, {analysis: {...}}, {pause: {duration: 5m}}]
      rollbackWindowSeconds: 600
      scaleDownDelaySeconds: 30
      trafficRouting: {services: {stable: chat-stable, canary: chat-canary}}   # optional

The CRD's OpenAPI schema refuses malformed objects at the API server; :func:`parse_rollout`
checks again (the engine's own parser for the steps) so an object that slipped past an older CRD
gets a status condition naming the field instead of a crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.rollouts.spec import RolloutSpecError
from weightship.modelrollout import (  # the shared contract: the CLI's --kube mode speaks it too
    ANNOTATION_DIGEST,
    ANNOTATION_VERB,
    GROUP,
    LABEL_DIGEST,
    LABEL_ROLE,
    LABEL_ROLLOUT,
    LABEL_TEMPLATE_HASH,
    PLURAL,
    VERSION,
)

__all__ = [
    "ANNOTATION_DIGEST",
    "ANNOTATION_VERB",
    "GROUP",
    "LABEL_DIGEST",
    "LABEL_ROLE",
    "LABEL_ROLLOUT",
    "LABEL_TEMPLATE_HASH",
    "PLURAL",
    "VERSION",
    "ModelRolloutSpec",
    "TrafficRouting",
    "digest_label",
    "parse_rollout",
]


def digest_label(digest: str) -> str:
    """The label value naming ``digest`` (``sha256:<hex>`` → first 32 hex digits)."""
    return digest.removeprefix("sha256:")[:32]


@dataclass(frozen=True)
class TrafficRouting:
    """An optional traffic router: two Services' selectors, or a Gateway API HTTPRoute's weights."""

    stable_service: str
    canary_service: str
    http_route: str | None = None


@dataclass(frozen=True)
class ModelRolloutSpec:
    """A checked ``ModelRollout`` spec; ``steps`` stays in its JSON form for the engine's parser."""

    deployment: str
    version: str
    replicas: int
    template: Mapping[str, Any]
    steps: list[Any] = field(default_factory=list)
    progress_deadline_seconds: int | None = None
    rollback_window_seconds: int = 600
    scale_down_delay_seconds: int = 30
    agent_port: int | None = None
    agent_image: str | None = None
    traffic: TrafficRouting | None = None

    @property
    def is_digest(self) -> bool:
        """Whether ``version`` is a digest (no lookup needed) rather than a label."""
        return self.version.startswith("sha256:")

    def engine_spec(self, digest: str) -> dict[str, Any]:
        """The engine's spec (``controlplane.rollouts.spec.parse_spec`` input) for the resolved ``digest``."""
        data: dict[str, Any] = {"version": digest, "steps": self.steps}
        if self.progress_deadline_seconds is not None:
            data["progressDeadlineSeconds"] = self.progress_deadline_seconds
        return data


def _int(spec: Mapping[str, Any], key: str, default: int | None, minimum: int) -> int:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RolloutSpecError(f"spec.{key}: expected a whole number >= {minimum}, got {value!r}")
    return value


def parse_rollout(spec: object) -> ModelRolloutSpec:
    """Check a ``ModelRollout``'s ``spec``; raise ``RolloutSpecError`` naming the field."""
    if not isinstance(spec, Mapping):
        raise RolloutSpecError(f"spec: expected a mapping, got {type(spec).__name__}")
    for key in ("deployment", "version"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise RolloutSpecError(f"spec.{key}: required, a non-empty string")
    template: Mapping[str, Any] = spec.get("template") or {}
    containers = template.get("spec", {}).get("containers") if isinstance(template, Mapping) else None
    if not isinstance(containers, list) or not containers:
        raise RolloutSpecError("spec.template.spec.containers: a pod template with at least one container is required")
    steps = spec.get("steps", [])
    if not isinstance(steps, list):
        raise RolloutSpecError(f"spec.steps: expected a list of steps, got {type(steps).__name__}")
    deadline = spec.get("progressDeadlineSeconds")
    agent = spec.get("agent") or {}
    traffic = None
    routing = spec.get("trafficRouting") or {}
    if "services" in routing:
        traffic = TrafficRouting(routing["services"]["stable"], routing["services"]["canary"])
    elif "httpRoute" in routing:
        route = routing["httpRoute"]
        traffic = TrafficRouting(route["stableService"], route["canaryService"], http_route=route["name"])
    return ModelRolloutSpec(
        deployment=spec["deployment"],
        version=spec["version"],
        replicas=_int(spec, "replicas", None, 1),
        template=template,
        steps=steps,
        progress_deadline_seconds=None if deadline is None else _int(spec, "progressDeadlineSeconds", None, 1),
        rollback_window_seconds=_int(spec, "rollbackWindowSeconds", 600, 0),
        scale_down_delay_seconds=_int(spec, "scaleDownDelaySeconds", 30, 0),
        agent_port=None if agent.get("port") is None else int(agent["port"]),
        agent_image=agent.get("image"),
        traffic=traffic,
    )
