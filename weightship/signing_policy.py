"""Trust policy: which signatures a model's versions need, read from a file the node's operator owns.

The policy is JSON (a file, or a Kubernetes ConfigMap or Secret mounted as one)::

    {
      "models": {
        "llama-tiny": {
          "require_signature": true,
          "keys": [
            {"id": "release-2027", "public_key_file": "release-2027.pub"},
            {"id": "release-2026", "public_key": "-----BEGIN PUBLIC KEY-----...",
             "retired": true, "keep_serving": true}
          ],
          "certificates": [
            {"id": "ci", "roots_file": "ca.pem", "identities": ["release@example.com"]}
          ]
        }
      },
      "default": {"require_signature": false}
    }

A model not named takes ``default`` (no signature required and no signer trusted, unless it
says otherwise). A key is trusted for the model it is listed under only. A **retired** key signs
nothing new (the control plane refuses its signatures at publish and pointer moves) and its
existing versions keep serving on nodes only while ``keep_serving`` is true; set it false to
revoke a leaked key everywhere at once. A certificate entry trusts leaf certificates that chain to
one of its ``roots`` and whose subject common name, e-mail or URI names one of ``identities``.
Files named by ``*_file`` are relative to the policy file.

The agents read this from their own configuration, never from the control plane, so a control
plane, database or bucket that was taken over cannot widen what a node accepts.

A ``PolicyFile`` follows the file as it changes (a key rotation, a revoked key): one ``stat`` per
look, a read and a parse only when the file, or a key or root file it names, changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from weightship.errors import ValidationError

__all__ = [
    "CertificateTrust",
    "KeyTrust",
    "ModelPolicy",
    "PolicyFile",
    "SigningPolicy",
    "key_id",
    "load_policy",
    "parse_policy",
]

MAX_POLICY_BYTES = 4 * 1024 * 1024


def key_id(public_key: ec.EllipticCurvePublicKey) -> str:
    """The key's id: SHA-256 of its PEM SubjectPublicKeyInfo (the hint model_signing records)."""
    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


@dataclass(frozen=True)
class KeyTrust:
    """One accepted public key for a model."""

    name: str
    public_key: ec.EllipticCurvePublicKey
    retired: bool = False
    keep_serving: bool = True

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)


@dataclass(frozen=True)
class CertificateTrust:
    """Accepted signing certificates for a model: chaining to ``roots`` and naming one of ``identities``."""

    name: str
    roots: tuple[x509.Certificate, ...]
    identities: frozenset[str]
    retired: bool = False
    keep_serving: bool = True


@dataclass(frozen=True)
class ModelPolicy:
    """What one model's versions need: whether a signature is required, and whose counts."""

    model: str
    require_signature: bool = False
    keys: tuple[KeyTrust, ...] = ()
    certificates: tuple[CertificateTrust, ...] = ()

    @property
    def trusts_anyone(self) -> bool:
        return bool(self.keys or self.certificates)


@dataclass(frozen=True)
class SigningPolicy:
    """Every model's policy, and the default for models the file does not name."""

    models: Mapping[str, ModelPolicy] = field(default_factory=dict)
    default: ModelPolicy = field(default_factory=lambda: ModelPolicy(model="*"))
    source: str = "built-in (no signature required)"

    def for_model(self, model: str) -> ModelPolicy:
        """The policy that applies to ``model``."""
        found = self.models.get(model)
        if found is not None:
            return found
        return ModelPolicy(
            model=model,
            require_signature=self.default.require_signature,
            keys=self.default.keys,
            certificates=self.default.certificates,
        )


def _fail(source: str, where: str, what: str) -> ValidationError:
    return ValidationError(f"signing policy {source}: {where}: {what}; fix the policy file")


