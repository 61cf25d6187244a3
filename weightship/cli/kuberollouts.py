"""``ModelRollout`` resources read and acted on from outside the cluster, for ``weightship rollout --kube``.

The CLI works on a Kubernetes rollout the way it works on a fleet rollout: ``status`` reads the
resource (and its ReplicaSets, for pods per version) and shows it as a :class:`Rollout`, the
fleet's schema, so one view and one ``--json`` shape serve both; a verb sets the verb annotation
(``weightship.modelrollout``) and waits, bounded, until the operator records what it did with it:
applied, or refused with the reason (which names the verb that fits).

The official ``kubernetes`` client is an optional extra (``pip install 'weightship[kube]'``): it
is imported only when this mode is used, and its absence is one clear error. Its errors are
mapped here into ours (404 → ``NotFoundError``, 401/403 → ``AuthError``/``ForbiddenError``,
unreachable or 5xx → ``TemporaryError``), so the CLI handles them as it handles the control plane's.

In the :class:`Rollout` built from a resource, ``model`` is empty (the resource names only the
deployment), ``phase`` may also be ``Invalid`` (the operator refused the spec or its version) or
``Pending`` (no operator has looked at it yet), ``nodes`` counts ready pods per version digest and
``target_nodes`` is ``spec.replicas``.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, cast

from weightship.cli.rollout_steps import steps_of
from weightship.errors import (
    AuthError,
    ConflictError,
    ForbiddenError,
    NotFoundError,
    TemporaryError,
    ValidationError,
    WeightshipError,
)
from weightship.modelrollout import (
    ANNOTATION_DIGEST,
    ANNOTATION_VERB,
    GROUP,
    LABEL_ROLLOUT,
    PLURAL,
    VERSION,
    verb_done,
)
from weightship.schemas import Rollout, RolloutAnalysisRun, RolloutMeasurement, RolloutMetric

__all__ = ["KubeRollouts", "MissingKubernetesClient", "rollout_from_resource"]

Body = dict[str, Any]


class MissingKubernetesClient(ValidationError):
    """The ``kubernetes`` package is not installed, so ``--kube`` cannot work."""

    code = "kubernetes_client_missing"


def _kubernetes() -> Any:
    """The ``kubernetes`` package, imported now (it is an optional extra)."""
    try:
        import kubernetes  # optional extra: only the --kube mode needs it
    except ImportError:
        raise MissingKubernetesClient(
            "--kube needs the Python kubernetes client, which is not installed: "
            "pip install 'weightship[kube]' (or drop --kube to act on a fleet rollout)"
        ) from None
    return kubernetes


class KubeRollouts:
    """The ModelRollouts of one namespace, through one kubeconfig context."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        *,
        context: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        k8s = _kubernetes()
        self.api_client = api_client
        self.namespace = namespace
        self.context = context
        self._custom = k8s.client.CustomObjectsApi(api_client)
        self._apps = k8s.client.AppsV1Api(api_client)
        self._sleep = sleep
        self._clock = clock

    @classmethod
    def connect(
        cls,
        *,
        context: str | None = None,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> KubeRollouts:
        """Open ``context`` of the kubeconfig (``KUBECONFIG``/``~/.kube/config``; its current one by default).

        The namespace is ``namespace``, else the context's own, else ``default`` (as ``kubectl``).
        """
        k8s = _kubernetes()
        try:
            contexts, active = k8s.config.list_kube_config_contexts(config_file=kubeconfig)
            chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
            if chosen is None:
                names = ", ".join(sorted(str(c.get("name")) for c in contexts)) or "none"
                raise ValidationError(
                    f"the kubeconfig has no context {context!r} (it has: {names}); "
                    "pick one with --context (see `kubectl config get-contexts`)"
                )
            api_client = k8s.config.new_client_from_config(
                config_file=kubeconfig, context=chosen["name"], persist_config=False
            )
        except k8s.config.ConfigException as exc:
            raise ValidationError(
                f"cannot use the kubeconfig ({exc}); set KUBECONFIG or --kubeconfig to a valid file and pick a "
                "context with --context (see `kubectl config get-contexts`)"
            ) from None
        own_namespace = (chosen.get("context") or {}).get("namespace")
        return cls(
            api_client, namespace or own_namespace or "default", context=chosen["name"], sleep=sleep, clock=clock
        )

    def close(self) -> None:
        """Release the connection pool."""
        self.api_client.close()

    def __enter__(self) -> KubeRollouts:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- calls --------------------------------------------------------------------------------

    def _call(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Body:
        k8s = _kubernetes()
        try:
            answer = call(*args, _preload_content=False, **kwargs)
        except k8s.client.exceptions.ApiException as exc:
            raise self._mapped(exc, what) from None
        except (OSError, k8s.client.rest.urllib3.exceptions.HTTPError) as exc:
            cause = getattr(exc, "reason", None) or exc  # MaxRetryError: the last attempt's error
            raise TemporaryError(
                f"{what}: the Kubernetes API at {self.api_client.configuration.host} is unreachable ({cause}); "
                "check --context and that the cluster answers (`kubectl cluster-info`)"
            ) from None
        data = answer.data
        loaded: Body = json.loads(data) if data else {}
        return loaded

    def _mapped(self, exc: Any, what: str) -> WeightshipError:
        try:
            reason = str(json.loads(exc.body or "{}").get("message") or exc.reason)
        except ValueError:
            reason = str(exc.reason)
        where = f"context {self.context!r}, namespace {self.namespace!r}"
        if exc.status == 404:
            return NotFoundError(
                f"{what}: not found ({where}); list them with "
                f"`weightship rollout list --kube --namespace {self.namespace}`",
                code="modelrollout_not_found",
            )
        if exc.status == 401:
            return AuthError(f"{what}: the Kubernetes API refused the credentials of {where} ({reason})")
        if exc.status == 403:
            return ForbiddenError(
                f"{what}: not allowed ({reason}); ask for RBAC on modelrollouts.{GROUP} in namespace {self.namespace}"
            )
        if exc.status == 409:
            return ConflictError(f"{what}: conflict ({reason}); run the command again")
        return TemporaryError(f"{what}: the Kubernetes API answered HTTP {exc.status} ({reason})")

    def resource(self, name: str) -> Body:
        """The ModelRollout ``name`` as stored."""
        return self._call(
            f"read ModelRollout {self.namespace}/{name}",
            self._custom.get_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL, name,
        )  # fmt: skip

    def _replicasets(self, name: str) -> list[Body]:
        answer = self._call(
            f"list the ReplicaSets of ModelRollout {self.namespace}/{name}",
            self._apps.list_namespaced_replica_set,
            self.namespace,
            label_selector=f"{LABEL_ROLLOUT}={name}",
        )
        items: list[Body] = answer.get("items") or []
        return [rs for rs in items if ((rs.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLLOUT) == name]

    def get(self, name: str) -> Rollout:
        """The ModelRollout ``name`` with its pods per version, as a :class:`Rollout`."""
        return rollout_from_resource(self.resource(name), self._replicasets(name))

    def list(self) -> list[Rollout]:
        """Every ModelRollout of the namespace, newest first (without pod counts: one call)."""
        answer = self._call(
            f"list the ModelRollouts of namespace {self.namespace}",
            self._custom.list_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL,
        )  # fmt: skip
        found = [rollout_from_resource(item, []) for item in answer.get("items") or []]
        return sorted(found, key=lambda r: r.created_at, reverse=True)

    def act(self, name: str, verb: str, *, wait: float = 30.0, poll: float = 0.2) -> Rollout:
        """Ask the operator to apply ``verb`` to ModelRollout ``name``; wait up to ``wait`` s for its answer.

        Raises ``ConflictError`` (code ``rollout_verb``) with the operator's reason when it refused
        the verb, and ``TemporaryError`` when no operator answered in time (the annotation stays:
        the operator applies it when it runs).
        """
        what = f"ModelRollout {self.namespace}/{name}"
        self.resource(name)  # a missing rollout is "not found", not "the operator did not answer"
        value = f"{verb}@{int(time.time())}-{secrets.token_hex(3)}"
        patch = {"metadata": {"annotations": {ANNOTATION_VERB: value}}}
        self._call(
            f"annotate {what} with {ANNOTATION_VERB}={value}",
            self._custom.patch_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL, name, patch,
        )  # fmt: skip
        deadline = self._clock() + wait
        while True:
            status = self.resource(name).get("status") or {}
            if status.get("phase") == "Invalid":
                raise ConflictError(
                    f"{what} was refused by the operator, so it takes no verbs: {status.get('message')}; "
                    "fix its spec (kubectl apply) and try again",
                    code="rollout_verb",
                )
            if status.get("handledVerb") == value:
                result = str(status.get("verbResult") or "")
                if not result:  # the operator saw it before the rollout had a status: nothing to apply it to
                    raise ConflictError(
                        f"{what} did not apply {verb}: the rollout had not started yet; run the command again once "
                        f"`weightship rollout status {name} --kube --namespace {self.namespace}` shows a phase",
                        code="rollout_verb",
                    )
                if result != verb_done(value):
                    raise ConflictError(f"{what} refused {verb}: {result}", code="rollout_verb")
                return self.get(name)
            if self._clock() >= deadline:
                raise TemporaryError(
                    f"{what}: no operator acted on {verb} within {wait:g} s; the request stays in its "
                    f"{ANNOTATION_VERB} annotation and is applied when the operator runs: check that the "
                    f"weightship operator is running, then `weightship rollout status {name} --kube "
                    f"--namespace {self.namespace}`"
                )
            self._sleep(poll)


def _time(value: object, default: datetime) -> datetime:
    if not isinstance(value, str):
        return default
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return default
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _runs(engine: Mapping[str, Any], default: datetime) -> list[RolloutAnalysisRun]:
    runs = []
    for run in engine.get("analysisRuns") or []:
        metrics = [
            RolloutMetric(
                name=str(m.get("name")),
                phase=str(m.get("phase")),
                measurements=[
                    RolloutMeasurement(
                        index=int(x.get("index") or 0),
                        phase=str(x.get("phase")),
                        value=x.get("value"),
                        started_at=_time(x.get("takenAt"), default),
                        finished_at=_time(x.get("takenAt"), default),
                        message=str(x.get("message") or ""),
                    )
                    for x in m.get("measurements") or []
                ],
            )
            for m in run.get("metrics") or []
        ]
        runs.append(
            RolloutAnalysisRun(
                id=str(run.get("runId")),
                step_index=int(run.get("stepIndex") or 0),
                phase=str(run.get("phase")),
                metrics=metrics,
            )
        )
    return runs


def rollout_from_resource(obj: Mapping[str, Any], replicasets: list[Body]) -> Rollout:
    """A ModelRollout (and its ReplicaSets) as the fleet's :class:`Rollout` view; see the module docstring."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    engine = status.get("engine") or {}
    created = _time(meta.get("creationTimestamp"), datetime.now(UTC))
    changes = [_time(c.get("lastTransitionTime"), created) for c in status.get("conditions") or []]
    step_index = int(engine.get("stepIndex") or 0)
    completed = bool(engine.get("completed"))
    raw_steps: list[Any] = spec["steps"] if isinstance(spec.get("steps"), list) else []
    pods: dict[str, int] = {}
    for rs in replicasets:
        digest = ((rs.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_DIGEST)
        ready = int((rs.get("status") or {}).get("readyReplicas") or 0)
        if digest and ready:
            pods[digest] = pods.get(digest, 0) + ready
    # Built without validation: a resource is not bound by the fleet's rules (phase Invalid, no model).
    return Rollout.model_construct(
        id=f"{meta.get('namespace', '')}/{meta.get('name', '')}",
        deployment=str(spec.get("deployment") or ""),
        model="",
        version=str((status.get("resolved") or {}).get("digest") or spec.get("version") or ""),
        stable=engine.get("stable") or status.get("stable"),
        phase=cast(Any, str(status.get("phase") or "Pending")),  # also Invalid, Pending: see the docstring
        message=str(status.get("message") or status.get("refusal") or ""),
        completed=completed,
        aborted=bool(engine.get("abort")),
        step_index=step_index,
        steps_total=len(raw_steps),
        steps=steps_of(raw_steps, step_index, completed=completed),
        weight=float(status.get("weight") or 0),
        attempt=int(engine.get("attempt") or 0),
        analysis_runs=_runs(engine, created),
        nodes=pods,
        staged_nodes=0,
        target_nodes=int(spec.get("replicas") or 0),
        spec=dict(spec),
        status=dict(engine),
        created_at=created,
        created_by="kubernetes",
        updated_at=max(changes, default=created),
    )
