"""Helpers for peer and cache tests: tickets from the real control plane, chunk requests, cache processes.

- ``ticket(fleet, name, deployments, versions)``: enrol a node called ``name`` for ``deployments``
  (as the admin, over the API) and ask ``POST /v1/tickets`` with its node token: a genuine ticket.
- ``peer_url(agent)``: the peer listener an agent process reports in its ``agent.json``.
- ``chunk_request(...)``: the ``GET /v1/chunks/...`` URL of chunk ``index`` of file ``file`` of a manifest.
- ``start_cache(...)``: an agent process in the cache role (no deployments), peer listener on a free port.
- ``metric(url, name)``: one value from a peer listener's ``/metrics``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.agent.agent_processes import AgentProcess
from tests.agent.controlplane_process import ADMIN_TOKEN
from tests.agent.fleet import Fleet
from weightship.manifest import Manifest
from weightship.schemas import NodeEnrolRequest


def ticket(
    fleet: Fleet, name: str, deployments: Sequence[str], versions: Sequence[str], audience: str | None = None
) -> str:
    """A ticket the control plane signs for a freshly enrolled node ``name`` (bound to ``audience`` if given)."""
    with fleet.cp.client(ADMIN_TOKEN) as admin:
        token = admin.enrol_node(NodeEnrolRequest(name=name, deployments=list(deployments))).token
    response = httpx.post(
        f"{fleet.cp.url}/v1/tickets",
        json={"versions": list(versions), "audience": audience},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["ticket"])


def peer_url(agent: AgentProcess) -> str:
    """The agent's peer listener URL (it must run with ``--peer-listen``)."""
    url = str(json.loads((agent.data_dir / "agent.json").read_text())["peer"])
    assert url, f"agent {agent.name} has no peer listener"
    return url


def chunk_request(base: str, manifest: Manifest, file: int = 0, index: int = 0) -> tuple[str, str]:
    """``(url, chunk hex)`` of chunk ``index`` of file ``file`` of ``manifest`` at peer ``base``."""
    entry = manifest.files[file]
    chunk = entry.chunks[index]
    return f"{base}/v1/chunks/{chunk}?version={manifest.digest}&blob={entry.sha256}&index={index}", chunk


def chunk_bytes(model_dir: Path, manifest: Manifest, file: int = 0, index: int = 0) -> bytes:
    """The bytes chunk ``index`` of file ``file`` must have, read from the published directory."""
    entry = manifest.files[file]
    start, end = entry.chunk_range(index, manifest.chunk_size)
    with open(model_dir / entry.path, "rb") as handle:
        handle.seek(start)
        return handle.read(end - start)


def start_cache(workdir: Path, fleet: Fleet, name: str, extra: Sequence[str] = ()) -> AgentProcess:
    """A cache-role agent process (no deployments) with a peer listener on a free loopback port."""
    cache = AgentProcess(
        workdir, name, fleet.cp.url, fleet.cache_token, deployments=(),
        extra=["--role", "cache", "--peer-listen", "127.0.0.1:0", *extra],
    )  # fmt: skip
    cache.data_dir.parent.mkdir(parents=True, exist_ok=True)
    cache.start()
    return cache


def metric(base: str, name: str) -> float:
    """The value of the series ``name`` (with labels, exactly as printed) at ``base``/metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == name:
            return float(value)
    raise AssertionError(f"{name} not in {base}/metrics:\n{text}")


def largest_file(manifest: Manifest) -> int:
    """The index of the manifest's largest file (the one with most chunks)."""
    return max(range(len(manifest.files)), key=lambda i: manifest.files[i].size)