def _pem(doc: Mapping[str, Any], name: str, base: Path | None, source: str, where: str) -> bytes:
    inline, path = doc.get(name), doc.get(f"{name}_file")
    if isinstance(inline, str) and inline.strip():
        return inline.encode("utf-8")
    if isinstance(path, str) and path:
        target = (base / path) if base is not None else Path(path)
        try:
            return target.read_bytes()
        except OSError as exc:
            raise _fail(source, where, f"cannot read {name}_file {str(target)!r} ({exc.strerror})") from exc
    raise _fail(source, where, f"needs {name} (PEM text) or {name}_file (a path)")


def _bool(doc: Mapping[str, Any], name: str, default: bool, source: str, where: str) -> bool:
    value = doc.get(name, default)
    if not isinstance(value, bool):
        raise _fail(source, where, f"{name} must be true or false")
    return value


def _key(doc: Any, base: Path | None, source: str, where: str) -> KeyTrust:
    if not isinstance(doc, dict):
        raise _fail(source, where, "a key entry must be an object")
    pem = _pem(doc, "public_key", base, source, where)
    try:
        public = serialization.load_pem_public_key(pem)
    except ValueError as exc:
        raise _fail(source, where, "public_key is not a PEM public key") from exc
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise _fail(source, where, "public_key must be an elliptic-curve key (P-256, P-384 or P-521)")
    return KeyTrust(
        name=str(doc.get("id") or key_id(public)[:16]),
        public_key=public,
        retired=_bool(doc, "retired", False, source, where),
        keep_serving=_bool(doc, "keep_serving", True, source, where),
    )


def _certificates(doc: Any, base: Path | None, source: str, where: str) -> CertificateTrust:
    if not isinstance(doc, dict):
        raise _fail(source, where, "a certificate entry must be an object")
    try:
        roots = tuple(x509.load_pem_x509_certificates(_pem(doc, "roots", base, source, where)))
    except ValueError as exc:
        raise _fail(source, where, "roots is not PEM certificates") from exc
    identities = doc.get("identities")
    if not isinstance(identities, list) or not identities or not all(isinstance(i, str) for i in identities):
        raise _fail(source, where, "identities must be a non-empty list of names (CN, e-mail or URI)")
    return CertificateTrust(
        name=str(doc.get("id") or "certificates"),
        roots=roots,
        identities=frozenset(identities),
        retired=_bool(doc, "retired", False, source, where),
        keep_serving=_bool(doc, "keep_serving", True, source, where),
    )


def _model(model: str, doc: Any, base: Path | None, source: str) -> ModelPolicy:
    where = f"model {model!r}"
    if not isinstance(doc, dict):
        raise _fail(source, where, "must be an object")
    keys = doc.get("keys", [])
    certs = doc.get("certificates", [])
    if not isinstance(keys, list) or not isinstance(certs, list):
        raise _fail(source, where, "keys and certificates must be lists")
    policy = ModelPolicy(
        model=model,
        require_signature=_bool(doc, "require_signature", False, source, where),
        keys=tuple(_key(k, base, source, f"{where} key {i}") for i, k in enumerate(keys)),
        certificates=tuple(_certificates(c, base, source, f"{where} certificates {i}") for i, c in enumerate(certs)),
    )
    if policy.require_signature and not policy.trusts_anyone:
        raise _fail(source, where, "require_signature is true but no key or certificate is trusted")
    return policy


def parse_policy(raw: bytes, *, base: Path | None = None, source: str = "<policy>") -> SigningPolicy:
    """The policy in ``raw`` (JSON); ``base`` is where ``*_file`` paths are relative to."""
    if len(raw) > MAX_POLICY_BYTES:
        raise _fail(source, "file", f"larger than {MAX_POLICY_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _fail(source, "file", f"not JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("models", {}), dict):
        raise _fail(source, "file", 'must be an object with "models" (an object by model name)')
    models = {name: _model(name, body, base, source) for name, body in doc.get("models", {}).items()}
    default = _model("*", doc.get("default", {}), base, source)
    return SigningPolicy(models=models, default=default, source=source)


