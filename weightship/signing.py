"""Signed versions in the OpenSSF model-signing format, built from and checked against the manifest.

A signature is a Sigstore bundle (``model.sig``) holding a DSSE envelope over an in-toto
Statement v1 whose predicate (``https://model_signing/signature/v1.0``) lists every file of the
model with its SHA-256, exactly as ``model_signing sign`` writes it for a directory serialised file
by file. A version's manifest already carries those digests, so weightship builds the same
statement from the manifest without reading a byte of the model, and verification is:

1. the bundle's signature verifies over the DSSE payload, under a key or a certificate chain the
   node's own policy (``weightship.signing_policy``) trusts for this model;
2. the statement's subject names this model, and its resources equal the manifest's files exactly
   (same paths, same digests, none missing, none extra): a signature of another model, another
   version or a subset of the files is refused;
3. the chunk digests in the manifest then guard the bytes, as for any version.

``model_signing verify`` accepts a directory weightship signed (the directory as published, with
its ``model.sig``), and weightship accepts a directory ``model_signing sign`` signed, provided the
directory is named after the model (model_signing names the subject after the directory).

Unlike model_signing, a certificate is checked at the time of verification, not at the time it
was issued: these bundles carry no trusted timestamp, so an expired certificate is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography import exceptions, x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import BaseModel, ConfigDict, Field

from weightship.errors import IntegrityError, ValidationError
from weightship.layout import META_DIR
from weightship.manifest import SIGNATURE_FILE, Manifest
from weightship.signing_policy import CertificateTrust, KeyTrust, ModelPolicy, key_id

__all__ = [
    "MAX_SIGNATURE_BYTES",
    "PREDICATE_TYPE",
    "SIGNATURE_FILE",
    "Bundle",
    "SignatureRefused",
    "SignatureUpload",
    "Verdict",
    "VersionSignatures",
    "check_version",
    "directory_signatures",
    "parse_bundle",
    "require_version",
    "sign_manifest",
    "statement_for",
    "write_directory_signatures",
]


MAX_SIGNATURE_BYTES = 64 * 1024 * 1024
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
#: what ``model_signing sign`` leaves out of a directory by default, plus the signature itself
DEFAULT_IGNORE_PATHS = (SIGNATURE_FILE, ".git", ".gitignore", ".github", ".gitattributes")
#: where a node keeps the signatures a version passed with, beside its manifest (``versions/<hex>/.weightship/``)
SIGNATURES_DIR = "signatures"
_CURVE_HASH: dict[int, type[hashes.HashAlgorithm]] = {256: hashes.SHA256, 384: hashes.SHA384, 521: hashes.SHA512}


class SignatureRefused(IntegrityError):
    """A version's signatures do not satisfy the policy for its model."""

    code = "signature_refused"


class SignatureUpload(BaseModel):
    """Signatures sent with a publish commit or added to a version later (each a ``model.sig``'s text)."""

    model_config = ConfigDict(extra="forbid")
    signatures: list[str] = Field(default_factory=list, max_length=16)


class VersionSignatures(BaseModel):
    """Every signature a version holds, as stored (oldest first); nodes check them against their own policy."""

    model: str
    digest: str
    signatures: list[str]


def _pae(payload: bytes) -> bytes:
    """DSSE pre-authentication encoding of an in-toto payload."""
    return b"DSSEv1 %d %s %d " % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload)) + payload


def _ecdsa(public_key: ec.EllipticCurvePublicKey) -> ec.ECDSA:
    algorithm = _CURVE_HASH.get(public_key.curve.key_size)
    if algorithm is None:
        raise ValidationError(f"curve {public_key.curve.name} is not supported; use P-256, P-384 or P-521")
    return ec.ECDSA(algorithm())


def statement_for(manifest: Manifest, ignore_paths: Iterable[str] = ()) -> dict[str, Any]:
    """The in-toto statement ``model_signing`` would make of the model directory ``manifest`` describes."""
    files = sorted(manifest.files, key=lambda f: f.path)
    root = hashlib.sha256(b"".join(bytes.fromhex(f.sha256) for f in files)).hexdigest()
    ignored = list(dict.fromkeys([*DEFAULT_IGNORE_PATHS, *ignore_paths]))
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": manifest.model, "digest": {"sha256": root}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "serialization": {
                "method": "files",
                "hash_type": "sha256",
                "allow_symlinks": False,
                "ignore_paths": ignored,
            },
            "resources": [{"name": f.path, "algorithm": "sha256", "digest": f.sha256} for f in files],
        },
    }


