"""The loader, given a signing policy, loads only versions that pass it with the signatures kept beside them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpu_loader.loader import Loader, LoadOptions
from tests.gpu_loader.conftest import Versions
from tests.gpu_loader.staged_versions import manifest_of
from tests.signing_material import Signer, policy_json
from weightship.signing import SignatureRefused, sign_manifest, write_directory_signatures
from weightship.signing_policy import parse_policy

pytestmark = pytest.mark.timeout(60)


def test_a_loader_with_a_policy_refuses_an_unsigned_version_and_loads_a_signed_one(
    versions: Versions, tmp_path: Path
) -> None:
    version = tmp_path / versions.single.name
    shutil.copytree(versions.single, version, symlinks=True)
    manifest = manifest_of(version)
    release, stranger = Signer.new(tmp_path / "release"), Signer.new(tmp_path / "stranger")
    keys = [{"id": "release", "public_key": release.public_pem}]
    options = LoadOptions(signing_policy=parse_policy(policy_json(manifest.model, keys=keys)))

    with Loader(options) as loader:
        with pytest.raises(SignatureRefused, match="unsigned"):
            loader.load(version, verify="full")
        write_directory_signatures(version, [sign_manifest(manifest, stranger.private_pem)])
        with pytest.raises(SignatureRefused, match="unknown key"):
            loader.load(version, verify="full")
        write_directory_signatures(version, [sign_manifest(manifest, release.private_pem)])
        result = loader.load(version, verify="full")

    assert result.tensors
