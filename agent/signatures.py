"""The node's signature gate: a version is fetched only when the node's own policy accepts it.

The policy comes from the agent's configuration (``signing_policy``: a file, typically a
Kubernetes ConfigMap or Secret mounted into the pod), never from the control plane, so a control
plane, database or bucket that was taken over cannot widen what the node accepts. Before the
first chunk of a version is fetched, the gate asks the control plane for the version's
signatures and checks them against the manifest's file digests (``weightship.signing``): no
byte is hashed again, and the chunk digests still guard the bytes.

A refusal is a ``SignatureRefused``; the reconciler reports it in the heartbeat as the version's
problem (``signature_refused``, with the reason) and the version never becomes ready here.
Verdicts are remembered per digest while the policy file is unchanged, so re-checks after a
restart or a retry cost one request.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from weightship.logs import event
from weightship.manifest import Manifest
from weightship.signing import SignatureRefused, Verdict, check_version
from weightship.signing_policy import SigningPolicy, load_policy

__all__ = ["SignatureGate", "SignatureSource", "load_gate"]

log = logging.getLogger(__name__)


class SignatureSource(Protocol):
    """Whatever serves a version's signatures (the control-plane client)."""

    async def signatures(self, model: str, digest: str) -> list[bytes]:
        """Every signature stored for ``digest``."""
        ...


class SignatureGate:
    """Checks each version against the node's policy before anything of it is fetched."""

    def __init__(self, policy: SigningPolicy, source: SignatureSource) -> None:
        self.policy = policy
        self.source = source
        self._accepted: dict[str, Verdict] = {}
        #: digest -> the signatures it passed with (kept beside the version for loaders that check again)
        self.passed_with: dict[str, list[bytes]] = {}

    def required(self, model: str) -> bool:
        """Whether the policy has anything to check for ``model``."""
        policy = self.policy.for_model(model)
        return policy.require_signature or policy.trusts_anyone

    def accepted(self, digest: str) -> bool:
        """Whether ``digest`` passed the policy on this node (peers and caches serve only such versions)."""
        return digest in self._accepted

    async def check(self, manifest: Manifest) -> str:
        """The verdict's reason when the policy accepts ``manifest``'s version; else ``SignatureRefused``."""
        known = self._accepted.get(manifest.digest)
        if known is not None:
            return known.reason
        bundles: list[bytes] = []
        if not self.required(manifest.model):
            verdict = Verdict(True, "the policy checks nothing for this model")
        else:
            bundles = await self.source.signatures(manifest.model, manifest.digest)
            verdict = check_version(manifest, bundles, self.policy.for_model(manifest.model))
        if not verdict.accepted:
            event(log, "signature.refused", logging.ERROR, model=manifest.model, digest=manifest.digest, reason=verdict.reason)
            raise SignatureRefused(  # the reason first: heartbeats carry the message's start only
                f"{verdict.reason} (version {manifest.digest} of model {manifest.model!r}, refused by this node's "
                f"signing policy {self.policy.source})",
                fields={"model": manifest.model, "version": manifest.digest, "reason": verdict.reason},
            )
        self._accepted[manifest.digest] = verdict
        self.passed_with[manifest.digest] = bundles
        event(log, "signature.accepted", model=manifest.model, digest=manifest.digest, reason=verdict.reason)
        return verdict.reason


def load_gate(path: str, source: SignatureSource) -> SignatureGate | None:
    """The gate of the policy file at ``path``; ``None`` when no policy is configured."""
    if not path:
        return None
    return SignatureGate(load_policy(Path(path)), source)