def load_policy(path: Path) -> SigningPolicy:
    """The policy in the file at ``path``."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValidationError(
            f"signing policy {str(path)!r} cannot be read ({exc.strerror}); fix the path or the mount"
        ) from exc
    return parse_policy(raw, base=path.parent, source=str(path))


#: what tells one version of a file from another: device, inode, modification time (ns), size
_Stat = tuple[int, int, int, int] | None


def _stat(path: Path) -> _Stat:
    try:
        found = os.stat(path)  # follows symlinks: a ConfigMap update swaps the directory a symlink names
    except OSError:
        return None
    return (found.st_dev, found.st_ino, found.st_mtime_ns, found.st_size)


def _named_files(raw: bytes, base: Path) -> tuple[Path, ...]:
    """The key and root files a policy document names: read with it, so a change to one is a change too."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return ()
    if not isinstance(doc, dict) or not isinstance(doc.get("models", {}), dict):
        return ()
    found: list[Path] = []
    for section in [*doc.get("models", {}).values(), doc.get("default", {})]:
        for kind in ("keys", "certificates"):
            entries = section.get(kind) if isinstance(section, dict) else None
            for entry in entries if isinstance(entries, list) else []:
                for name in ("public_key_file", "roots_file"):
                    value = entry.get(name) if isinstance(entry, dict) else None
                    if isinstance(value, str) and value:
                        found.append(base / value)
    return tuple(dict.fromkeys(found))


class PolicyFile:
    """A policy file followed as it changes: read again whenever its stat signature moves.

    The signature is the device, inode, modification time and size of the file (following
    symlinks: Kubernetes updates a mounted ConfigMap or Secret by swapping the directory a symlink
    names, so the path then leads to another inode) and of each key or root file it names. Looking
    costs one ``stat`` per file; a read and a parse happen only on a change. ``generation`` counts
    the policies taken: it moves when a changed file parses into a different policy. A changed file
    that cannot be read or parsed leaves the last good policy in effect and its reason in
    ``error`` (a new error object per bad version of the file), until the file changes again.
    Safe to share between threads.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        #: how many different policies were taken from the file (0: none yet)
        self.generation = 0
        #: why the file as it is now is not in effect (``None``: it is)
        self.error: ValidationError | None = None
        self._policy: SigningPolicy | None = None
        self._named: tuple[Path, ...] = ()
        self._stamp: tuple[_Stat, ...] | None = None
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        """Read the file again if it changed since the last look; whether another policy took effect."""
        with self._lock:
            seen = _stat(self.path)
            if self._stamp is not None and (seen, *map(_stat, self._named)) == self._stamp:
                return False
            try:
                raw = self.path.read_bytes()
            except OSError as exc:
                self._stamp = (seen, *map(_stat, self._named))
                self.error = ValidationError(
                    f"signing policy {str(self.path)!r} cannot be read ({exc.strerror}); fix the path or the mount"
                )
                return False
            self._named = _named_files(raw, self.path.parent)
            self._stamp = (seen, *map(_stat, self._named))  # before the key files are read: a change meanwhile is seen
            try:
                policy = parse_policy(raw, base=self.path.parent, source=str(self.path))
            except ValidationError as exc:
                self.error = exc
                return False
            self.error = None
            if policy == self._policy:
                return False  # rewritten with the same content (another key of the ConfigMap changed)
            self._policy = policy
            self.generation += 1
            return True

    @property
    def policy(self) -> SigningPolicy | None:
        """The policy last read without error, as of the last look (``None`` before a good read)."""
        return self._policy

    def current(self) -> SigningPolicy:
        """The policy in the file as it is now; ``ValidationError`` while it cannot be read or parsed."""
        self.refresh()
        if self.error is not None:
            raise ValidationError(self.error.message)  # a fresh one: the stored error is raised again and again
        assert self._policy is not None
        return self._policy

    def last_good(self) -> SigningPolicy:
        """The policy last read without error; ``ValidationError`` when the file never held a good one."""
        self.refresh()
        if self._policy is None:
            assert self.error is not None
            raise ValidationError(self.error.message)
        return self._policy