def sign_manifest(
    manifest: Manifest,
    private_key_pem: bytes,
    *,
    password: bytes | None = None,
    certificate_chain_pem: bytes | None = None,
    ignore_paths: Iterable[str] = (),
) -> bytes:
    """A ``model.sig`` bundle signing ``manifest``'s files with an EC private key (and its certificate chain)."""
    try:
        private = serialization.load_pem_private_key(private_key_pem, password)
    except (ValueError, TypeError) as exc:
        raise ValidationError(f"the signing key is not a PEM private key or needs a password ({exc})") from exc
    if not isinstance(private, ec.EllipticCurvePrivateKey):
        raise ValidationError("the signing key must be an elliptic-curve key (P-256, P-384 or P-521)")
    payload = json.dumps(statement_for(manifest, ignore_paths), sort_keys=True, separators=(",", ":")).encode()
    signature = private.sign(_pae(payload), _ecdsa(private.public_key()))
    material: dict[str, Any]
    if certificate_chain_pem:
        chain = x509.load_pem_x509_certificates(certificate_chain_pem)
        if chain[0].public_key() != private.public_key():
            raise ValidationError("the signing certificate (first in the chain) does not match the signing key")
        material = {
            "x509CertificateChain": {
                "certificates": [
                    {"rawBytes": base64.b64encode(c.public_bytes(serialization.Encoding.DER)).decode()} for c in chain
                ]
            },
            "tlogEntries": [],
        }
    else:
        material = {"publicKey": {"hint": key_id(private.public_key())}, "tlogEntries": []}
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": material,
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode(),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}],
        },
    }
    return json.dumps(bundle, indent=2).encode()


@dataclass(frozen=True)
class Bundle:
    """A parsed, not yet verified signature bundle."""

    raw: bytes
    payload: bytes
    signature: bytes
    key_hint: str | None
    chain: tuple[x509.Certificate, ...]

    @property
    def digest(self) -> str:
        """``sha256:`` of the bundle's bytes: its name in the store."""
        return "sha256:" + hashlib.sha256(self.raw).hexdigest()


def parse_bundle(raw: bytes) -> Bundle:
    """The bundle in ``raw`` (a ``model.sig``), structurally checked; nothing is trusted yet."""
    if len(raw) > MAX_SIGNATURE_BYTES:
        raise ValidationError(f"the signature is larger than {MAX_SIGNATURE_BYTES} bytes; refused")
    try:
        doc = json.loads(raw)
        envelope = doc["dsseEnvelope"]
        material = doc["verificationMaterial"]
        if envelope["payloadType"] != PAYLOAD_TYPE:
            raise ValueError(f"payload type {envelope['payloadType']!r}")
        payload = base64.b64decode(envelope["payload"], validate=True)
        signatures = envelope["signatures"]
        if len(signatures) != 1:
            raise ValueError(f"{len(signatures)} signatures in one envelope")
        signature = base64.b64decode(signatures[0]["sig"], validate=True)
        chain: tuple[x509.Certificate, ...] = ()
        hint: str | None = None
        if "x509CertificateChain" in material:
            chain = tuple(
                x509.load_der_x509_certificate(base64.b64decode(c["rawBytes"], validate=True))
                for c in material["x509CertificateChain"]["certificates"]
            )
            if not chain:
                raise ValueError("empty certificate chain")
        else:
            hint = str((material.get("publicKey") or {}).get("hint") or "") or None
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise ValidationError(
            f"the signature is not a model-signing bundle ({exc}); sign with `model_signing sign` "
            "or `weightship publish --sign-key`"
        ) from exc
    return Bundle(raw=raw, payload=payload, signature=signature, key_hint=hint, chain=chain)


@dataclass(frozen=True)
class Verdict:
    """What the policy says about a version: accepted (by whom), or refused (why, naming the key)."""

    accepted: bool
    reason: str
    signers: tuple[str, ...] = ()


