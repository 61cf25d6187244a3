"""One reconcile of a ``ModelRollout``: observe, run the engine, act, converge, store the status.

The engine (``controlplane.rollouts.engine``) decides; this driver only translates. Its memory is
the resource's ``status``: the engine's status (``status.engine``), the pointer the ReplicaSets
follow (``status.pointer``: stable, canary, share, epoch) and the resolved version. A restarted
operator reads them back and carries on where the old one stopped.

Mapping of the engine's actions:

- ``SetPointer(stable, canary, share)`` → the control plane's pointer names them (the canary at
  share 0: agents stage it) and ``status.pointer`` gets the next epoch; the traffic router, if
  any, follows (``services``: the stable and canary Services select their version's pods, weights
  stay replica shares; ``httpRoute``: the same selectors, and the route's backend weights carry
  the share while the stable ReplicaSet stays at full size).
- ``StageVersion`` → the control plane's pointer names the canary (share 0), so every node's agent
  fetches and verifies it before a canary pod needs it.
- ``MeasureMetric`` → the analysis provider measures; the engine runs again with the answer.

The engine also sees the canary's refusals: the control plane counts, per node, the loads of the
canary's digest that failed or failed validation (its model servers push these counters to their
agent); those above the baseline taken when the attempt began (``status.canaryLoads``) on a node
where it never loaded abort the rollout (``CanaryRefused``) as soon as the canary has traffic, as
the fleet driver does, instead of waiting for the progress deadline.

Then, on every reconcile whether or not the engine acted, the ReplicaSets converge on
``status.pointer`` (level-triggered, like a Deployment controller):

- the stable and canary versions each have a ReplicaSet of the current pod template (its hash is
  in the name), scaled to :func:`split_replicas` of ``spec.replicas`` and labelled with its role;
  one deleted by hand is made again; a changed replica count rescales;
- a template edit rolls: the new ReplicaSet of the same version grows by at most
  :func:`surge` pods above the wanted count, and the old one shrinks only as new pods are ready;
- a version that lost its role: the old stable becomes ``previous``, still scaled, until
  ``rollbackWindowSeconds`` pass (a rollback inside the window is a relabel, its pods never
  stopped); an aborted or replaced canary is ``retired``: scaled to 0 at once (after
  ``scaleDownDelaySeconds`` when a router moved its traffic away already), then deleted.

The control plane's pointer is read on every reconcile. When it no longer names what this rollout
set and its newest audit row is not this rollout's (``weightship rollback`` by a person, say),
the operator follows it and never fights it: ``status.pointer`` takes the control plane's
stable version, the ReplicaSets follow (the previous version's pods, kept for the window, serve at
once), the rollout is aborted (``PointerChangedExternally``) until ``retry`` or a new
``spec.version``, and the ``PointerMovedOutside`` condition and a Warning Event say who moved it.

Every write of the status carries the ``resourceVersion`` it was computed from; a 409 (someone
changed the resource, a verb annotation for example) re-reads everything and reconciles again.
The actions are idempotent, so repeating them is harmless. A reconcile that fails is reported
on the resource by :meth:`KubeRolloutDriver.report_failure` (condition ``Reconciled=False`` and an
Event), so ``kubectl describe mro`` shows a 403, a 422 or an unreachable control plane.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.k8s.kube import Body, KubeApi, KubeApiError
from controlplane.k8s.replicasets import (
    DEFAULT_WAIT_IMAGE,
    AgentPaths,
    build_replicaset,
    replicaset_name,
    split_replicas,
    surge,
    template_hash,
)
from controlplane.k8s.rollout import (
    ANNOTATION_DIGEST,
    ANNOTATION_VERB,
    LABEL_DIGEST,
    LABEL_ROLE,
    LABEL_ROLLOUT,
    ModelRolloutSpec,
    digest_label,
    parse_rollout,
)
from controlplane.k8s.status import Failure, PodCount, conditions_for, engine_status, summary
from controlplane.k8s.versions import ControlPlane, FleetCount, UnknownVersion
from controlplane.rollouts import verbs
from controlplane.rollouts.actions import MeasureMetric, SetPointer, StageVersion
from controlplane.rollouts.engine import Reconciliation, reconcile
from controlplane.rollouts.observations import FleetObservation, MeasurementResult, Observations, PointerObservation
from controlplane.rollouts.providers import ProviderRegistry, RolloutContext
from controlplane.rollouts.spec import RolloutSpec, RolloutSpecError, parse_spec
from controlplane.rollouts.status import RolloutStatus
from controlplane.rollouts.steps import AbortReason, abort
from weightship.errors import AuthError, ConflictError, ForbiddenError, NotFoundError, TemporaryError, WeightshipError
from weightship.logs import event
from weightship.modelrollout import verb_done
from weightship.schemas import Deployment

__all__ = ["ANNOTATION_SCALE_DOWN_AT", "EventSink", "KubeRolloutDriver", "failure_of"]

_log = logging.getLogger("controlplane.k8s.driver")

#: On a ReplicaSet that lost its role: when it is scaled to 0 (ISO 8601).
ANNOTATION_SCALE_DOWN_AT = "weightship.io/scale-down-at"
_CONFLICT_RETRIES = 5

#: ``(resource body, type, reason, message)`` — posts a Kubernetes Event (kopf's poster in production).
EventSink = Callable[[Body, str, str, str], None]


class _TooManyConflicts(TemporaryError):
    """Every attempt of one reconcile met a concurrent write."""


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _digest(rs: Mapping[str, Any]) -> str | None:
    return (rs.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_DIGEST)


def _role(rs: Mapping[str, Any]) -> str | None:
    return (rs.get("metadata", {}).get("labels") or {}).get(LABEL_ROLE)


def _replicas(rs: Mapping[str, Any] | None) -> int:
    return int(((rs or {}).get("spec") or {}).get("replicas") or 0)


def _ready(rs: Mapping[str, Any] | None) -> int:
    return int(((rs or {}).get("status") or {}).get("readyReplicas") or 0)


def tag(namespace: str, name: str) -> str:
    """How this rollout signs the reasons of its pointer writes (so it knows its own audit rows)."""
    return f"modelrollout {namespace}/{name}: "


def failure_of(exc: BaseException) -> Failure:
    """The condition reason and message a failed reconcile shows on the ModelRollout."""
    if isinstance(exc, KubeApiError):
        reason = "KubernetesUnreachable" if exc.status == 0 else exc.reason
        return Failure(reason, exc.message)
    if isinstance(exc, _TooManyConflicts):
        return Failure("WriteConflicts", exc.message)
    if isinstance(exc, AuthError | ForbiddenError):
        return Failure("ControlPlaneRefused", f"the control plane refused the operator's token: {exc.message}")
    if isinstance(exc, TemporaryError):
        return Failure("ControlPlaneUnreachable", exc.message)
    if isinstance(exc, WeightshipError):
        return Failure("ReconcileFailed", exc.message)
    return Failure("ReconcileFailed", f"the operator failed: {exc!r}; see its log")


class KubeRolloutDriver:
    """Reconciles ModelRollouts through the engine; one per operator process."""

    def __init__(
        self,
        kube: KubeApi,
        controlplane: ControlPlane,
        providers: ProviderRegistry,
        *,
        post_event: EventSink,
        wait_image: str = DEFAULT_WAIT_IMAGE,
        agent_paths: AgentPaths = AgentPaths(),
        clock: Callable[[], datetime] = _utc_now,
        wait_deadline: float | None = None,
    ) -> None:
        self.kube = kube
        self.controlplane = controlplane
        self.providers = providers
        self.post_event = post_event
        self.wait_image = wait_image
        self.agent_paths = agent_paths
        self.clock = clock
        self.wait_deadline = wait_deadline

    async def reconcile(self, namespace: str, name: str) -> None:
        """Reconcile one rollout; on a 409 re-read and try again (a few times, then later)."""
        for attempt in range(1, _CONFLICT_RETRIES + 1):
            try:
                await self._once(namespace, name)
                return
            except ConflictError as exc:
                event(
                    _log,
                    "rollout.conflict",
                    logging.INFO,
                    rollout=f"{namespace}/{name}",
                    attempt=attempt,
                    error=exc.message,
                )
        raise _TooManyConflicts(
            f"ModelRollout {namespace}/{name}: {_CONFLICT_RETRIES} write conflicts in a row; retrying later"
        )

    async def report_failure(self, namespace: str, name: str, exc: BaseException) -> None:
        """Show a failed reconcile on the resource: ``Reconciled=False`` and a Warning Event, once per cause."""
        failure = failure_of(exc)
        try:
            obj = await self.kube.get_rollout(namespace, name)
        except WeightshipError as read_error:  # the API itself is what fails: the log is all that is left
            event(_log, "rollout.failure_unreported", logging.WARNING, rollout=f"{namespace}/{name}",
                  reason=failure.reason, error=failure.message, why=read_error.message)  # fmt: skip
            return
        stored = obj.get("status") or {}
        before = {c.get("type"): c for c in stored.get("conditions") or []}.get("Reconciled") or {}
        if (before.get("status"), before.get("reason"), before.get("message")) == ("False", *_cut(failure)):
            return  # said already
        conditions = conditions_for(stored, self.clock(), failure=failure)
        self.post_event(obj, "Warning", failure.reason, failure.message)
        try:
            await self.kube.patch_rollout_status(namespace, name, {"conditions": conditions}, None)
        except WeightshipError as write_error:
            event(_log, "rollout.failure_unreported", logging.WARNING, rollout=f"{namespace}/{name}",
                  reason=failure.reason, error=failure.message, why=write_error.message)  # fmt: skip

    async def _once(self, namespace: str, name: str) -> None:
        obj = await self.kube.get_rollout(namespace, name)
        meta, stored = obj.get("metadata") or {}, obj.get("status") or {}
        if meta.get("deletionTimestamp"):
            return  # going: its ReplicaSets go with it (owner references), nothing to do
        now = self.clock()
        try:
            spec = parse_rollout(obj.get("spec"))
        except RolloutSpecError as exc:
            await self._refuse(obj, "InvalidSpec", exc.message)
            return
        resolved = stored.get("resolved") or {}
        if resolved.get("ref") == spec.version and resolved.get("digest"):
            digest, size = str(resolved["digest"]), int(resolved.get("size") or 0)  # labels never move
        else:
            try:
                version = await self.controlplane.resolve(spec.deployment, spec.version)
            except UnknownVersion as exc:
                await self._refuse(obj, "UnknownVersion", exc.message)
                return
            digest, size = version.digest, version.size
        try:
            engine_spec = parse_spec(spec.engine_spec(digest))
            self.providers.check_spec(engine_spec)
        except RolloutSpecError as exc:
            await self._refuse(obj, "InvalidSpec", exc.message)
            return
        status = engine_status(stored)
        verb = (meta.get("annotations") or {}).get(ANNOTATION_VERB)
        handled = stored.get("handledVerb")
        verb_note = ""
        if verb and verb != handled and status is not None:
            status, verb_note = _apply_verb(verb, engine_spec, status, now)
        replicasets = {rs["metadata"]["name"]: rs for rs in await self.kube.list_replicasets(namespace, name)}
        pointer = stored.get("pointer") or {}
        observed = PointerObservation(
            stable=pointer.get("stable"),
            canary=pointer.get("canary"),
            canary_share=float(pointer.get("share") or 0.0),
            epoch=int(pointer.get("epoch") or 0),
        )
        labels: dict[str, str] = dict(stored.get("labels") or {})
        if not spec.is_digest:
            labels[digest] = spec.version
        outside: Mapping[str, Any] | None = stored.get("outside")
        failure: Failure | None = None
        moved = None
        try:
            cp: Deployment | None = await self.controlplane.pointer(spec.deployment)
        except TemporaryError as exc:  # the pods need no control plane: converge them anyway, say it below
            cp, failure = None, failure_of(exc)
        if cp is not None:
            moved = await self._moved_outside(obj, spec, cp, observed, labels)
        if cp is not None and moved is not None:
            outside = moved
            observed = PointerObservation(cp.stable, None, 0.0, observed.epoch + 1)
            if status is not None and cp.stable != digest:
                status = replace(
                    abort(status, now, AbortReason.POINTER_CHANGED, str(moved["message"])),
                    stable=cp.stable,
                    completed=False,
                )
        refused, loads = await self._refused(spec.deployment, engine_spec, status, stored, cp)
        fleet = await self._fleet(spec, engine_spec, observed, replicasets, refused)
        measurements: tuple[MeasurementResult, ...] = ()
        for _ in range(3):  # measure, then judge with the answers, in the same reconcile
            observations = Observations(observed, fleet, size, None, measurements)
            result = reconcile(engine_spec, status, observations, now)
            wanted = [a for a in result.actions if isinstance(a, MeasureMetric)]
            if not wanted:
                break
            context = RolloutContext(f"{namespace}/{name}", spec.deployment, digest, result.status.stable)
            measurements += tuple([await self.providers.measure(a, context) for a in wanted])
        new_pointer, acted = await self._act(obj, spec, result, observed)
        if acted:
            outside = None  # this rollout moved the pointer itself since
        if acted or moved is not None:
            await self._route(namespace, spec, new_pointer)
        await self._converge(obj, spec, new_pointer, replicasets, now)
        await self._retire(namespace, replicasets, now)
        pods = _pods(name, spec, new_pointer, replicasets)
        if cp is not None:
            labels = await self._labels(cp.model, labels, new_pointer, replicasets)
        extra = {
            "labels": labels,
            "outside": dict(outside) if outside else None,
            "selector": _selector(name, new_pointer),
            "canaryLoads": loads,
        }
        await self._write(
            obj, spec, digest, size, result.status, new_pointer, verb or handled, verb_note, pods, extra, failure
        )

    async def _moved_outside(
        self,
        obj: Body,
        spec: ModelRolloutSpec,
        cp: Deployment,
        observed: PointerObservation,
        labels: Mapping[str, str],
    ) -> dict[str, Any] | None:
        """The control plane's pointer moved by someone else since this rollout set it: who, how, why."""
        if observed.stable is None or cp.stable is None or (cp.stable, cp.canary) == (observed.stable, observed.canary):
            return None
        stored = obj.get("status") or {}
        if (stored.get("outside") or {}).get("epoch") == cp.epoch:
            return None  # followed already
        meta = obj["metadata"]
        last = await self.controlplane.last_change(spec.deployment)
        if last is not None and last.reason.startswith(tag(meta["namespace"], meta["name"])):
            return None  # this rollout's own write, whose status was not stored (an interrupted reconcile)
        shown = labels.get(cp.stable) or cp.stable
        who = f"{last.actor} ({last.action}: {last.reason or 'no reason given'})" if last else "someone"
        message = (
            f"{who} moved deployment {spec.deployment}'s pointer to {shown} at epoch {cp.epoch}, outside this "
            f"ModelRollout. The operator follows it: {shown} is stable and its ReplicaSet serves; the rollout "
            "stays aborted until 'weightship rollout retry --kube' or a new spec.version"
        )
        action = last.action if last else "set"
        kind = "RolledBackOutside" if action == "rollback" else "PointerMovedOutside"
        self.post_event(obj, "Warning", kind, message)
        event(_log, "rollout.pointer_moved_outside", logging.WARNING, rollout=f"{meta['namespace']}/{meta['name']}",
              deployment=spec.deployment, stable=cp.stable, epoch=cp.epoch, action=action)  # fmt: skip
        return {"epoch": cp.epoch, "action": action, "stable": cp.stable, "message": message}

    async def _fleet(
        self,
        spec: ModelRolloutSpec,
        engine_spec: RolloutSpec,
        pointer: PointerObservation,
        replicasets: Mapping[str, Body],
        refused: tuple[str, ...] = (),
    ) -> FleetObservation:
        assigned = serving = 0
        if pointer.canary is not None:
            canary = [rs for rs in replicasets.values() if _digest(rs) == pointer.canary]
            assigned = sum(_replicas(rs) for rs in canary)
            serving = sum(_ready(rs) for rs in canary)
        count = FleetCount(spec.replicas, 0)
        if engine_spec.prefetch_percent:
            count = await self.controlplane.fleet(spec.deployment, engine_spec.version)
        return FleetObservation(count.target_nodes, count.staged_nodes, assigned, serving, count.failures, refused)

    async def _refused(
        self,
        deployment: str,
        engine_spec: RolloutSpec,
        status: RolloutStatus | None,
        stored: Mapping[str, Any],
        cp: Deployment | None,
    ) -> tuple[tuple[str, ...], dict[str, Any] | None]:
        """The nodes whose model servers refused the canary in this attempt, and the baseline to store.

        As the fleet driver counts: failed loads and failed validations of the canary's digest,
        summed per node by its agent, more than when this attempt began (``status.canaryLoads``,
        taken on its first reconcile; a ``retry`` takes a new one, so it waits for a fresh load),
        on a node where no load of it succeeded. A counter that went down (the agent restarted)
        counts whole. Without the control plane nothing is judged and the baseline is kept.
        """
        kept = stored.get("canaryLoads")
        version = engine_spec.version
        attempt = 1
        if status is not None and status.revision == engine_spec.fingerprint:
            if status.completed or status.abort:
                return (), kept
            attempt = status.attempt
        if cp is None or cp.stable == version:
            return (), kept
        try:
            loads = await self.controlplane.loads(deployment, version)
        except TemporaryError:
            return (), kept
        key = {"revision": engine_spec.fingerprint, "attempt": attempt, "digest": version}
        if not (isinstance(kept, dict) and all(kept.get(k) == v for k, v in key.items())):
            return (), {**key, "nodes": {node: load.failures for node, load in loads.items()}}
        before = {str(node): int(n) for node, n in (kept.get("nodes") or {}).items()}
        refused = []
        for node, load in sorted(loads.items()):
            was = before.get(node, 0)
            if load.loaded or load.failures == was or load.failures == 0:
                continue
            new = load.failures - was if load.failures > was else load.failures
            refused.append(f"{node}: its model servers refused the version ({new} failed load(s) or validation(s))")
        return tuple(refused), {**key, "nodes": before}

    async def _act(
        self, obj: Body, spec: ModelRolloutSpec, result: Reconciliation, observed: PointerObservation
    ) -> tuple[dict[str, Any], bool]:
        """Carry out the engine's pointer actions; the pointer the ReplicaSets follow now, and whether it moved."""
        meta = obj["metadata"]
        signed = tag(meta["namespace"], meta["name"])
        pointer = {
            "stable": observed.stable,
            "canary": observed.canary,
            "share": observed.canary_share,
            "epoch": observed.epoch,
        }
        acted = False
        for action in result.actions:
            if isinstance(action, StageVersion) and observed.stable is not None:
                await self.controlplane.sync_pointer(
                    spec.deployment, observed.stable, action.version, signed + "stage canary"
                )
            if not isinstance(action, SetPointer):
                continue
            if action.expected_epoch != observed.epoch:
                raise ConflictError(f"pointer moved from epoch {action.expected_epoch} to {observed.epoch}; re-reading")
            await self.controlplane.sync_pointer(spec.deployment, action.stable, action.canary, signed + action.reason)
            pointer = {
                "stable": action.stable,
                "canary": action.canary,
                "share": action.canary_share,
                "epoch": observed.epoch + 1,
            }
            acted = True
            kind = "Normal"
            reason = "Promoted" if action.canary is None and action.stable != observed.stable else "WeightSet"
            if action.canary is None and action.stable == observed.stable and observed.canary is not None:
                reason, kind = "RolledBack", "Warning"
            self.post_event(obj, kind, reason, action.reason)
        return pointer, acted

    async def _converge(
        self, obj: Body, spec: ModelRolloutSpec, pointer: Mapping[str, Any], replicasets: dict[str, Body], now: datetime
    ) -> None:
        """Make the ReplicaSets match ``pointer``: create, rescale, roll to the template, demote the rest."""
        stable, canary = pointer.get("stable"), pointer.get("canary")
        if stable is None:
            return
        namespace = obj["metadata"]["namespace"]
        for digest, (role, replicas) in _wanted(spec, pointer).items():
            await self._roll(obj, spec, digest, role, replicas, replicasets)
        for rs_name, rs in list(replicasets.items()):
            rs_role = _role(rs)
            if _digest(rs) in (stable, canary) or rs_role not in ("stable", "canary"):
                continue
            if rs_role == "stable":  # promoted away or rolled back from: kept for a rollback
                new_role, delay = "previous", float(spec.rollback_window_seconds)
            else:  # an aborted or replaced canary: its traffic is gone, so are its pods
                new_role, delay = "retired", float(spec.scale_down_delay_seconds if spec.traffic else 0)
            at = (now + timedelta(seconds=delay)).isoformat()
            patch: Body = {"metadata": {"labels": {LABEL_ROLE: new_role}, "annotations": {ANNOTATION_SCALE_DOWN_AT: at}}}
            if delay == 0:
                patch["spec"] = {"replicas": 0}
            replicasets[rs_name] = await self.kube.patch_replicaset(namespace, rs_name, patch)

    async def _roll(
        self, obj: Body, spec: ModelRolloutSpec, digest: str, role: str, replicas: int, replicasets: dict[str, Body]
    ) -> None:
        """One version's ReplicaSets: the current template's at ``replicas`` (made if missing), older ones rolled away."""
        meta = obj["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        current_name = replicaset_name(name, digest, template_hash(spec))
        current = replicasets.get(current_name)
        older = [(n, rs) for n, rs in replicasets.items() if _digest(rs) == digest and n != current_name]
        old_pods = sum(_replicas(rs) for _, rs in older)
        target = replicas
        if old_pods:  # a template roll: at most surge() pods above the wanted count
            target = max(_replicas(current), min(replicas, replicas + surge(replicas) - old_pods))
        if current is None:
            body = build_replicaset(
                rollout=name, namespace=namespace, uid=meta.get("uid"), spec=spec, digest=digest,
                role=role, replicas=target, wait_image=self.wait_image, paths=self.agent_paths,
                wait_deadline=self.wait_deadline,
            )  # fmt: skip
            try:
                replicasets[current_name] = await self.kube.create_replicaset(namespace, body)
            except ConflictError:  # made by an interrupted reconcile, not listed yet: the next one scales it
                return
        elif _role(current) != role or _replicas(current) != target or _scale_down_at(current):
            patch = {
                "metadata": {"labels": {LABEL_ROLE: role}, "annotations": {ANNOTATION_SCALE_DOWN_AT: None}},
                "spec": {"replicas": target},
            }
            replicasets[current_name] = await self.kube.patch_replicaset(namespace, current_name, patch)
        keep = max(0, replicas - _ready(current))  # old pods stay until as many new ones are ready
        for old_name, old in older:
            give = min(_replicas(old), keep)
            keep -= give
            if give == 0:
                await self.kube.delete_replicaset(namespace, old_name)
                del replicasets[old_name]
            elif give != _replicas(old) or _role(old) != role or _scale_down_at(old):
                patch = {
                    "metadata": {"labels": {LABEL_ROLE: role}, "annotations": {ANNOTATION_SCALE_DOWN_AT: None}},
                    "spec": {"replicas": give},
                }
                replicasets[old_name] = await self.kube.patch_replicaset(namespace, old_name, patch)

    async def _route(self, namespace: str, spec: ModelRolloutSpec, pointer: Mapping[str, Any]) -> None:
        traffic = spec.traffic
        stable = pointer.get("stable")
        if traffic is None or stable is None:
            return
        canary = pointer.get("canary") or stable
        # Both modes pin each Service to one version's pods; an HTTPRoute then weighs the two Services.
        for service, digest in ((traffic.stable_service, stable), (traffic.canary_service, canary)):
            await self.kube.patch_service(namespace, service, {"spec": {"selector": {LABEL_DIGEST: digest_label(digest)}}})
        if traffic.http_route is None:
            return
        route = await self.kube.get_http_route(namespace, traffic.http_route)
        weight = round(float(pointer.get("share") or 0.0) * 100) if pointer.get("canary") else 0
        rules = (route.get("spec") or {}).get("rules") or []
        for rule in rules:
            for ref in rule.get("backendRefs") or []:
                if ref.get("name") == traffic.stable_service:
                    ref["weight"] = 100 - weight
                elif ref.get("name") == traffic.canary_service:
                    ref["weight"] = weight
        patch = {
            "metadata": {"resourceVersion": route.get("metadata", {}).get("resourceVersion")},
            "spec": {"rules": rules},
        }
        await self.kube.patch_http_route(namespace, traffic.http_route, patch)

    async def _retire(self, namespace: str, replicasets: dict[str, Body], now: datetime) -> None:
        for rs_name, rs in list(replicasets.items()):
            role = _role(rs)
            at = _scale_down_at(rs)
            if role not in ("retired", "previous") or not at or datetime.fromisoformat(at) > now:
                continue
            if role == "previous" or _replicas(rs) > 0:
                patch = {"metadata": {"labels": {LABEL_ROLE: "retired"}}, "spec": {"replicas": 0}}
                replicasets[rs_name] = await self.kube.patch_replicaset(namespace, rs_name, patch)
            else:
                await self.kube.delete_replicaset(namespace, rs_name)
                del replicasets[rs_name]

    async def _labels(
        self, model: str, known: dict[str, str], pointer: Mapping[str, Any], replicasets: Mapping[str, Body]
    ) -> dict[str, str]:
        """A label for each version this rollout shows (looked up once; ``""`` when it has none)."""
        shown = {pointer.get("stable"), pointer.get("canary")} | {_digest(rs) for rs in replicasets.values()}
        out = {d: label for d, label in known.items() if d in shown}
        for digest in shown:
            if isinstance(digest, str) and digest not in out:
                try:
                    out[digest] = await self.controlplane.label_of(model, digest) or ""
                except NotFoundError:
                    out[digest] = ""
        return out

    async def _refuse(self, obj: Body, reason: str, message: str) -> None:
        stored = obj.get("status") or {}
        if stored.get("refusal") == f"{reason}: {message}":
            return  # already said
        meta = obj["metadata"]
        status = {
            "phase": "Invalid",
            "message": message,
            "refusal": f"{reason}: {message}",
            "observedGeneration": meta.get("generation"),
            "conditions": conditions_for(stored, self.clock(), refused=(reason, message)),
        }
        await self.kube.patch_rollout_status(meta["namespace"], meta["name"], status, meta.get("resourceVersion"))
        self.post_event(obj, "Warning", reason, message)
        event(
            _log,
            "rollout.refused",
            logging.WARNING,
            rollout=f"{meta['namespace']}/{meta['name']}",
            reason=reason,
            error=message,
        )

    async def _write(
        self,
        obj: Body,
        spec: ModelRolloutSpec,
        digest: str,
        size: int,
        status: RolloutStatus,
        pointer: Mapping[str, Any],
        verb: str | None,
        verb_note: str,
        pods: PodCount,
        extra: Mapping[str, Any],
        failure: Failure | None = None,
    ) -> None:
        meta, stored = obj["metadata"], obj.get("status") or {}
        new = summary(status, pointer, len(parse_spec(spec.engine_spec(digest)).steps), pods, extra["labels"])
        now = self.clock()
        new.update(
            engine=status.to_dict(),
            pointer=dict(pointer),
            resolved={"ref": spec.version, "digest": digest, "size": size},
            handledVerb=verb,
            verbResult=verb_note or stored.get("verbResult"),
            refusal=None,
            observedGeneration=meta.get("generation"),
            conditions=conditions_for(
                stored, now, engine=status, pods=pods, outside=extra["outside"], failure=failure
            ),
            **extra,
        )
        if str(stored.get("phase")) != new["phase"]:
            self.post_event(
                obj, "Warning" if new["phase"] == "Degraded" else "Normal", f"Phase{new['phase']}", str(new["message"])
            )
            event(
                _log,
                "rollout.phase",
                rollout=f"{meta['namespace']}/{meta['name']}",
                phase=new["phase"],
                step=new["step"],
                message=new["message"],
            )
        before = {c.get("type"): c for c in stored.get("conditions") or []}.get("Reconciled") or {}
        if failure is not None:
            if (before.get("status"), before.get("reason"), before.get("message")) != ("False", *_cut(failure)):
                self.post_event(obj, "Warning", failure.reason, failure.message)
        elif before.get("status") == "False":
            self.post_event(obj, "Normal", "Reconciled", f"reconciled again after {before.get('reason')}")
        await self.kube.patch_rollout_status(meta["namespace"], meta["name"], new, meta.get("resourceVersion"))


def _cut(failure: Failure) -> tuple[str, str]:
    return failure.reason, failure.message[:1000]


def _scale_down_at(rs: Mapping[str, Any]) -> str | None:
    return (rs.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SCALE_DOWN_AT)


def _wanted(spec: ModelRolloutSpec, pointer: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """digest -> (role, replicas) of the versions ``pointer`` names."""
    stable, canary = pointer.get("stable"), pointer.get("canary")
    weighted = spec.traffic is not None and spec.traffic.http_route is not None
    share = float(pointer.get("share") or 0.0) if canary else 0.0
    stable_n, canary_n = split_replicas(share, spec.replicas, routed=weighted)
    wanted: dict[str, tuple[str, int]] = {}
    if stable is not None:
        wanted[stable] = ("stable", stable_n)
    if canary is not None:
        wanted[canary] = ("canary", canary_n)
    return wanted


def _pods(name: str, spec: ModelRolloutSpec, pointer: Mapping[str, Any], replicasets: Mapping[str, Body]) -> PodCount:
    """The pods of the versions the pointer names, for ``status.replicas``/``readyReplicas`` and ``Healthy``."""
    wanted = _wanted(spec, pointer)
    hashed = template_hash(spec)
    mine = [(n, rs) for n, rs in replicasets.items() if _digest(rs) in wanted]
    current = {replicaset_name(name, d, hashed) for d in wanted}
    return PodCount(
        desired=sum(n for _, n in wanted.values()),
        replicas=sum(int((rs.get("status") or {}).get("replicas") or 0) for _, rs in mine),
        ready=sum(_ready(rs) for _, rs in mine),
        rolling=any(n not in current and _replicas(rs) > 0 for n, rs in mine),
    )


def _selector(name: str, pointer: Mapping[str, Any]) -> str:
    """The label selector of the stable and canary pods (the ``scale`` subresource's ``labelSelectorPath``)."""
    digests = sorted(digest_label(d) for d in (pointer.get("stable"), pointer.get("canary")) if isinstance(d, str))
    if not digests:
        return f"{LABEL_ROLLOUT}={name}"
    return f"{LABEL_ROLLOUT}={name},{LABEL_DIGEST} in ({','.join(digests)})"


def _apply_verb(verb: str, spec: RolloutSpec, status: RolloutStatus, now: datetime) -> tuple[RolloutStatus, str]:
    """Apply ``promote``, ``promote-full``, ``abort``, ``retry``, ``pause`` or ``resume`` (``@suffix`` ignored)."""
    name = verb.split("@", 1)[0].strip()
    function = verbs.find(name)
    if function is None:
        return status, f"{verb}: unknown verb; use one of {sorted(verbs.BY_NAME)}"
    try:
        return function(spec, status, now), verb_done(verb)
    except verbs.VerbError as exc:
        return status, exc.message
