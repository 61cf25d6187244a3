"""Signed versions, hostile cases: the nodes' own policy refuses what a taken-over control plane serves.

The control plane here has no signing policy, as one taken over (or misconfigured) would: it
stores any well-formed signature and moves pointers anywhere. Each node runs with its own policy
file (``--signing-policy``) trusting one release key (and one certificate authority) for the
model and requiring a signature. For every attack the version is never ready on any node, no
byte of it is fetched, and the reason is shown in the heartbeat and ``weightship nodes``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from tests.agent.agent_processes import Spawn, eventually
from tests.agent.controlplane_process import ADMIN_TOKEN
from tests.agent.fleet import Fleet
from tests.signing_material import CertificateAuthority, Signer
from weightship.cli import app
from weightship.digests import hex_of
from weightship.manifest import Manifest
from weightship.schemas import FetchFailure, VersionInventory, VersionState
from weightship.signing import sign_manifest
from weightship.testing import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]



@dataclasses.dataclass
class Trust:
    """The release key, a stranger's key, a certificate authority, and the nodes' policy file."""

    release: Signer
    stranger: Signer
    ca: CertificateAuthority
    policy: Path
    root: Path
    model: str


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    """This test's model, one per parametrised case: signatures are never removed, so cases must not share one."""
    return hashlib.sha256(request.node.name.encode()).hexdigest()[:12] + "-signed"


@pytest.fixture
def trust(tmp_path: Path, model: str) -> Trust:
    release, stranger = Signer.new(tmp_path / "release"), Signer.new(tmp_path / "stranger")
    ca = CertificateAuthority.new()
    policy = tmp_path / "policy.json"
    body = {
        "require_signature": True,
        "keys": [{"id": "release", "public_key": release.public_pem}],
        "certificates": [{"id": "ci", "roots": ca.pem, "identities": ["release@example.com"]}],
    }
    policy.write_text(json.dumps({"models": {model: body}}))
    return Trust(release, stranger, ca, policy, tmp_path, model)


def nodes(trust: Trust) -> tuple[str, str]:
    """Two node names of this test's own (a node name is an identity the fleet remembers)."""
    return (f"{trust.model}-a", f"{trust.model}-b")