def _verify_key(bundle: Bundle, trust: KeyTrust) -> bool:
    if bundle.chain or (bundle.key_hint is not None and bundle.key_hint != trust.key_id):
        return False
    try:
        trust.public_key.verify(bundle.signature, _pae(bundle.payload), _ecdsa(trust.public_key))
    except exceptions.InvalidSignature:
        return False
    return True


def _identities(cert: x509.Certificate) -> set[str]:
    names = {str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for kind in (x509.RFC822Name, x509.UniformResourceIdentifier, x509.DNSName):
            names.update(str(v) for v in san.get_values_for_type(kind))
    except x509.ExtensionNotFound:
        pass
    return names


def _can_sign(cert: x509.Certificate) -> bool:
    try:
        if cert.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature:
            return True
    except x509.ExtensionNotFound:
        pass
    try:
        return ExtendedKeyUsageOID.CODE_SIGNING in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    if cert.issuer != issuer.subject:
        return False
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, exceptions.InvalidSignature):
        return False
    return True


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def _verify_certificate(bundle: Bundle, trust: CertificateTrust, now: datetime) -> str | None:
    """``None`` when ``bundle``'s chain ends at one of ``trust``'s roots and its signature verifies; else why not."""
    leaf = bundle.chain[0]
    for cert in bundle.chain:
        if now > cert.not_valid_after_utc:
            return f"certificate {cert.subject.rfc4514_string()} expired at {cert.not_valid_after_utc.isoformat()}"
        if now < cert.not_valid_before_utc:
            return f"certificate {cert.subject.rfc4514_string()} is not valid before {cert.not_valid_before_utc}"
    current, intermediates, trusted = leaf, list(bundle.chain[1:]), False
    for _depth in range(8):
        if any(_issued_by(current, root) for root in trust.roots):
            trusted = True
            break
        parent = next((c for c in intermediates if _is_ca(c) and _issued_by(current, c)), None)
        if parent is None:
            break
        intermediates.remove(parent)
        current = parent
    if not trusted:
        return f"certificate {leaf.subject.rfc4514_string()} does not chain to a trusted root of {trust.name!r}"
    if not _can_sign(leaf):
        return f"certificate {leaf.subject.rfc4514_string()} is not for digital signatures"
    if not _identities(leaf) & trust.identities:
        return f"certificate identity {sorted(_identities(leaf))} is not one of {sorted(trust.identities)}"
    public = leaf.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        return "the signing certificate's key is not an elliptic-curve key"
    try:
        public.verify(bundle.signature, _pae(bundle.payload), _ecdsa(public))
    except exceptions.InvalidSignature:
        return "the signature does not verify under the certificate's key"
    return None


def _statement_mismatch(payload: bytes, manifest: Manifest) -> str | None:
    """``None`` when the signed statement describes exactly ``manifest``'s model and files; else how it differs."""
    try:
        doc = json.loads(payload)
        if doc.get("_type") != STATEMENT_TYPE or doc.get("predicateType") != PREDICATE_TYPE:
            return f"the signed statement is not a {PREDICATE_TYPE} statement"
        subject = doc["subject"]
        signed = {r["name"]: (r["algorithm"], r["digest"]) for r in doc["predicate"]["resources"]}
    except (ValueError, KeyError, TypeError):
        return "the signed statement is not valid model-signing JSON"
    names = [s.get("name") for s in subject] if isinstance(subject, list) else []
    if names != [manifest.model]:
        return f"the signature is for model {names[0] if names else None!r}, not {manifest.model!r}"
    have = {f.path: ("sha256", f.sha256) for f in manifest.files}
    missing = sorted(set(have) - set(signed))
    extra = sorted(set(signed) - set(have))
    if missing:
        return f"the signature covers a subset of the files: {missing[:3]} unsigned"
    if extra:
        return f"the signature names files this version lacks: {extra[:3]} (another version?)"
    changed = sorted(p for p in have if signed[p] != have[p])
    if changed:
        return f"the signed digests of {changed[:3]} differ from this version's (another version?)"
    return None


