"""A version's signatures: stored write-once beside its manifest, checked against the signing policy.

Layout: ``signatures/sha256/<version hex>/<sha256 of the bundle>``, one object per OpenSSF
model-signing bundle (``weightship.signing``). A version gains signatures (a second approver
signs later) and never loses one: every object is written once and nothing here deletes.

The control plane's policy (``settings.signing_policy_file``, the same format the agents read,
followed as it changes by ``weightship.signing_policy.PolicyFile``: no restart) is checked:

- at publish (``commit`` with signatures) and when a signature is added: the version must pass
  with signers that are not retired (``purpose="publish"``);
- at every pointer move (set, canary, promote, rollback, rollout steps) and preheat: each version
  the move brings in must pass as the nodes would check it (``purpose="serve"``).

A refusal is a ``SignatureRefused`` (422 ``signature_refused``) naming the model, the version, the
key and the reason. The agents hold their own copy of the policy and check again before they
fetch: this check keeps a pointer from naming what the fleet would refuse, it does not replace
theirs.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence

from controlplane.persistence.store import OriginStore, manifest_key
from controlplane.persistence.store.origin import SIGNATURES, check_key
from controlplane.state import AppState
from weightship.digests import hex_of
from weightship.logs import event
from weightship.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from weightship.signing import MAX_SIGNATURE_BYTES, SignatureRefused, check_version, parse_bundle
from weightship.signing_policy import PolicyFile, SigningPolicy

__all__ = [
    "add_signatures",
    "check_serving",
    "policy_of",
    "signature_key",
    "stored_signatures",
]

log = logging.getLogger(__name__)

#: more signatures than this on one version is a mistake or an attack
MAX_SIGNATURES = 64
#: the policy file of each configured path, followed as it changes (one path per process, outside tests)
_POLICY_FILES: dict[str, PolicyFile] = {}


def signature_key(digest: str, bundle: bytes) -> str:
    """Key of ``bundle`` among the signatures of version ``digest``."""
    return check_key(f"{SIGNATURES}{hex_of(digest)}/{hashlib.sha256(bundle).hexdigest()}")


def stored_signatures(store: OriginStore, digest: str) -> list[bytes]:
    """Every signature stored for version ``digest`` (oldest key order; possibly none)."""
    keys = sorted(store.list_keys(f"{SIGNATURES}{hex_of(digest)}/"))[:MAX_SIGNATURES]
    return [store.get_bytes(key, MAX_SIGNATURE_BYTES) for key in keys]


def policy_of(state: AppState) -> SigningPolicy:
    """The control plane's signing policy (read again when its file changes); no file: nothing is required.

    A file that cannot be read or parsed is an error (``ValidationError``) for every check until
    it is fixed: the control plane never moves a pointer under a policy other than the file's.
    """
    path = state.settings.signing_policy_file
    if not path:
        return SigningPolicy()
    followed = _POLICY_FILES.get(path)
    if followed is None:
        followed = _POLICY_FILES[path] = PolicyFile(path)
    if followed.refresh() and followed.generation > 1:
        event(log, "signing_policy.reloaded", path=path, generation=followed.generation)
    return followed.current()


def _check(state: AppState, manifest: Manifest, bundles: Sequence[bytes], purpose: str) -> str:
    policy = policy_of(state).for_model(manifest.model)
    verdict = check_version(manifest, bundles, policy, purpose=purpose)
    if not verdict.accepted:
        event(log, "signature.refused", logging.WARNING, model=manifest.model, digest=manifest.digest, reason=verdict.reason)
        raise SignatureRefused(
            f"version {manifest.digest} of model {manifest.model!r} is refused by the signing policy: "
            f"{verdict.reason}; sign it with a key the policy trusts (`weightship publish --sign-key` or "
            "`model_signing sign`) and add the signature",
            fields={"model": manifest.model, "version": manifest.digest, "reason": verdict.reason},
        )
    return verdict.reason


def add_signatures(state: AppState, manifest: Manifest, bundles: Sequence[bytes]) -> int:
    """Check ``bundles`` against the policy, then store each write-once; how many the version has now.

    Each bundle must be a model-signing bundle and, where the policy trusts any signer for the
    model, pass it on its own (no one appends an untrusted signature). The version, with every
    signature it holds, must pass the policy for publishing: a model that requires signatures
    cannot be published unsigned.
    """
    policy = policy_of(state).for_model(manifest.model)
    for raw in bundles:
        parse_bundle(raw)
        if policy.trusts_anyone:
            _check(state, manifest, [raw], "publish")
    existing = stored_signatures(state.store, manifest.digest)
    if len(existing) + len(bundles) > MAX_SIGNATURES:
        raise SignatureRefused(
            f"version {manifest.digest} would hold more than {MAX_SIGNATURES} signatures; refused",
            fields={"model": manifest.model, "version": manifest.digest, "reason": "too many signatures"},
        )
    _check(state, manifest, [*existing, *bundles], "publish")
    for raw in bundles:
        if state.store.put_once(signature_key(manifest.digest, raw), raw):
            event(log, "signature.stored", model=manifest.model, digest=manifest.digest, bytes=len(raw))
    return len(existing) + len(bundles)


def check_serving(state: AppState, model: str, digests: Iterable[str | None]) -> None:
    """Refuse (``SignatureRefused``) when a version about to be served fails the policy as nodes check it."""
    policy = policy_of(state).for_model(model)
    if not policy.require_signature and not policy.trusts_anyone:
        return  # nothing to check: spare the store reads
    for digest in sorted({d for d in digests if d}):
        raw = state.store.get_bytes(manifest_key(digest), MAX_MANIFEST_BYTES)
        manifest = parse_manifest(raw)
        if manifest.digest != digest:
            raise SignatureRefused(
                f"the stored manifest of {digest} hashes to {manifest.digest}; the origin store was altered",
                fields={"model": model, "version": digest, "reason": "manifest replaced in the store"},
            )
        _check(state, manifest, stored_signatures(state.store, digest), "serve")
