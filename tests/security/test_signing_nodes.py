"""Signed versions, hostile cases: the nodes' own policy refuses what a taken-over control plane serves.

The control plane here has no signing policy, as one taken over (or misconfigured) would: it
stores any well-formed signature and moves pointers anywhere. Two nodes run with their own
policy file (``--signing-policy``) trusting, per model, one release key and one certificate
authority, and requiring a signature. Each attack gets a model and deployment of its own, all
served by the same two nodes; beside them, a directory signed with the ``model_signing`` library
is published as it is and served everywhere. For every attack the version is never ready on any
node, no byte of it is fetched, and the reason is shown in the heartbeat and ``weightship nodes``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from model_signing import signing as ms_signing
from typer.testing import CliRunner

from tests.agent.agent_processes import Spawn, eventually
from tests.agent.controlplane_process import ADMIN_TOKEN
from tests.agent.fleet import Fleet
from tests.agent.peers import chunk_request, peer_url, start_cache, ticket
from tests.signing_material import CertificateAuthority, Signer, policy_json
from weightship.cli import app
from weightship.digests import hex_of
from weightship.manifest import SIGNATURE_FILE, Manifest, parse_manifest
from weightship.schemas import FetchFailure, VersionInventory, VersionState
from weightship.signing import sign_manifest
from weightship.testing import TEST_CHUNK, FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ModelMaker = Callable[..., Path]


@dataclasses.dataclass
class Attack:
    """What an attack leaves the nodes to refuse: the version, the reason they must give, its kind."""

    victim: Manifest
    reason: str
    failure: FetchFailure = FetchFailure.signature_refused


@dataclasses.dataclass
class World:
    fleet: Fleet
    make_model: ModelMaker
    release: Signer
    stranger: Signer
    ca: CertificateAuthority
    root: Path
    prefix: str
    policy: dict[str, object] = dataclasses.field(default_factory=dict)

    def model(self, case: str) -> str:
        return f"{self.prefix}-{case.replace('_', '-')}"

    def trust(self, model: str) -> None:
        self.policy[model] = {
            "require_signature": True,
            "keys": [{"id": "release", "public_key": self.release.public_pem}],
            "certificates": [{"id": "ci", "roots": self.ca.pem, "identities": ["release@example.com"]}],
        }

    def publish(self, model: str, label: str, seed: int) -> Manifest:
        self.trust(model)
        return self.fleet.publish(self.make_model(f"{model}-{label}", tensors_mb=0.25, seed=seed), model, label)

    def sign(self, manifest: Manifest, bundle: bytes) -> None:
        """Store ``bundle`` as a signature of ``manifest``'s version (this control plane checks nothing)."""
        url = f"{self.fleet.cp.url}/v1/models/{manifest.model}/versions/{manifest.digest}/signatures"
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        response = httpx.post(url, json={"signatures": [bundle.decode()]}, headers=headers)
        assert response.status_code == 201, response.text


def _attack(world: World, case: str) -> Attack:
    """Set up ``case`` against a model of its own and point its deployment; what the nodes must refuse."""
    model = world.model(case)
    v1, v2 = world.publish(model, "v1", 1), world.publish(model, "v2", 2)
    release = world.release.private_pem
    if case == "unknown_key":
        world.sign(v1, sign_manifest(v1, world.stranger.private_pem))
        attack = Attack(v1, "unknown key")
    elif case == "another_model":
        world.sign(v1, sign_manifest(dataclasses.replace(v1, model="another-model"), release))
        attack = Attack(v1, "is for model 'another-model'")
    elif case == "another_version":
        world.sign(v1, sign_manifest(v2, release))
        attack = Attack(v1, "differ from this version's")
    elif case == "subset_of_files":
        world.sign(v1, sign_manifest(dataclasses.replace(v1, files=v1.files[:1]), release))
        attack = Attack(v1, "subset of the files")
    elif case == "unsigned":
        attack = Attack(v1, "unsigned: the policy requires a signature")
    elif case == "expired_certificate":
        expired = world.ca.issue(world.root / "expired", "release@example.com", expired=True)
        world.sign(v1, sign_manifest(v1, expired.private_pem, certificate_chain_pem=expired.chain_pem))
        attack = Attack(v1, "expired")
    elif case == "label_row_edited_in_the_database":
        world.sign(v1, sign_manifest(v1, release))
        with sqlite3.connect(world.fleet.cp.database, timeout=10) as db:  # the attacker writes SQL, not the API
            db.execute("UPDATE labels SET digest = ? WHERE model = ? AND label = 'v1'", (v2.digest, model))
        attack = Attack(v2, "unsigned")
    elif case == "manifest_replaced_in_the_bucket":
        world.sign(v1, sign_manifest(v1, release))
        stored = world.fleet.cp.workdir / "origin" / "manifests" / "sha256" / hex_of(v1.digest)
        stored.chmod(0o644)
        stored.write_bytes(v2.raw)  # other content under v1's name, as a bucket writer could
        attack = Attack(v1, "manifest", FetchFailure.error)
    else:
        raise AssertionError(case)
    world.fleet.point(model, model, "v1")
    return attack


