"""The node's signature gate follows its policy file: a rewrite takes effect without a new gate."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agent.signatures import SignatureGate, load_gate
from tests.signing_material import Signer, policy_json
from weightship.manifest import Manifest, build_manifest
from weightship.signing import SignatureRefused, sign_manifest

pytestmark = pytest.mark.timeout(30)

MODEL = "gated"


class Signatures:
    """What the control plane stores for one version (the gate's ``SignatureSource``), and how often it was asked."""

    def __init__(self, bundles: list[bytes]) -> None:
        self.bundles = bundles
        self.asked = 0

    async def signatures(self, model: str, digest: str) -> list[bytes]:
        self.asked += 1
        return self.bundles


def _manifest(root: Path) -> Manifest:
    root.mkdir(parents=True)
    (root / "config.json").write_bytes(b'{"layers": 2}')
    return build_manifest(root, MODEL, chunk_size=64 * 1024)


def _write_policy(path: Path, *trusted: Signer) -> None:
    fresh = path.with_name("policy.json.new")
    fresh.write_bytes(policy_json(MODEL, keys=[{"id": f"key-{i}", "public_key": s.public_pem} for i, s in enumerate(trusted)]))
    os.replace(fresh, path)  # a new inode, as a ConfigMap update leaves


def _gate(tmp_path: Path, manifest: Manifest, signer: Signer, *trusted: Signer) -> tuple[SignatureGate, Signatures, Path]:
    policy = tmp_path / "policy.json"
    _write_policy(policy, *trusted)
    source = Signatures([sign_manifest(manifest, signer.private_pem)])
    gate = load_gate(str(policy), source)
    assert gate is not None
    return gate, source, policy


async def test_a_version_refused_is_accepted_once_the_policy_file_trusts_its_key_same_gate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    release, other = Signer.new(tmp_path / "release"), Signer.new(tmp_path / "other")
    manifest = _manifest(tmp_path / "m")
    gate, _source, policy = _gate(tmp_path, manifest, release, other)
    with pytest.raises(SignatureRefused, match="unknown key"):
        await gate.check(manifest)
    before = gate.generation

    _write_policy(policy, other, release)
    with caplog.at_level(logging.INFO, logger="agent.signatures"):
        reason = await gate.check(manifest)

    assert "key-1" in reason
    assert gate.accepted(manifest.digest)
    assert gate.generation == before + 1
    assert any("signing_policy.reloaded" in r.getMessage() and str(policy) in r.getMessage() for r in caplog.records)


async def test_a_version_accepted_before_is_checked_again_once_its_key_is_revoked(tmp_path: Path) -> None:
    release, other = Signer.new(tmp_path / "release"), Signer.new(tmp_path / "other")
    manifest = _manifest(tmp_path / "m")
    gate, source, policy = _gate(tmp_path, manifest, release, release)
    await gate.check(manifest)
    await gate.check(manifest)
    assert source.asked == 1, "a verdict is remembered while the policy is unchanged"

    _write_policy(policy, other)
    assert gate.reload()

    assert not gate.accepted(manifest.digest)
    with pytest.raises(SignatureRefused, match="unknown key"):
        await gate.check(manifest)
    assert source.asked == 2


async def test_a_rewrite_that_does_not_parse_keeps_the_last_good_policy_logged_once_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    release = Signer.new(tmp_path / "release")
    manifest = _manifest(tmp_path / "m")
    gate, _source, policy = _gate(tmp_path, manifest, release, release)
    broken = policy.with_name("policy.json.new")
    broken.write_text('{"models": ')
    os.replace(broken, policy)

    with caplog.at_level(logging.INFO, logger="agent.signatures"):
        assert not gate.reload()
        assert not gate.reload()
        await gate.check(manifest)  # still checked, under the last good policy

    invalid = [r for r in caplog.records if "signing_policy.invalid" in r.getMessage()]
    assert len(invalid) == 1
    assert invalid[0].levelno == logging.ERROR
    assert str(policy) in invalid[0].getMessage()
    assert gate.problem is not None
    assert "keeps its last good signing policy" in gate.problem
    _write_policy(policy, release)
    gate.reload()
    assert gate.problem is None
