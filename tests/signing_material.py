"""Signing keys and certificates for the signing tests, made on the spot with ``cryptography``.

``Signer`` holds an EC P-256 key (PEM files on disk for the ``model_signing`` library) and,
when made by a ``CertificateAuthority``, a leaf certificate naming an identity; the authority
can also issue an expired leaf.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertificateAuthority", "Signer", "policy_json"]


def _pem_private(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _pem_public(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@dataclass
class Signer:
    """A signing key (and certificate chain), with its PEM files under ``root``."""

    root: Path
    key: ec.EllipticCurvePrivateKey
    chain: list[x509.Certificate]

    @classmethod
    def new(cls, root: Path) -> Signer:
        root.mkdir(parents=True, exist_ok=True)
        signer = cls(root, ec.generate_private_key(ec.SECP256R1()), [])
        signer.write()
        return signer

    def write(self) -> None:
        self.key_file.write_bytes(_pem_private(self.key))
        self.public_file.write_bytes(_pem_public(self.key.public_key()))
        if self.chain:
            self.cert_file.write_bytes(self.chain[0].public_bytes(serialization.Encoding.PEM))
            self.chain_file.write_bytes(b"".join(c.public_bytes(serialization.Encoding.PEM) for c in self.chain[1:]))

    @property
    def key_file(self) -> Path:
        return self.root / "signing.key"

    @property
    def public_file(self) -> Path:
        return self.root / "signing.pub"

    @property
    def cert_file(self) -> Path:
        return self.root / "signing.crt"

    @property
    def chain_file(self) -> Path:
        return self.root / "chain.pem"

    @property
    def private_pem(self) -> bytes:
        return self.key_file.read_bytes()

    @property
    def public_pem(self) -> str:
        return self.public_file.read_text()

    @property
    def chain_pem(self) -> bytes:
        return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in self.chain)


@dataclass
class CertificateAuthority:
    """A self-signed root that issues code-signing leaf certificates."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def new(cls, cn: str = "weightship test root") -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(_name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(days=30))
            .not_valid_after(now + timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @property
    def pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def issue(self, root: Path, identity: str, *, expired: bool = False) -> Signer:
        """A signer whose leaf certificate names ``identity`` (an e-mail), optionally already expired."""
        root.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        start, end = (now - timedelta(days=20), now - timedelta(days=10)) if expired else (now - timedelta(days=1), now + timedelta(days=30))
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(identity))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(identity)]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        signer = Signer(root, key, [cert, self.cert])
        signer.write()
        (root / "ca.pem").write_text(self.pem)
        return signer


def policy_json(
    model: str,
    *,
    keys: list[dict[str, Any]] | None = None,
    certificates: list[dict[str, Any]] | None = None,
    require: bool = True,
) -> bytes:
    """A policy file body trusting ``keys`` / ``certificates`` for ``model``."""
    body: dict[str, Any] = {"require_signature": require, "keys": keys or [], "certificates": certificates or []}
    return json.dumps({"models": {model: body}}).encode()