def cli(fleet: Fleet, *args: str) -> str:
    env = {"WEIGHTSHIP_URL": fleet.cp.url, "WEIGHTSHIP_TOKEN": ADMIN_TOKEN, "COLUMNS": "1000"}
    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _refused(fleet: Fleet, node: str, digest: str) -> Callable[[], VersionInventory | None]:
    def probe() -> VersionInventory | None:
        info = fleet.node(node)
        item = next((i for i in info.inventory if i.digest == digest), None) if info else None
        return item if item and item.state == VersionState.failed and item.problem else None

    return probe


CASES = (
    "unknown_key",
    "another_model",
    "another_version",
    "subset_of_files",
    "unsigned",
    "expired_certificate",
    "label_row_edited_in_the_database",
)


async def test_forged_missing_expired_or_swapped_signatures_are_never_ready_on_any_node_reason_shown(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, make_model: ModelMaker, tmp_path: Path
) -> None:
    prefix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]
    world = World(
        fleet, make_model, Signer.new(tmp_path / "release"), Signer.new(tmp_path / "stranger"),
        CertificateAuthority.new(), tmp_path, prefix,
    )  # fmt: skip
    attacks = {case: _attack(world, case) for case in CASES}
    # A directory signed with the model_signing library, published as it is (model.sig picked up).
    good_model = world.model("signed-by-model-signing")
    good_dir = make_model(good_model, tensors_mb=0.25, seed=9)
    ms_signing.Config().use_elliptic_key_signer(private_key=world.release.key_file).sign(  # type: ignore[no-untyped-call]
        good_dir, good_dir / SIGNATURE_FILE
    )
    world.trust(good_model)
    with fleet.cp.client() as admin:
        published = admin.publish_directory(
            good_dir, good_model, ["v1"], chunk_size=TEST_CHUNK, signatures=[(good_dir / SIGNATURE_FILE).read_bytes()]
        )
        good = parse_manifest(admin.get_manifest(good_model, published.version.digest))
    fleet.point(good_model, good_model, "v1")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"models": world.policy}))

    deployments = [world.model(c) for c in CASES] + [good_model]
    names = (f"{prefix}-a", f"{prefix}-b")
    agents = [spawn(n, deployments=deployments, extra=["--signing-policy", str(policy)]) for n in names]
    for agent in agents:
        await agent.ready()
        await agent.serving(good.digest, name=good_model, within=30)

    for case, attack in attacks.items():
        for node in names:
            item = await eventually(_refused(fleet, node, attack.victim.digest), 30, f"{node} to refuse {case}")
            assert item.problem is not None
            assert (case, item.problem.reason) == (case, attack.failure)
            assert attack.reason in item.problem.message, case
        for agent in agents:
            view = await agent.deployment(world.model(case))
            assert view is None or view.digest != attack.victim.digest or not view.ready, f"{case}: never ready"
    refused_blobs = {
        f.sha256 for a in attacks.values() if a.failure == FetchFailure.signature_refused for f in a.victim.files
    } - {f.sha256 for f in good.files}
    assert not [s for s in proxy.served if s.blob in refused_blobs], "no byte of a refused version was fetched"
    assert "signature refused" in cli(fleet, "nodes")
    status = cli(fleet, "status", world.model("unknown_key"))
    assert "signature refused: signature by unknown key" in status