def check_version(
    manifest: Manifest,
    bundles: Sequence[bytes],
    policy: ModelPolicy,
    *,
    purpose: str = "serve",
    now: datetime | None = None,
) -> Verdict:
    """Whether ``manifest``'s version passes ``policy`` with these signatures.

    ``purpose`` ``serve`` (a node) accepts a retired signer while its ``keep_serving`` holds;
    ``publish`` (publish, pointer moves) accepts only signers that are not retired.
    """
    now = now or datetime.now(UTC)
    if not bundles:
        if policy.require_signature:
            return Verdict(False, f"unsigned: the policy requires a signature for model {manifest.model!r}")
        return Verdict(True, "unsigned; the policy does not require a signature")
    reasons: list[str] = []
    signers: list[str] = []
    for raw in bundles:
        try:
            bundle = parse_bundle(raw)
        except ValidationError as exc:
            reasons.append(exc.message)
            continue
        who, why = _signer(bundle, policy, purpose, now)
        if who is None:
            reasons.append(why)
            continue
        mismatch = _statement_mismatch(bundle.payload, manifest)
        if mismatch is not None:
            reasons.append(f"{who}: {mismatch}")
            continue
        signers.append(who)
    if signers:
        return Verdict(True, f"signed by {', '.join(signers)}", tuple(signers))
    if not policy.require_signature and not policy.trusts_anyone:
        return Verdict(True, "signed, but the policy trusts no signer and requires none")
    return Verdict(False, "; ".join(reasons) or "no signature verifies")


def _signer(bundle: Bundle, policy: ModelPolicy, purpose: str, now: datetime) -> tuple[str | None, str]:
    """The name of the trusted signer of ``bundle``, or ``None`` and why no one trusted signed it."""
    if bundle.chain:
        why = f"certificate {bundle.chain[0].subject.rfc4514_string()} is trusted by no policy entry"
        for cert_trust in policy.certificates:
            failure = _verify_certificate(bundle, cert_trust, now)
            if failure is None:
                retired = _retired(cert_trust.retired, cert_trust.keep_serving, purpose)
                if retired:
                    return None, f"certificates {cert_trust.name!r}: {retired}"
                return f"certificates {cert_trust.name!r}", ""
            why = failure
        return None, why
    for key_trust in policy.keys:
        if _verify_key(bundle, key_trust):
            retired = _retired(key_trust.retired, key_trust.keep_serving, purpose)
            if retired:
                return None, f"key {key_trust.name!r} ({key_trust.key_id[:16]}): {retired}"
            return f"key {key_trust.name!r} ({key_trust.key_id[:16]})", ""
    hint = (bundle.key_hint or "no hint")[:16]
    return None, f"signature by unknown key {hint}: not trusted for model {policy.model!r}"


def _retired(retired: bool, keep_serving: bool, purpose: str) -> str | None:
    if not retired:
        return None
    if purpose == "publish":
        return "retired; sign with a current key"
    return None if keep_serving else "retired and revoked (keep_serving is false)"


def require_version(manifest: Manifest, bundles: Sequence[bytes], policy: ModelPolicy, *, purpose: str = "serve") -> str:
    """The verdict's reason when ``policy`` accepts the version; else raises ``SignatureRefused``."""
    verdict = check_version(manifest, bundles, policy, purpose=purpose)
    if not verdict.accepted:
        raise SignatureRefused(
            f"version {manifest.digest} of model {manifest.model!r} refused by the signing policy: {verdict.reason}",
            fields={"model": manifest.model, "digest": manifest.digest, "reason": verdict.reason},
        )
    return verdict.reason


def write_directory_signatures(directory: Path, bundles: Sequence[bytes]) -> None:
    """Keep ``bundles`` in ``directory``'s ``.weightship/signatures/`` (named by digest) for loaders to check."""
    target = Path(directory) / META_DIR / SIGNATURES_DIR
    target.mkdir(parents=True, exist_ok=True)
    for raw in bundles:
        path = target / (hashlib.sha256(raw).hexdigest() + ".sig")
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(raw)
            tmp.replace(path)


def directory_signatures(directory: Path) -> list[bytes]:
    """The signatures kept with a version directory: ``.weightship/signatures/*.sig`` and a top-level ``model.sig``."""
    root = Path(directory)
    found = [p.read_bytes() for p in sorted((root / META_DIR / SIGNATURES_DIR).glob("*.sig"))]
    top = root / SIGNATURE_FILE
    if top.is_file():
        found.append(top.read_bytes())
    return found
