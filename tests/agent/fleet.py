"""The world agent fault tests run in: the real control plane, with a fault proxy on its blob URLs.

``Fleet`` holds a ``ControlPlaneProcess`` whose ``WEIGHTSHIP_PUBLIC_URL`` is a ``FaultProxy`` in
front of it, an ``agent`` token minted over the API, and the operator's moves as one-liners over
the real REST API: ``publish`` (the real publish flow, ``Client.publish_directory``), ``point``
(compare-and-swap of the pointer), ``rollback``, and ``node`` (what ``GET /v1/nodes`` says about
an agent). One ``Fleet`` serves a whole test module; each test uses its own model and deployment
names, so tests never see each other's pointers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.agent.controlplane_process import ControlPlaneProcess
from weightship.errors import NotFoundError
from weightship.manifest import Manifest, parse_manifest
from weightship.schemas import Deployment, NodeInfo, VersionState
from weightship.testing import TEST_CHUNK, FaultProxy


class Fleet:
    """A control-plane process, the fault proxy its blob URLs go through, and an agent token."""

    def __init__(self, workdir: Path) -> None:
        self.proxy = FaultProxy()
        self.proxy.start()
        self.cp = ControlPlaneProcess(workdir, public_url=self.proxy.url)
        self.proxy.upstream = self.cp.url
        self.agent_token = ""
        #: an enrolment token minted for caches: the cache role is bound to it, never self-declared
        self.cache_token = ""

    def start(self) -> None:
        """Start the control plane, wait until it is ready, and mint the agents' token."""
        self.cp.start()
        self.cp.wait_ready()
        with self.cp.client() as admin:
            self.agent_token = admin.create_token("agent-tests", "agent").token
            self.cache_token = admin.create_token("cache-tests", "agent", node_role="cache").token

    def close(self) -> None:
        """Stop the control plane and the proxy."""
        self.cp.stop()
        self.proxy.stop()

    def publish(self, model_dir: Path, model: str, label: str) -> Manifest:
        """Publish ``model_dir`` as ``model`` (64 KiB chunks) labelled ``label``; its manifest as stored."""
        with self.cp.client() as admin:
            version = admin.publish_directory(model_dir, model, [label], chunk_size=TEST_CHUNK).version
            manifest = parse_manifest(admin.get_manifest(model, version.digest))
        assert manifest.digest == version.digest
        return manifest

    def point(self, deployment: str, model: str, ref: str) -> Deployment:
        """Move ``deployment`` (created on first use) to ``ref``, with If-Match on its current epoch."""
        with self.cp.client() as admin:
            try:
                epoch = admin.get_deployment(deployment).epoch
            except NotFoundError:
                epoch = admin.create_deployment(deployment, model).epoch
            return admin.set_pointer(deployment, ref, expected_epoch=epoch, reason="agent test")

    def rollback(self, deployment: str) -> Deployment:
        """``weightship rollback``: the previous stable again, at a new epoch."""
        with self.cp.client() as admin:
            return admin.rollback(deployment, reason="agent test")

    def node(self, name: str) -> NodeInfo | None:
        """What ``GET /v1/nodes`` says about the agent called ``name``."""
        with self.cp.client() as admin:
            return next((n for n in admin.list_nodes() if n.name == name), None)

    def failed(self, node: str, digest: str) -> Failure | None:
        """``node``'s last report as the control plane stores it, once it says ``digest`` failed."""
        info = self.node(node)
        for item in info.inventory if info else []:
            if info and item.digest == digest and item.state == VersionState.failed:
                return Failure(item.error or "", info)
        return None


@dataclass(frozen=True)
class Failure:
    """A version a node reported failed: why, and the whole report it came in."""

    error: str
    node: NodeInfo