async def test_a_manifest_replaced_in_the_bucket_is_never_ready_on_any_node_reason_shown(
    spawn: Spawn, fleet: Fleet, make_model: ModelMaker, tmp_path: Path
) -> None:
    # Apart from the others: the control plane refuses to issue tickets while a node is entitled to
    # a version whose stored manifest is corrupt, which would stall the other cases' fetches too.
    prefix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]
    world = World(
        fleet, make_model, Signer.new(tmp_path / "release"), Signer.new(tmp_path / "stranger"),
        CertificateAuthority.new(), tmp_path, prefix,
    )  # fmt: skip
    attack = _attack(world, "manifest_replaced_in_the_bucket")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"models": world.policy}))
    model = world.model("manifest_replaced_in_the_bucket")
    names = (f"{prefix}-a", f"{prefix}-b")
    agents = [spawn(n, deployments=[model], extra=["--signing-policy", str(policy)]) for n in names]
    for agent in agents:
        await agent.ready()

    for node in names:
        item = await eventually(_refused(fleet, node, attack.victim.digest), 30, f"{node} to refuse the manifest")
        assert item.problem is not None
        assert attack.reason in item.problem.message
    for agent in agents:
        view = await agent.deployment(model)
        assert view is None or not view.ready, "never ready"


@dataclasses.dataclass
class Rotation:
    """A version signed by the release key, pointed at, and a node policy file rewritten as a ConfigMap is."""

    world: World
    version: Manifest
    policy: Path

    def trust(self, *keys: Signer) -> None:
        """Make the policy trust exactly ``keys`` for the version's model (a new file renamed over the old)."""
        entries = [{"id": k.root.name, "public_key": k.public_pem} for k in keys]
        fresh = self.policy.with_name("policy.json.new")
        fresh.write_bytes(policy_json(self.version.model, keys=entries))
        fresh.replace(self.policy)


def _rotation(fleet: Fleet, make_model: ModelMaker, tmp_path: Path) -> Rotation:
    prefix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]
    world = World(
        fleet, make_model, Signer.new(tmp_path / "release"), Signer.new(tmp_path / "stranger"),
        CertificateAuthority.new(), tmp_path, prefix,
    )  # fmt: skip
    model = world.model("key_rotation")
    version = world.publish(model, "v1", 5)
    world.sign(version, sign_manifest(version, world.release.private_pem))
    fleet.point(model, model, "v1")
    return Rotation(world, version, tmp_path / "policy.json")


async def test_a_node_policy_rewritten_to_trust_the_signing_key_makes_the_refused_version_ready_without_a_restart(
    spawn: Spawn, fleet: Fleet, make_model: ModelMaker, tmp_path: Path
) -> None:
    # A key rotation reaching a running node: its policy file is swapped (as a ConfigMap update
    # does) and the version refused a moment ago is fetched within seconds, not after the
    # minutes a refused version otherwise waits, by the same process. A bad rewrite on the way
    # changes nothing but the node's health report.
    rotation = _rotation(fleet, make_model, tmp_path)
    world, version = rotation.world, rotation.version
    rotation.trust(world.stranger)  # the node does not trust the release key yet
    node = f"{world.prefix}-a"
    agent = spawn(node, deployments=[version.model], extra=["--signing-policy", str(rotation.policy)])
    await agent.ready()
    refused = await eventually(_refused(fleet, node, version.digest), 30, f"{node} to refuse the version")
    assert refused.problem is not None
    assert refused.problem.reason == FetchFailure.signature_refused
    assert refused.problem.retry_at is not None
    assert refused.problem.retry_at - datetime.now(UTC) > timedelta(minutes=4), "a refusal otherwise waits minutes"
    assert agent.proc is not None
    pid = agent.proc.pid
    broken = rotation.policy.with_name("policy.json.new")
    broken.write_text('{"models": ')
    broken.replace(rotation.policy)  # a bad rewrite: the last good policy stays, and the node says so

    async def health_error() -> str | None:
        return next((e for e in (await agent.status()).health.errors if "last good signing policy" in e), None)

    assert str(rotation.policy) in await eventually(health_error, 15, "the node to report its bad policy file")
    rotation.trust(world.stranger, world.release)

    await agent.serving(version.digest, name=version.model, within=30)
    assert agent.proc.pid == pid, "the same agent process"
    assert agent.proc.poll() is None, "never restarted"
    assert agent.log().count("signing_policy.invalid") == 1
    assert "signing_policy.reloaded" in agent.log()
    assert await health_error() is None


