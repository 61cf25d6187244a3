"""A policy file followed as it changes: rewritten, swapped like a ConfigMap, or broken by a bad rewrite."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.signing_material import Signer, policy_json
from weightship.errors import ValidationError
from weightship.signing_policy import PolicyFile, SigningPolicy

pytestmark = pytest.mark.timeout(30)

MODEL = "tiny-signed"


def _trusted(policy: SigningPolicy) -> set[str]:
    return {k.name for k in policy.for_model(MODEL).keys}


def _error(followed: PolicyFile) -> ValidationError | None:
    return followed.error  # read through a call: the file's error changes under each look


def _keys(*signers: tuple[str, Signer]) -> bytes:
    return policy_json(MODEL, keys=[{"id": name, "public_key": s.public_pem} for name, s in signers])


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as editors and ``kubectl cp`` do: a new file renamed over the old one."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_bytes(data)
    os.replace(fresh, path)


@pytest.mark.parametrize("how", ["in_place", "renamed_over"])
def test_a_rewritten_policy_file_takes_effect_at_the_next_look(tmp_path: Path, how: str) -> None:
    one, two = Signer.new(tmp_path / "one"), Signer.new(tmp_path / "two")
    path = tmp_path / "policy.json"
    path.write_bytes(_keys(("one", one)))
    followed = PolicyFile(path)
    assert _trusted(followed.current()) == {"one"}
    assert (followed.generation, followed.refresh()) == (1, False)

    rotated = _keys(("one", one), ("two", two))
    path.write_bytes(rotated) if how == "in_place" else _replace(path, rotated)

    assert followed.refresh()
    assert (_trusted(followed.current()), followed.generation) == ({"one", "two"}, 2)
    _replace(path, rotated)  # the same content again (another key of its ConfigMap changed): no new policy
    assert not followed.refresh()
    assert followed.generation == 2


def test_a_configmap_update_swapping_the_symlinked_directory_takes_effect(tmp_path: Path) -> None:
    # The kubelet's layout: policy.json -> ..data/policy.json, ..data -> ..<timestamp>/; an update
    # writes a new timestamped directory and renames a new ..data link over the old one.
    one, two = Signer.new(tmp_path / "one"), Signer.new(tmp_path / "two")
    mount = tmp_path / "signing"
    mount.mkdir()

    def publish(stamp: str, signer: Signer) -> None:
        version = mount / f"..{stamp}"
        version.mkdir()
        doc = {"models": {MODEL: {"require_signature": True, "keys": [{"id": "release", "public_key_file": "release.pub"}]}}}
        (version / "policy.json").write_text(json.dumps(doc))  # byte for byte the same file each time
        (version / "release.pub").write_text(signer.public_pem)
        (mount / "..data_tmp").symlink_to(version.name)
        os.replace(mount / "..data_tmp", mount / "..data")

    publish("2026_01", one)
    for name in ("policy.json", "release.pub"):
        (mount / name).symlink_to(f"..data/{name}")
    followed = PolicyFile(mount / "policy.json")
    before = followed.current().for_model(MODEL).keys[0].public_key

    publish("2026_02", two)

    assert followed.refresh()
    after = followed.current().for_model(MODEL).keys[0].public_key
    assert (before, after) == (one.key.public_key(), two.key.public_key())


def test_a_changed_key_file_the_policy_names_takes_effect(tmp_path: Path) -> None:
    one, two = Signer.new(tmp_path / "one"), Signer.new(tmp_path / "two")
    path = tmp_path / "policy.json"
    (tmp_path / "release.pub").write_text(one.public_pem)
    path.write_bytes(policy_json(MODEL, keys=[{"id": "release", "public_key_file": "release.pub"}]))
    followed = PolicyFile(path)
    followed.current()

    _replace(tmp_path / "release.pub", two.public_pem.encode())

    assert followed.refresh()
    assert followed.current().for_model(MODEL).keys[0].public_key == two.key.public_key()


def test_a_rewrite_that_does_not_parse_keeps_the_last_good_policy_until_fixed(tmp_path: Path) -> None:
    one, two = Signer.new(tmp_path / "one"), Signer.new(tmp_path / "two")
    path = tmp_path / "policy.json"
    path.write_bytes(_keys(("one", one)))
    followed = PolicyFile(path)
    followed.current()

    _replace(path, b'{"models": {"tiny-signed": {"require_signature": tru')
    assert not followed.refresh()
    first = _error(followed)
    assert first is not None
    assert str(path) in first.message
    assert "not JSON" in first.message
    assert _trusted(followed.last_good()) == {"one"}
    with pytest.raises(ValidationError, match="not JSON"):
        followed.current()  # the control plane's view: the file as it is now is an error
    assert _error(followed) is first, "the same bad file is one error, however often it is looked at"

    _replace(path, b"[]")
    assert not followed.refresh()
    assert _error(followed) not in (first, None), "a new bad version of the file is a new error"
    assert followed.generation == 1

    _replace(path, _keys(("two", two)))
    assert followed.refresh()
    assert (_error(followed), _trusted(followed.current()), followed.generation) == (None, {"two"}, 2)


def test_a_policy_file_that_never_parsed_is_an_error(tmp_path: Path) -> None:
    followed = PolicyFile(tmp_path / "absent.json")

    with pytest.raises(ValidationError, match="cannot be read"):
        followed.last_good()
    assert followed.policy is None
