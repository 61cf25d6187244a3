"""Interoperability with the real ``model_signing`` library: each side verifies what the other signed.

Key pairs and certificates (a self-signed root issuing a code-signing leaf) are made on the spot;
both methods work offline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from model_signing import hashing as ms_hashing
from model_signing import signing as ms_signing
from model_signing import verifying as ms_verifying

from tests.signing_material import CertificateAuthority, Signer, policy_json
from weightship.manifest import Manifest, build_manifest
from weightship.signing import SIGNATURE_FILE, check_version, sign_manifest
from weightship.signing_policy import parse_policy

pytestmark = pytest.mark.timeout(30)

MODEL = "tiny-signed"


def _model_dir(root: Path) -> Path:
    model = root / MODEL  # model_signing names the statement's subject after the directory
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"layers": 2}')
    (model / "sub" / "weights.bin.txt").write_bytes(b"w" * 70_000)
    (model / ".gitattributes").write_text("* binary\n")
    return model


def _sign_config() -> ms_signing.Config:
    return ms_signing.Config()  # type: ignore[no-untyped-call]  # the library's constructors are unannotated


def _verify_config() -> ms_verifying.Config:
    return ms_verifying.Config()  # type: ignore[no-untyped-call]


def _manifest(model: Path) -> Manifest:
    return build_manifest(model, MODEL, chunk_size=64 * 1024)


def test_directory_signed_by_model_signing_with_a_key_is_accepted(tmp_path: Path) -> None:
    model, signer = _model_dir(tmp_path), Signer.new(tmp_path / "keys")
    hashing = ms_hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE])  # type: ignore[no-untyped-call]
    _sign_config().use_elliptic_key_signer(private_key=signer.key_file).set_hashing_config(hashing).sign(
        model, model / SIGNATURE_FILE
    )
    policy = parse_policy(policy_json(MODEL, keys=[{"id": "release", "public_key": signer.public_pem}]))

    verdict = check_version(_manifest(model), [(model / SIGNATURE_FILE).read_bytes()], policy.for_model(MODEL))

    assert verdict.accepted, verdict.reason
    assert "release" in verdict.reason


def test_directory_signed_by_model_signing_with_a_certificate_is_accepted(tmp_path: Path) -> None:
    model, ca = _model_dir(tmp_path), CertificateAuthority.new()
    signer = ca.issue(tmp_path / "ci", "release@example.com")
    _sign_config().use_certificate_signer(
        private_key=signer.key_file, signing_certificate=signer.cert_file, certificate_chain=[signer.chain_file]
    ).sign(model, model / SIGNATURE_FILE)
    policy = parse_policy(
        policy_json(MODEL, certificates=[{"id": "ci", "roots": ca.pem, "identities": ["release@example.com"]}])
    )

    verdict = check_version(_manifest(model), [(model / SIGNATURE_FILE).read_bytes()], policy.for_model(MODEL))

    assert verdict.accepted, verdict.reason


def test_model_signing_verifies_a_directory_weightship_signed_with_a_key(tmp_path: Path) -> None:
    model, signer = _model_dir(tmp_path), Signer.new(tmp_path / "keys")
    (model / SIGNATURE_FILE).write_bytes(sign_manifest(_manifest(model), signer.private_pem))

    _verify_config().use_elliptic_key_verifier(public_key=signer.public_file).verify(model, model / SIGNATURE_FILE)


def test_model_signing_verifies_a_directory_weightship_signed_with_a_certificate(tmp_path: Path) -> None:
    model, ca = _model_dir(tmp_path), CertificateAuthority.new()
    signer = ca.issue(tmp_path / "ci", "release@example.com")
    bundle = sign_manifest(_manifest(model), signer.private_pem, certificate_chain_pem=signer.chain_pem)
    (model / SIGNATURE_FILE).write_bytes(bundle)

    _verify_config().use_certificate_verifier(certificate_chain=[tmp_path / "ci" / "ca.pem"]).verify(
        model, model / SIGNATURE_FILE
    )


def test_model_signing_refuses_a_weightship_signed_directory_whose_file_changed(tmp_path: Path) -> None:
    model, signer = _model_dir(tmp_path), Signer.new(tmp_path / "keys")
    (model / SIGNATURE_FILE).write_bytes(sign_manifest(_manifest(model), signer.private_pem))
    (model / "config.json").write_text('{"layers": 3}')

    with pytest.raises(ValueError, match="Hash mismatch"):
        _verify_config().use_elliptic_key_verifier(public_key=signer.public_file).verify(
            model, model / SIGNATURE_FILE
        )