async def test_a_cache_stops_serving_a_version_whose_key_its_rewritten_policy_revokes_and_serves_it_once_trusted(
    fleet: Fleet, make_model: ModelMaker, tmp_path: Path
) -> None:
    rotation = _rotation(fleet, make_model, tmp_path)
    world, version = rotation.world, rotation.version
    rotation.trust(world.release)
    cache = start_cache(tmp_path, fleet, f"{world.prefix}-cache", ["--signing-policy", str(rotation.policy)])
    try:
        await cache.ready()
        await eventually(lambda: "tickets.keys_read" in cache.log(), 30, "the cache to read the ticket keys")
        url, _chunk = chunk_request(peer_url(cache), version)
        auth = {"Authorization": "Ticket " + ticket(fleet, f"{world.prefix}-holder", [version.model], [version.digest])}
        async with httpx.AsyncClient(timeout=30) as http:

            def answers(status: int) -> Callable[[], Awaitable[bool]]:
                async def probe() -> bool:
                    return (await http.get(url, headers=auth)).status_code == status

                return probe

            await eventually(answers(200), 30, "the cache to serve the version")
            rotation.trust(world.stranger)  # the release key revoked
            await eventually(answers(404), 15, "the cache to stop serving the version")
            rotation.trust(world.stranger, world.release)
            await eventually(answers(200), 15, "the cache to serve the version again")
    finally:
        await cache.close()


async def test_a_rollback_to_a_version_on_disk_whose_key_the_policy_now_revokes_is_refused_until_trusted_again(
    spawn: Spawn, fleet: Fleet, make_model: ModelMaker, tmp_path: Path
) -> None:
    # Versions on disk were accepted under an older policy: a switch back to one (a rollback, as a
    # taken-over control plane could order) is judged by the policy in effect now, and downloads
    # nothing either way. The version served meanwhile keeps serving.
    rotation = _rotation(fleet, make_model, tmp_path)
    world, v1 = rotation.world, rotation.version
    rotation.trust(world.release)
    v2 = world.publish(v1.model, "v2", 6)
    world.sign(v2, sign_manifest(v2, world.release.private_pem))
    node = f"{world.prefix}-rollback"
    agent = spawn(node, deployments=[v1.model], extra=["--signing-policy", str(rotation.policy)])
    await agent.ready()
    await agent.serving(v1.digest, name=v1.model, within=30)
    fleet.point(v1.model, v1.model, "v2")
    await agent.serving(v2.digest, name=v1.model, within=30)
    downloaded = (await agent.status()).counters.bytes_downloaded

    rotation.trust(world.stranger)  # the release key revoked: v2, served already, stays served
    await eventually(lambda: "signing_policy.reloaded" in agent.log(), 15, "the node to read its new policy")
    fleet.rollback(v1.model)

    refused = await eventually(_refused(fleet, node, v1.digest), 30, f"{node} to refuse the rollback to v1")
    assert refused.problem is not None
    assert refused.problem.reason == FetchFailure.signature_refused
    assert "refused by this node's signing policy" in refused.problem.message, refused.problem.message
    view = await agent.deployment(v1.model)
    assert view is not None
    assert (view.digest, view.ready) == (v2.digest, True), "v2 keeps serving"
    local = await agent.get(f"/local/v1/versions/{v1.digest}", deployment=v1.model)
    assert local.json()["state"] == "failed", local.text

    rotation.trust(world.stranger, world.release)
    await agent.serving(v1.digest, name=v1.model, within=30)
    assert (await agent.status()).counters.bytes_downloaded == downloaded, "v1 was on disk all along"
