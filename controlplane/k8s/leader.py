"""Leader election on a ``coordination.k8s.io/v1`` Lease: of all operator replicas, one acts.

Every replica runs :meth:`LeaderElector.run`. Each ``renew`` interval it reads the Lease:

- absent → create it naming itself (a 409 means another replica was first: follower);
- held by itself, or expired (``renewTime + leaseDurationSeconds`` in the past) → write
  ``holderIdentity``/``renewTime`` with the ``resourceVersion`` it read; a 409 means another
  replica wrote first, so it stays (or becomes) a follower;
- held by another, live replica → follower.

A leader that cannot renew (API unreachable, conflict) stops acting at once, before its Lease
expires, so two replicas never act together for longer than one renew interval of clock skew.
kopf's own peering is not used: it warns about same-priority peers but lets both run.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.k8s.kube import KubeApi
from weightship.errors import ConflictError, NotFoundError, WeightshipError
from weightship.logs import event

__all__ = ["LeaderElector"]

_log = logging.getLogger("controlplane.k8s.leader")


def _micro(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


class LeaderElector:
    """Holds (or waits for) the Lease ``namespace/name`` as ``identity``."""

    def __init__(self, kube: KubeApi, namespace: str, name: str, identity: str, *, lease_seconds: float = 15.0) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.is_leader = False
        self.changed = asyncio.Event()

    async def run(self) -> None:
        """Try to acquire or renew every third of the lease, until cancelled."""
        try:
            while True:
                await self.attempt()
                await asyncio.sleep(self.lease_seconds / 3)
        finally:
            self._set(False, "stopped")

    async def attempt(self) -> bool:
        """One acquire-or-renew; returns whether this replica leads now."""
        now = datetime.now(UTC)
        try:
            lease = await self.kube.get_lease(self.namespace, self.name)
        except NotFoundError:
            lease = None
        except WeightshipError as exc:
            self._set(False, f"cannot read the lease: {exc.message}")
            return False
        try:
            if lease is None:
                await self.kube.create_lease(self.namespace, self._body(now, transitions=0, acquired=now))
                self._set(True, "created the lease")
                return True
            spec: dict[str, Any] = lease.get("spec") or {}
            holder = spec.get("holderIdentity")
            renewed = _parse(spec.get("renewTime"))
            duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
            expired = renewed is None or renewed + timedelta(seconds=duration) < now
            if holder != self.identity and not expired:
                self._set(False, f"held by {holder}")
                return False
            transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
            acquired = now if holder != self.identity else (_parse(spec.get("acquireTime")) or now)
            patch = self._body(now, transitions=transitions, acquired=acquired)
            patch["metadata"] = {"resourceVersion": lease.get("metadata", {}).get("resourceVersion")}
            await self.kube.patch_lease(self.namespace, self.name, patch)
            self._set(True, "renewed" if holder == self.identity else f"took over from {holder} (expired)")
            return True
        except ConflictError:
            self._set(False, "another replica wrote the lease first")
            return False
        except WeightshipError as exc:
            self._set(False, f"cannot write the lease: {exc.message}")
            return False

    def _body(self, now: datetime, *, transitions: int, acquired: datetime) -> dict[str, Any]:
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(1, round(self.lease_seconds)),
                "acquireTime": _micro(acquired),
                "renewTime": _micro(now),
                "leaseTransitions": transitions,
            },
        }

    def _set(self, leader: bool, why: str) -> None:
        if leader != self.is_leader:
            event(_log, "leader.changed", identity=self.identity, leader=leader, why=why)
            self.is_leader = leader
            self.changed.set()
