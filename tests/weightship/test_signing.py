"""The signing contract: a version passes its model's policy only with a trusted signature over exactly its files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.signing_material import CertificateAuthority, Signer, policy_json
from weightship.manifest import Manifest, build_manifest
from weightship.signing import SignatureRefused, check_version, require_version, sign_manifest
from weightship.signing_policy import ModelPolicy, parse_policy

pytestmark = pytest.mark.timeout(30)

MODEL = "tiny-signed"


def _manifest(root: Path, model: str = MODEL, files: dict[str, bytes] | None = None) -> Manifest:
    root.mkdir(parents=True)
    for name, data in (files or {"a.json": b"{}", "b.txt": b"bbb"}).items():
        (root / name).write_bytes(data)
    return build_manifest(root, model, chunk_size=64 * 1024)


def _key_policy(signer: Signer, **extra: object) -> ModelPolicy:
    return parse_policy(policy_json(MODEL, keys=[{"id": "release", "public_key": signer.public_pem, **extra}])).for_model(
        MODEL
    )


def test_a_signature_by_a_trusted_key_over_exactly_the_files_is_accepted(tmp_path: Path) -> None:
    signer = Signer.new(tmp_path / "k")
    manifest = _manifest(tmp_path / "m")

    assert check_version(manifest, [sign_manifest(manifest, signer.private_pem)], _key_policy(signer)).accepted


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("unknown_key", "unknown key"),
        ("other_model", "is for model 'other-model'"),
        ("other_version", "names files this version lacks"),
        ("subset", "subset of the files"),
        ("changed_digest", "differ from this version's"),
        ("unsigned", "unsigned: the policy requires a signature"),
        ("garbage", "not a model-signing bundle"),
    ],
)
def test_a_version_without_a_trusted_signature_over_exactly_its_files_is_refused(
    tmp_path: Path, case: str, reason: str
) -> None:
    signer, stranger = Signer.new(tmp_path / "k"), Signer.new(tmp_path / "s")
    manifest = _manifest(tmp_path / "m")
    other = tmp_path / "other"
    make: dict[str, Callable[[], list[bytes]]] = {
        "unknown_key": lambda: [sign_manifest(manifest, stranger.private_pem)],
        "other_model": lambda: [sign_manifest(_manifest(other, "other-model"), signer.private_pem)],
        "other_version": lambda: [
            sign_manifest(_manifest(other, files={"a.json": b"{}", "b.txt": b"bbb", "c": b"c"}), signer.private_pem)
        ],
        "subset": lambda: [sign_manifest(_manifest(other, files={"a.json": b"{}"}), signer.private_pem)],
        "changed_digest": lambda: [
            sign_manifest(_manifest(other, files={"a.json": b"{}", "b.txt": b"BBB"}), signer.private_pem)
        ],
        "unsigned": lambda: [],
        "garbage": lambda: [b"not json"],
    }
    bundles = make[case]()

    verdict = check_version(manifest, bundles, _key_policy(signer))

    assert not verdict.accepted
    assert reason in verdict.reason
    with pytest.raises(SignatureRefused, match=MODEL):
        require_version(manifest, bundles, _key_policy(signer))


def test_an_expired_certificate_is_refused_and_a_current_one_accepted(tmp_path: Path) -> None:
    ca = CertificateAuthority.new()
    manifest = _manifest(tmp_path / "m")
    policy = parse_policy(
        policy_json(MODEL, certificates=[{"id": "ci", "roots": ca.pem, "identities": ["release@example.com"]}])
    ).for_model(MODEL)
    current = ca.issue(tmp_path / "c", "release@example.com")
    expired = ca.issue(tmp_path / "e", "release@example.com", expired=True)
    other = ca.issue(tmp_path / "o", "intern@example.com")

    def verdict(signer: Signer) -> tuple[bool, str]:
        result = check_version(
            manifest, [sign_manifest(manifest, signer.private_pem, certificate_chain_pem=signer.chain_pem)], policy
        )
        return result.accepted, result.reason

    assert verdict(current)[0]
    accepted, reason = verdict(expired)
    assert not accepted
    assert "expired" in reason
    assert not verdict(other)[0]
    assert "identity" in verdict(other)[1]


def test_a_retired_key_keeps_serving_only_while_the_policy_says_so_and_never_publishes(tmp_path: Path) -> None:
    signer = Signer.new(tmp_path / "k")
    manifest = _manifest(tmp_path / "m")
    bundle = [sign_manifest(manifest, signer.private_pem)]

    assert check_version(manifest, bundle, _key_policy(signer, retired=True)).accepted
    assert not check_version(manifest, bundle, _key_policy(signer, retired=True), purpose="publish").accepted
    revoked = check_version(manifest, bundle, _key_policy(signer, retired=True, keep_serving=False))
    assert not revoked.accepted
    assert "revoked" in revoked.reason


def test_a_second_signature_by_a_trusted_key_is_enough_beside_an_untrusted_one(tmp_path: Path) -> None:
    signer, stranger = Signer.new(tmp_path / "k"), Signer.new(tmp_path / "s")
    manifest = _manifest(tmp_path / "m")
    bundles = [sign_manifest(manifest, stranger.private_pem), sign_manifest(manifest, signer.private_pem)]

    assert check_version(manifest, bundles, _key_policy(signer)).accepted


def test_a_policy_that_requires_signatures_but_trusts_no_one_is_refused_at_load() -> None:
    from weightship.errors import ValidationError

    with pytest.raises(ValidationError, match="no key or certificate is trusted"):
        parse_policy(policy_json(MODEL))
