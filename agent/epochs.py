"""Anti-rollback: the highest pointer epoch accepted per deployment, persisted across restarts.

The control plane writes every pointer change (promote, canary step, abort, rollback) as a new,
higher epoch. An agent accepts a pointer only if its epoch is at least the highest it has
accepted for that deployment, so a replayed response, a stale proxy or a control plane restored
from an old backup cannot move a node back to an older version (TUF's rollback attack). A
deliberate rollback arrives as a *higher* epoch naming the older digest, and is applied.

Persisted schema (``state/deployments.json``, replaced atomically)::

    {"version": 1,
     "deployments": {"<name>": {"model": "llama", "accepted_epoch": 7,
                                "applied_epoch": 6, "digest": "sha256:..."}}}

``accepted_epoch`` is raised as soon as a pointer is accepted (before its version is even
fetched); ``applied_epoch`` and ``digest`` say what the node serves, and are written *before* the
``current`` link is swapped, so after a crash the record is the truth and the link is repaired
to match it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from agent.durable import atomic_write
from weightship.errors import ConflictError

__all__ = ["DeploymentRecord", "EpochBook", "StaleEpochError"]


class StaleEpochError(ConflictError):
    """A pointer older than one already accepted: refused, the node keeps what it serves."""

    code = "stale_epoch"


@dataclass(frozen=True, slots=True)
class DeploymentRecord:
    """What the agent knows of one deployment."""

    name: str
    model: str | None = None
    accepted_epoch: int = 0
    applied_epoch: int = 0
    digest: str | None = None
    #: the digest the pointer at ``accepted_epoch`` named; one epoch names one digest for a node
    accepted_digest: str | None = None


class EpochBook:
    """The persisted per-deployment epochs and served digests."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._records: dict[str, DeploymentRecord] = {}
        if path.exists():
            doc = json.loads(path.read_text(encoding="utf-8"))
            for name, rec in doc.get("deployments", {}).items():
                self._records[name] = DeploymentRecord(name=name, **rec)

    def get(self, name: str) -> DeploymentRecord | None:
        """The record of ``name``, if the agent ever accepted a pointer for it."""
        return self._records.get(name)

    def records(self) -> list[DeploymentRecord]:
        """Every record, by name."""
        return [self._records[n] for n in sorted(self._records)]

    def accept(self, name: str, epoch: int, model: str | None, digest: str | None = None) -> DeploymentRecord:
        """Accept a pointer at ``epoch`` naming ``digest``, or raise ``StaleEpochError``.

        Refused: an epoch lower than one accepted, and the accepted epoch naming another digest
        (after a restore from backup, one write can reach exactly the epoch agents hold).
        """
        current = self._records.get(name) or DeploymentRecord(name=name)
        if epoch == current.accepted_epoch and current.accepted_digest is not None and digest != current.accepted_digest:
            raise StaleEpochError(
                f"deployment {name!r}: pointer epoch {epoch} names {digest}, but epoch {epoch} was already "
                f"accepted naming {current.accepted_digest}; refused (one epoch names one version: a control "
                "plane restored from an old backup?). See docs/runbooks/bad-node.md"
            )
        if epoch < current.accepted_epoch:
            raise StaleEpochError(
                f"deployment {name!r}: pointer epoch {epoch} is lower than epoch {current.accepted_epoch} "
                "already accepted; refused (a stale or replayed pointer, or a control plane restored from "
                "an old backup). The node keeps serving what it serves; see docs/runbooks/bad-node.md"
            )
        if epoch > current.accepted_epoch or model != current.model:
            current = replace(current, accepted_epoch=epoch, accepted_digest=digest, model=model or current.model)
            self._store(current)
        return current

    def apply(self, name: str, epoch: int, digest: str | None, model: str | None) -> DeploymentRecord:
        """Record that the node now serves ``digest`` for ``name`` at ``epoch``."""
        current = self._records.get(name) or DeploymentRecord(name=name)
        updated = replace(
            current,
            model=model or current.model,
            accepted_epoch=max(current.accepted_epoch, epoch),
            accepted_digest=digest if epoch >= current.accepted_epoch else current.accepted_digest,
            applied_epoch=epoch,
            digest=digest,
        )
        if updated != current:
            self._store(updated)
        return updated

    def _store(self, record: DeploymentRecord) -> None:
        records = {**self._records, record.name: record}
        doc = {
            "version": 1,
            "deployments": {n: {k: v for k, v in asdict(r).items() if k != "name"} for n, r in sorted(records.items())},
        }
        atomic_write(self.path, json.dumps(doc, indent=1).encode())
        self._records = records
