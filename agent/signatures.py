"""The node's signature gate: a version is fetched only when the node's own policy accepts it.

The policy comes from the agent's configuration (``signing_policy``: a file, typically a
Kubernetes ConfigMap or Secret mounted into the pod), never from the control plane, so a control
plane, database or bucket that was taken over cannot widen what the node accepts. Before the
first chunk of a version is fetched, the gate asks the control plane for the version's
signatures and checks them against the manifest's file digests (``weightship.signing``): no
byte is hashed again, and the chunk digests still guard the bytes.

A refusal is a ``SignatureRefused``; the reconciler reports it in the heartbeat as the version's
problem (``signature_refused``, with the reason) and the version never becomes ready here.
Verdicts are remembered per digest while the policy is unchanged, so re-checks after a retry
cost nothing.

**A changed policy takes effect without a restart** (a key rotation or a revoked key reaching a
fleet through an updated ConfigMap). The file is followed by ``weightship.signing_policy.PolicyFile``:
``reload`` (the daemon calls it every few seconds, and each check does) reads it again when it
changed. A new policy moves ``generation`` and drops every remembered verdict, so a version
accepted before is checked again before it is fetched, cached or switched to again (a version on
disk stays there, and the one a deployment serves keeps serving); the reconciler retries at once
the versions refused under an older generation, and a cache re-checks what it holds. A changed
file that cannot be read or parsed keeps the last good policy: it is logged once per bad version
of the file (``signing_policy.invalid``) and shown in the heartbeat's health errors
(``problem``) until the file is fixed.
"""

from __future__ import annotations

import logging
from typing import Protocol

from weightship.logs import event
from weightship.manifest import Manifest
from weightship.signing import SignatureRefused, Verdict, check_version
from weightship.signing_policy import PolicyFile, SigningPolicy

__all__ = ["SignatureGate", "SignatureSource", "load_gate"]

log = logging.getLogger(__name__)


class SignatureSource(Protocol):
    """Whatever serves a version's signatures (the control-plane client)."""

    async def signatures(self, model: str, digest: str) -> list[bytes]:
        """Every signature stored for ``digest``."""
        ...


class SignatureGate:
    """Checks each version against the node's policy before anything of it is fetched."""

    def __init__(self, policy: PolicyFile, source: SignatureSource) -> None:
        policy.last_good()  # read now: a file that never held a good policy stops the start
        self.file = policy
        self.source = source
        #: digest -> the verdict it passed with, and the policy generation it passed under
        self._accepted: dict[str, tuple[int, Verdict]] = {}
        #: digest -> the signatures it passed with (kept beside the version for loaders that check again)
        self.passed_with: dict[str, list[bytes]] = {}
        self._generation = policy.generation
        self._reported: Exception | None = None

    @property
    def policy(self) -> SigningPolicy:
        """The policy in effect: the last good one read from the file."""
        policy = self.file.policy
        assert policy is not None  # read at construction
        return policy

    @property
    def generation(self) -> int:
        """Moves each time another policy takes effect; verdicts of an older one count for nothing."""
        return self.file.generation

    @property
    def problem(self) -> str | None:
        """Why the policy file as it is now is not in effect (the last good one is), for the heartbeat."""
        error = self.file.error
        if error is None:
            return None
        return f"{error.message}; this node keeps its last good signing policy until the file is fixed"

    def reload(self) -> bool:
        """Read the policy file again if it changed; whether another policy took effect (verdicts dropped)."""
        self.file.refresh()
        error = self.file.error
        if error is not None and error is not self._reported:
            self._reported = error  # once per bad version of the file
            event(log, "signing_policy.invalid", logging.ERROR, path=str(self.file.path), error=error.message)
        if self.file.generation == self._generation:
            return False
        self._generation = self.file.generation
        self._accepted.clear()
        event(log, "signing_policy.reloaded", path=str(self.file.path), generation=self._generation)
        return True

    def required(self, model: str) -> bool:
        """Whether the policy has anything to check for ``model``."""
        policy = self.policy.for_model(model)
        return policy.require_signature or policy.trusts_anyone

    def accepted(self, digest: str) -> bool:
        """Whether ``digest`` passed the policy now in effect on this node (caches serve only such versions)."""
        known = self._accepted.get(digest)
        return known is not None and known[0] == self.generation

    async def check(self, manifest: Manifest) -> str:
        """The verdict's reason when the policy accepts ``manifest``'s version; else ``SignatureRefused``."""
        while True:
            self.reload()
            generation, policy = self.generation, self.policy
            known = self._accepted.get(manifest.digest)
            if known is not None and known[0] == generation:
                return known[1].reason
            bundles: list[bytes] = []
            model_policy = policy.for_model(manifest.model)
            if not (model_policy.require_signature or model_policy.trusts_anyone):
                verdict = Verdict(True, "the policy checks nothing for this model")
            else:
                bundles = await self.source.signatures(manifest.model, manifest.digest)
                if self.generation != generation:
                    continue  # the policy changed while the signatures were on their way: judge by the new one
                verdict = check_version(manifest, bundles, model_policy)
            break
        if not verdict.accepted:
            event(log, "signature.refused", logging.ERROR, model=manifest.model, digest=manifest.digest, reason=verdict.reason)
            raise SignatureRefused(  # the reason first: heartbeats carry the message's start only
                f"{verdict.reason} (version {manifest.digest} of model {manifest.model!r}, refused by this node's "
                f"signing policy {policy.source})",
                fields={"model": manifest.model, "version": manifest.digest, "reason": verdict.reason},
            )
        self._accepted[manifest.digest] = (generation, verdict)
        self.passed_with[manifest.digest] = bundles
        event(log, "signature.accepted", model=manifest.model, digest=manifest.digest, reason=verdict.reason)
        return verdict.reason


def load_gate(path: str, source: SignatureSource) -> SignatureGate | None:
    """The gate of the policy file at ``path`` (read now: a bad file stops the start); ``None`` without one."""
    if not path:
        return None
    return SignatureGate(PolicyFile(path), source)
