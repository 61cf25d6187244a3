"""Cross-version poisoning on a node, with forged registry rows injected behind the control plane's back.

The control plane refuses, at commit, a manifest that re-describes a known blob. These tests
assume it did not (an attacker with database access, a buggy control plane, an old registry):
the forged version is written straight into the origin's ``manifests/`` and the ``versions``
table. Whatever the registry says, a node may mark a version verified only from bytes it hashed
itself under that version's chunk geometry, so the version it serves either has exactly the bytes
its manifest's chunk digests name, or never becomes ready.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from controlplane.persistence.rows import VersionRow
from tests.agent.agent_processes import Spawn, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from tests.agent.fleet import Fleet
from weightship.digests import hex_of, sha256_hex
from weightship.manifest import FileEntry, Manifest, canonical_json, parse_manifest
from weightship.schemas import FetchFailure
from weightship.testing import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def inject_version(cp: ControlPlaneProcess, doc: dict[str, Any]) -> Manifest:
    """Store ``doc`` as a ready version, bypassing publish and commit (and every check they make)."""
    manifest = parse_manifest(canonical_json(doc))
    path = cp.workdir / "origin" / "manifests" / "sha256" / hex_of(manifest.digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(manifest.raw)
    engine = create_engine(f"sqlite:///{cp.database}")
    try:
        with Session(engine) as session:
            session.add(
                VersionRow(
                    digest=manifest.digest,
                    model=manifest.model,
                    size=manifest.total_size,
                    files=len(manifest.files),
                    manifest_size=len(manifest.raw),
                    state="ready",
                    created_by="forger",
                )
            )
            session.commit()
    finally:
        engine.dispose()
    return manifest


def weights_of(manifest: Manifest) -> FileEntry:
    """The safetensors file of a test model."""
    return next(f for f in manifest.files if f.path.endswith(".safetensors"))


def forged(base: Manifest, weights_doc: dict[str, Any], chunk_size: int | None = None) -> dict[str, Any]:
    """``base``'s manifest with its weights entry replaced by ``weights_doc`` (and maybe another chunk size)."""
    doc = base.to_json()
    doc["metadata"] = {**doc["metadata"], "forged": "yes"}
    if chunk_size is not None:
        doc["chunk_size"] = chunk_size
    doc["files"] = [weights_doc if f["path"] == weights_of(base).path else f for f in doc["files"]]
    return doc


def assert_bytes_match_manifest(version_dir: Path, manifest: Manifest) -> None:
    """Every chunk of every file under ``version_dir`` hashes to ``manifest``'s digest for it."""
    for entry in manifest.files:
        data = (version_dir / entry.path).read_bytes()
        assert len(data) == entry.size, entry.path
        for index, expected in enumerate(entry.chunks):
            start, end = entry.chunk_range(index, manifest.chunk_size)
            assert sha256_hex(data[start:end]) == expected, f"{entry.path} chunk {index} is not what the manifest says"


async def test_a_file_claiming_a_trusted_blob_is_never_linked_into_the_trusted_version(
    spawn: Spawn,
    fleet: Fleet,
    proxy: FaultProxy,
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    # Honest A; the attacker's own honest version C (other bytes, same layout); and forged B: C's
    # bytes and chunk digests, but claiming A's weights sha256. Every chunk of B is consistent, so a
    # node may well serve B; what it must never do is hand B's bytes to A because of B's claim.
    a = fleet.publish(make_model("honest", tensors_mb=0.5, seed=11), model, "honest")
    c = fleet.publish(make_model("evil", tensors_mb=0.5, seed=12), model, "evil")
    assert weights_of(a).size == weights_of(c).size
    assert weights_of(a).sha256 != weights_of(c).sha256
    lie = {**weights_of(c).to_json(), "sha256": weights_of(a).sha256}
    b = inject_version(fleet.cp, forged(c, lie))

    agent = spawn("node-poison", extra=["--chunk-attempts", "2"])
    await agent.ready()
    fleet.point(deployment, model, "evil")
    await agent.serving(c.digest)
    fleet.point(deployment, model, b.digest)
    served_b = await agent.serving(b.digest)
    assert served_b.path is not None
    assert_bytes_match_manifest(Path(served_b.path), b)  # B holds what its chunk digests say: C's bytes

    fleet.point(deployment, model, "honest")
    served = await agent.serving(a.digest)
    assert served.path is not None
    a_dir = Path(served.path)
    assert_bytes_match_manifest(a_dir, a)
    origin = fleet.cp.workdir / "origin" / "blobs" / "sha256" / weights_of(a).sha256
    assert (a_dir / weights_of(a).path).read_bytes() == origin.read_bytes()
    assert os.stat(a_dir / weights_of(a).path).st_ino != os.stat(Path(served_b.path) / weights_of(b).path).st_ino
    assert "staging.link_refused" in agent.log()

    # After a restart (the store reloads what it verified) the node still serves A's own bytes.
    agent.stop()
    agent.start()
    await agent.ready()
    again = await agent.serving(a.digest)
    assert again.path is not None
    assert_bytes_match_manifest(Path(again.path), a)


async def test_a_forged_version_re_describing_a_held_blob_never_becomes_ready(
    spawn: Spawn,
    fleet: Fleet,
    proxy: FaultProxy,
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    # The finding as filed: a manifest names a blob the node already holds, with another chunk size
    # and made-up chunk digests. Neither the held file nor the origin's bytes match them.
    a = fleet.publish(make_model("honest", tensors_mb=0.5, seed=21), model, "honest")
    weights = weights_of(a)
    geometry = a.chunk_size * 2
    made_up = [sha256_hex(f"made up {i}".encode()) for i in range(-(-weights.size // geometry))]
    f = inject_version(fleet.cp, forged(a, {**weights.to_json(), "chunks": made_up}, chunk_size=geometry))

    agent = spawn("node-forged", extra=["--chunk-attempts", "2"])
    await agent.ready()
    fleet.point(deployment, model, "honest")
    await agent.serving(a.digest)
    fleet.point(deployment, model, f.digest)
    failure = await eventually(lambda: fleet.failed("node-forged", f.digest), 60, "the node to report F failed")
    item = next(i for i in failure.node.inventory if i.digest == f.digest)
    assert item.problem is not None
    assert item.problem.reason == FetchFailure.corrupt_origin
    assert item.problem.blob == weights.sha256
    assert "staging.link_refused" in agent.log()
    assert not (agent.data_dir / "versions" / hex_of(f.digest)).exists()
    view = await agent.deployment()
    assert view is not None
    assert (view.digest, view.ready) == (a.digest, True), "the node keeps serving A"

    # A restart trusts nothing it did not verify: F is still not ready, A still served intact.
    agent.stop()
    agent.start()
    await agent.ready()
    view = await agent.serving(a.digest)
    assert view.path is not None
    assert_bytes_match_manifest(Path(view.path), a)
    assert not (agent.data_dir / "versions" / hex_of(f.digest)).exists()