def add_signature(fleet: Fleet, manifest: Manifest, bundle: bytes) -> None:
    """Store ``bundle`` as a signature of ``manifest``'s version (the control plane checks nothing)."""
    url = f"{fleet.cp.url}/v1/models/{manifest.model}/versions/{manifest.digest}/signatures"
    response = httpx.post(url, json={"signatures": [bundle.decode()]}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert response.status_code == 201, response.text


def cli(fleet: Fleet, *args: str) -> str:
    env = {"WEIGHTSHIP_URL": fleet.cp.url, "WEIGHTSHIP_TOKEN": ADMIN_TOKEN, "COLUMNS": "1000"}
    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


async def refused_everywhere(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, trust: Trust, victim: Manifest, reason: str, failure: FetchFailure
) -> None:
    """Both nodes report ``victim`` failed for ``reason``; neither fetched a byte of it; ``nodes`` shows why."""
    names = nodes(trust)
    agents = [spawn(name, extra=["--signing-policy", str(trust.policy)]) for name in names]
    for agent in agents:
        await agent.ready()

    def reported(name: str) -> Callable[[], VersionInventory | None]:
        def probe() -> VersionInventory | None:
            node = fleet.node(name)
            item = next((i for i in node.inventory if i.digest == victim.digest), None) if node else None
            return item if item and item.state == VersionState.failed and item.problem else None

        return probe

    for name in names:
        item = await eventually(reported(name), 30, f"{name} to report {victim.digest} refused")
        assert item.problem is not None
        assert item.problem.reason == failure
        assert reason in item.problem.message
    for agent in agents:
        view = await agent.deployment()
        assert view is None or not view.ready, "never ready on any node"
    if failure == FetchFailure.signature_refused:
        victim_blobs = {f.sha256 for f in victim.files}
        assert not [s for s in proxy.served if s.blob in victim_blobs], "no byte fetched before the check"
        assert "signature refused" in cli(fleet, "nodes")


def _resigned(manifest: Manifest, **change: object) -> Manifest:
    return dataclasses.replace(manifest, **change)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("attack", "reason"),
    [
        ("unknown_key", "unknown key"),
        ("other_model", "is for model 'another-model'"),
        ("other_version", "differ from this version's"),
        ("subset_of_files", "subset of the files"),
        ("unsigned", "unsigned: the policy requires a signature"),
        ("expired_certificate", "expired"),
    ],
)
async def test_a_forged_or_missing_signature_is_never_ready_on_any_node_reason_shown(
    spawn: Spawn,
    fleet: Fleet,
    proxy: FaultProxy,
    versions: dict[str, Manifest],
    trust: Trust,
    model: str,
    deployment: str,
    attack: str,
    reason: str,
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    expired = trust.ca.issue(trust.root / "expired", "release@example.com", expired=True)
    forged: dict[str, Callable[[], bytes | None]] = {
        "unknown_key": lambda: sign_manifest(v1, trust.stranger.private_pem),
        "other_model": lambda: sign_manifest(_resigned(v1, model="another-model"), trust.release.private_pem),
        "other_version": lambda: sign_manifest(v2, trust.release.private_pem),
        "subset_of_files": lambda: sign_manifest(_resigned(v1, files=v1.files[:1]), trust.release.private_pem),
        "unsigned": lambda: None,
        "expired_certificate": lambda: sign_manifest(
            v1, expired.private_pem, certificate_chain_pem=expired.chain_pem
        ),
    }
    bundle = forged[attack]()
    if bundle is not None:
        add_signature(fleet, v1, bundle)
    fleet.point(deployment, model, "v1")

    await refused_everywhere(spawn, fleet, proxy, trust, v1, reason, FetchFailure.signature_refused)


async def test_a_version_signed_by_the_trusted_key_is_served_by_every_node(
    spawn: Spawn, fleet: Fleet, versions: dict[str, Manifest], trust: Trust, model: str, deployment: str
) -> None:
    v1 = versions["v1"]
    add_signature(fleet, v1, sign_manifest(v1, trust.release.private_pem))
    fleet.point(deployment, model, "v1")

    agents = [spawn(name, extra=["--signing-policy", str(trust.policy)]) for name in nodes(trust)]
    for agent in agents:
        await agent.ready()
        await agent.serving(v1.digest, within=30)


async def test_a_label_row_edited_in_the_database_to_name_another_version_is_never_ready_on_any_node_reason_shown(
    spawn: Spawn,
    fleet: Fleet,
    proxy: FaultProxy,
    versions: dict[str, Manifest],
    trust: Trust,
    model: str,
    deployment: str,
) -> None:
    v1, v3 = versions["v1"], versions["v3"]
    add_signature(fleet, v1, sign_manifest(v1, trust.release.private_pem))
    with sqlite3.connect(fleet.cp.database, timeout=10) as db:  # the attacker writes SQL, not the API
        db.execute("UPDATE labels SET digest = ? WHERE model = ? AND label = 'v1'", (v3.digest, model))
    fleet.point(deployment, model, "v1")

    await refused_everywhere(spawn, fleet, proxy, trust, v3, "unsigned", FetchFailure.signature_refused)


async def test_a_manifest_replaced_in_the_bucket_is_never_ready_on_any_node_reason_shown(
    spawn: Spawn,
    fleet: Fleet,
    proxy: FaultProxy,
    versions: dict[str, Manifest],
    trust: Trust,
    model: str,
    deployment: str,
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    add_signature(fleet, v1, sign_manifest(v1, trust.release.private_pem))
    stored = fleet.cp.workdir / "origin" / "manifests" / "sha256" / hex_of(v1.digest)
    stored.chmod(0o644)
    stored.write_bytes(v2.raw)  # other content under v1's name, as a bucket writer could
    fleet.point(deployment, model, "v1")

    await refused_everywhere(spawn, fleet, proxy, trust, v1, "manifest", FetchFailure.error)
