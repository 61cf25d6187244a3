"""One reconcile of a ``ModelRollout``: observe, run the engine, act, store the status.

The engine (``controlplane.rollouts.engine``) decides; this driver only translates. Its memory is
the resource's ``status``: the engine's status (``status.engine``), the pointer the ReplicaSets
were last set to (``status.pointer``: stable, canary, share, epoch) and the resolved version. A
restarted operator reads them back and carries on where the old one stopped.

Mapping of the engine's actions:

- ``SetPointer(stable, canary, share)`` → the stable ReplicaSet and the canary ReplicaSet (created
  from the pod template if missing) are scaled to :func:`split_replicas` and labelled with their
  role; the traffic router, if any, follows (``services``: the stable and canary Services select
  their version's pods, weights stay replica shares; ``httpRoute``: the same selectors, and the
  route's backend weights carry the share while the stable ReplicaSet stays at full size);
  ``status.pointer`` gets the next epoch. On promotion
  the canary ReplicaSet is *relabelled* stable (its pods keep running) and the old stable one
  becomes ``previous``, still scaled, until ``rollbackWindowSeconds`` pass. An aborted canary is
  ``retired``: scaled to 0 at once (after ``scaleDownDelaySeconds`` when a router moved its
  traffic away already), then deleted.
- ``StageVersion`` → the control plane's pointer names the canary (share 0), so every node's agent
  fetches and verifies it before a canary pod needs it.
- ``MeasureMetric`` → the analysis provider measures; the engine runs again with the answer.

Every write of the status carries the ``resourceVersion`` it was computed from; a 409 (someone
changed the resource, a verb annotation for example) re-reads everything and reconciles again.
The actions are idempotent, so repeating them is harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.k8s.kube import Body, KubeApi
from controlplane.k8s.replicasets import (
    DEFAULT_WAIT_IMAGE,
    AgentPaths,
    build_replicaset,
    replicaset_name,
    split_replicas,
)
from controlplane.k8s.rollout import (
    ANNOTATION_DIGEST,
    ANNOTATION_VERB,
    LABEL_DIGEST,
    LABEL_ROLE,
    ModelRolloutSpec,
    digest_label,
    parse_rollout,
)
from controlplane.k8s.status import conditions_for, engine_status, summary
from controlplane.k8s.versions import ControlPlane, FleetCount, UnknownVersion
from controlplane.rollouts import verbs
from controlplane.rollouts.actions import MeasureMetric, SetPointer, StageVersion
from controlplane.rollouts.engine import Reconciliation, reconcile
from controlplane.rollouts.observations import FleetObservation, MeasurementResult, Observations, PointerObservation
from controlplane.rollouts.providers import ProviderRegistry, RolloutContext
from controlplane.rollouts.spec import RolloutSpec, RolloutSpecError, parse_spec
from controlplane.rollouts.status import RolloutStatus
from weightship.errors import ConflictError, TemporaryError
from weightship.logs import event
from weightship.modelrollout import verb_done

__all__ = ["ANNOTATION_SCALE_DOWN_AT", "EventSink", "RolloutDriver"]

_log = logging.getLogger("controlplane.k8s.driver")

#: On a ReplicaSet that lost its role: when it is scaled to 0 (ISO 8601).
ANNOTATION_SCALE_DOWN_AT = "weightship.io/scale-down-at"
_CONFLICT_RETRIES = 5

#: ``(resource body, type, reason, message)`` — posts a Kubernetes Event (kopf's poster in production).
EventSink = Callable[[Body, str, str, str], None]


def _utc_now() -> datetime:
    return datetime.now(UTC)


class RolloutDriver:
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
    ) -> None:
        self.kube = kube
        self.controlplane = controlplane
        self.providers = providers
        self.post_event = post_event
        self.wait_image = wait_image
        self.agent_paths = agent_paths
        self.clock = clock

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
        raise TemporaryError(
            f"ModelRollout {namespace}/{name}: {_CONFLICT_RETRIES} write conflicts in a row; retrying later"
        )

    async def _once(self, namespace: str, name: str) -> None:
        obj = await self.kube.get_rollout(namespace, name)
        meta, stored = obj.get("metadata") or {}, obj.get("status") or {}
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
        fleet = await self._fleet(spec, engine_spec, observed, replicasets, name)
        measurements: tuple[MeasurementResult, ...] = ()
        for _ in range(3):  # measure, then judge with the answers, in the same reconcile
            observations = Observations(observed, fleet, size, None, measurements)
            result = reconcile(engine_spec, status, observations, now)
            wanted = [a for a in result.actions if isinstance(a, MeasureMetric)]
            if not wanted:
                break
            context = RolloutContext(f"{namespace}/{name}", spec.deployment, digest, result.status.stable)
            measurements += tuple([await self.providers.measure(a, context) for a in wanted])
        new_pointer = await self._act(obj, spec, result, observed, replicasets, now)
        await self._retire(namespace, spec, replicasets, now)
        await self._write(obj, spec, digest, size, result.status, new_pointer, verb or handled, verb_note)

    async def _fleet(
        self,
        spec: ModelRolloutSpec,
        engine_spec: RolloutSpec,
        pointer: PointerObservation,
        replicasets: Mapping[str, Body],
        name: str,
    ) -> FleetObservation:
        assigned = serving = 0
        if pointer.canary is not None:
            canary_rs = replicasets.get(replicaset_name(name, pointer.canary)) or {}
            assigned = int((canary_rs.get("spec") or {}).get("replicas") or 0)
            serving = int((canary_rs.get("status") or {}).get("readyReplicas") or 0)
        count = FleetCount(spec.replicas, 0)
        if engine_spec.prefetch_percent:
            count = await self.controlplane.fleet(spec.deployment, engine_spec.version)
        return FleetObservation(count.target_nodes, count.staged_nodes, assigned, serving, count.failures)

    async def _act(
        self,
        obj: Body,
        spec: ModelRolloutSpec,
        result: Reconciliation,
        observed: PointerObservation,
        replicasets: dict[str, Body],
        now: datetime,
    ) -> dict[str, Any]:
        pointer = {
            "stable": observed.stable,
            "canary": observed.canary,
            "share": observed.canary_share,
            "epoch": observed.epoch,
        }
        for action in result.actions:
            if isinstance(action, StageVersion) and observed.stable is not None:
                await self.controlplane.sync_pointer(spec.deployment, observed.stable, action.version, "stage canary")
            if not isinstance(action, SetPointer):
                continue
            if action.expected_epoch != observed.epoch:
                raise ConflictError(f"pointer moved from epoch {action.expected_epoch} to {observed.epoch}; re-reading")
            await self.controlplane.sync_pointer(spec.deployment, action.stable, action.canary, action.reason)
            await self._scale(obj, spec, action, observed, replicasets, now)
            pointer = {
                "stable": action.stable,
                "canary": action.canary,
                "share": action.canary_share,
                "epoch": observed.epoch + 1,
            }
            kind = "Normal"
            reason = "Promoted" if action.canary is None and action.stable != observed.stable else "WeightSet"
            if action.canary is None and action.stable == observed.stable and observed.canary is not None:
                reason, kind = "RolledBack", "Warning"
            self.post_event(obj, kind, reason, action.reason)
        return pointer

    async def _scale(
        self,
        obj: Body,
        spec: ModelRolloutSpec,
        action: SetPointer,
        observed: PointerObservation,
        replicasets: dict[str, Body],
        now: datetime,
    ) -> None:
        meta = obj["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        weighted = spec.traffic is not None and spec.traffic.http_route is not None
        stable_n, canary_n = split_replicas(action.canary_share, spec.replicas, routed=weighted)
        wanted = {action.stable: ("stable", stable_n)}
        if action.canary is not None:
            wanted[action.canary] = ("canary", canary_n)
        for digest, (role, replicas) in wanted.items():
            rs_name = replicaset_name(name, digest)
            current = replicasets.get(rs_name)
            if current is None:
                body = build_replicaset(
                    rollout=name, namespace=namespace, uid=meta.get("uid"), spec=spec, digest=digest,
                    role=role, replicas=replicas, wait_image=self.wait_image, paths=self.agent_paths,
                )  # fmt: skip
                try:
                    replicasets[rs_name] = await self.kube.create_replicaset(namespace, body)
                    continue
                except ConflictError:
                    pass  # created by an earlier, interrupted reconcile: scale it below
            patch = {
                "metadata": {"labels": {LABEL_ROLE: role}, "annotations": {ANNOTATION_SCALE_DOWN_AT: None}},
                "spec": {"replicas": replicas},
            }
            replicasets[rs_name] = await self.kube.patch_replicaset(namespace, rs_name, patch)
        await self._route(namespace, spec, action)
        for rs_name, rs in replicasets.items():
            rs_digest = (rs["metadata"].get("annotations") or {}).get(ANNOTATION_DIGEST)
            rs_role = (rs["metadata"].get("labels") or {}).get(LABEL_ROLE)
            if rs_digest in wanted or rs_role in ("retired", "previous"):
                continue
            if rs_digest == observed.stable and action.canary is None:  # promoted away: keep it for rollbacks
                new_role, delay = "previous", float(spec.rollback_window_seconds)
            else:  # an aborted or replaced canary: its traffic is gone, so are its pods
                new_role, delay = "retired", float(spec.scale_down_delay_seconds if spec.traffic else 0)
            at = (now + timedelta(seconds=delay)).isoformat()
            patch = {"metadata": {"labels": {LABEL_ROLE: new_role}, "annotations": {ANNOTATION_SCALE_DOWN_AT: at}}}
            if delay == 0:
                patch["spec"] = {"replicas": 0}
            replicasets[rs_name] = await self.kube.patch_replicaset(namespace, rs_name, patch)

    async def _route(self, namespace: str, spec: ModelRolloutSpec, action: SetPointer) -> None:
        traffic = spec.traffic
        if traffic is None:
            return
        canary = action.canary or action.stable
        # Both modes pin each Service to one version's pods; an HTTPRoute then weighs the two Services.
        for service, digest in ((traffic.stable_service, action.stable), (traffic.canary_service, canary)):
            await self.kube.patch_service(namespace, service, {"spec": {"selector": {LABEL_DIGEST: digest_label(digest)}}})
        if traffic.http_route is None:
            return
        route = await self.kube.get_http_route(namespace, traffic.http_route)
        weight = round(action.canary_share * 100) if action.canary else 0
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

    async def _retire(
        self, namespace: str, spec: ModelRolloutSpec, replicasets: dict[str, Body], now: datetime
    ) -> None:
        for rs_name, rs in list(replicasets.items()):
            meta = rs["metadata"]
            role = (meta.get("labels") or {}).get(LABEL_ROLE)
            at = (meta.get("annotations") or {}).get(ANNOTATION_SCALE_DOWN_AT)
            if role not in ("retired", "previous") or not at or datetime.fromisoformat(at) > now:
                continue
            if role == "previous" or int((rs.get("spec") or {}).get("replicas") or 0) > 0:
                patch = {"metadata": {"labels": {LABEL_ROLE: "retired"}}, "spec": {"replicas": 0}}
                replicasets[rs_name] = await self.kube.patch_replicaset(namespace, rs_name, patch)
            else:
                await self.kube.delete_replicaset(namespace, rs_name)
                del replicasets[rs_name]

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
    ) -> None:
        meta, stored = obj["metadata"], obj.get("status") or {}
        new = summary(status, pointer, len(parse_spec(spec.engine_spec(digest)).steps))
        new.update(
            engine=status.to_dict(),
            pointer=dict(pointer),
            resolved={"ref": spec.version, "digest": digest, "size": size},
            handledVerb=verb,
            verbResult=verb_note or stored.get("verbResult"),
            refusal=None,
            observedGeneration=meta.get("generation"),
            conditions=conditions_for(stored, self.clock(), engine=status),
        )
        if str(stored.get("phase")) != new["phase"]:
            self.post_event(
                obj, "Warning" if new["phase"] == "Degraded" else "Normal", f"Phase{new['phase']}", status.message
            )
            event(
                _log,
                "rollout.phase",
                rollout=f"{meta['namespace']}/{meta['name']}",
                phase=new["phase"],
                step=new["step"],
                message=status.message,
            )
        await self.kube.patch_rollout_status(meta["namespace"], meta["name"], new, meta.get("resourceVersion"))


def _apply_verb(verb: str, spec: RolloutSpec, status: RolloutStatus, now: datetime) -> tuple[RolloutStatus, str]:
    """Apply ``promote``, ``promote-full``, ``abort``, ``retry``, ``pause`` or ``resume`` (``@suffix`` ignored)."""
    name = verb.split("@", 1)[0].strip()
    table: dict[str, Callable[[RolloutSpec, RolloutStatus, datetime], RolloutStatus]] = {
        "promote": verbs.promote,
        "promote-full": verbs.promote_full,
        "abort": verbs.abort_rollout,
        "retry": verbs.retry,
        "pause": verbs.pause,
        "resume": verbs.resume,
    }
    function = table.get(name)
    if function is None:
        return status, f"{verb}: unknown verb; use one of {sorted(table)}"
    try:
        return function(spec, status, now), verb_done(verb)
    except verbs.VerbError as exc:
        return status, exc.message
