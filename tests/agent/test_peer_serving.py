"""Peer serving: every agent with a peer listener serves the chunks it verified, to ticket holders.

Real processes: the control plane (its blob URLs behind the fault proxy) and agents; tickets are
signed by the control plane for a node enrolled over the API.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.fleet import Fleet
from tests.agent.local_versions import small_tmpfs
from tests.agent.peers import chunk_bytes, chunk_request, largest_file, metric, peer_url, ticket
from weightship.digests import sha256_hex
from weightship.manifest import Manifest
from weightship.testing import FaultProxy

pytestmark = pytest.mark.timeout(120)

PEER = ["--peer-listen", "127.0.0.1:0"]


async def ask_every_chunk(
    http: httpx.AsyncClient, base: str, manifest: Manifest, auth: dict[str, str]
) -> list[tuple[tuple[str, int], int, int, httpx.Response]]:
    """Ask the peer at ``base`` for every chunk of ``manifest``: ``((blob, start), file, index, answer)`` each."""
    answers = []
    for f, entry in enumerate(manifest.files):
        for index in range(len(entry.chunks)):
            url, _chunk = chunk_request(base, manifest, f, index)
            where = (entry.sha256, entry.chunk_range(index, manifest.chunk_size)[0])
            answers.append((where, f, index, await http.get(url, headers=auth)))
    return answers


async def test_a_node_serves_the_chunks_of_a_ready_version_exactly(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    source = make_model("m1", tensors_mb=0.5, seed=1)
    v1 = fleet.publish(source, model, "v1")
    fleet.point(deployment, model, "v1")
    node = spawn("peer-a", extra=PEER)
    await node.ready()
    await node.serving(v1.digest)
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    big = largest_file(v1)
    async with httpx.AsyncClient(timeout=10) as http:
        for index in range(len(v1.files[big].chunks)):
            url, chunk = chunk_request(peer_url(node), v1, big, index)
            response = await http.get(url, headers=auth)
            assert response.status_code == 200, response.text
            assert response.headers["X-Weightship-Chunk"] == f"sha256:{chunk}"
            assert response.content == chunk_bytes(source, v1, big, index)
            assert sha256_hex(response.content) == chunk
        # The requester's (blob, index) must name that very chunk in our manifest.
        url, _chunk = chunk_request(peer_url(node), v1, big, 0)
        wrong = url.replace("index=0", "index=1")
        assert (await http.get(wrong, headers=auth)).status_code == 409
        bad = await http.get(url.replace("index=0", "index=x"), headers=auth)
        assert bad.status_code == 400
    assert metric(peer_url(node), "weightship_peer_upload_chunks_total") == len(v1.files[big].chunks)


async def test_a_node_that_does_not_hold_a_version_answers_not_found(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    v1 = fleet.publish(make_model("m1", tensors_mb=0.25, seed=2), model, "v1")
    fleet.point(deployment, model, "v1")
    other = spawn("peer-empty", deployments=[f"{deployment}-other"], extra=PEER)
    await other.ready()
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    url, _ = chunk_request(peer_url(other), v1, largest_file(v1))
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(url, headers=auth)
    assert response.status_code == 404, response.text


async def test_verified_chunks_of_a_version_still_being_fetched_are_served_and_missing_ones_are_not(
    fleet: Fleet, proxy: FaultProxy, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    source = make_model("m1", tensors_mb=0.5, seed=3)
    v1 = fleet.publish(source, model, "v1")
    fleet.point(deployment, model, "v1")
    proxy.hold_after = 2  # two chunks arrive, then the origin stalls
    node = spawn("peer-pipelined", extra=["--concurrency", "1", *PEER])
    await node.ready()
    await eventually(lambda: proxy.held() or None, 30, "the fetch to stall at the origin")
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    fetched = {(s.blob, s.start) for s in proxy.served[:2]}
    async with httpx.AsyncClient(timeout=10) as http:

        async def verified_chunk_served() -> bool | None:
            served = 0
            for where, f, index, response in await ask_every_chunk(http, peer_url(node), v1, auth):
                if where in fetched and response.status_code == 200:
                    assert sha256_hex(response.content) == v1.files[f].chunks[index]
                    served += 1
                elif where not in fetched:
                    assert response.status_code == 404, (f, index, response.text)
            return served >= 1 or None

        await eventually(verified_chunk_served, 30, "a verified chunk of the version being fetched to be served")
    proxy.release()
    await node.serving(v1.digest)


async def test_uploads_over_the_concurrency_cap_are_refused_with_retry_after(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    v1 = fleet.publish(make_model("m1", tensors_mb=0.5, seed=4), model, "v1")
    fleet.point(deployment, model, "v1")
    # 16 KiB/s: the first 64 KiB chunk uses the bucket's burst, every later one takes seconds.
    node = spawn("peer-capped", extra=[*PEER, "--upload-concurrency", "1", "--upload-bandwidth", "16KiB"])
    await node.ready()
    await node.serving(v1.digest)
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    big = largest_file(v1)
    async with httpx.AsyncClient(timeout=30) as http:
        urls = [chunk_request(peer_url(node), v1, big, i)[0] for i in range(3)]
        assert (await http.get(urls[0], headers=auth)).status_code == 200  # drains the burst
        answers = await asyncio.gather(*(http.get(u, headers=auth) for u in urls[1:]))
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 503], codes
    refused = next(a for a in answers if a.status_code == 503)
    assert int(refused.headers["Retry-After"]) >= 1


async def test_the_upload_bandwidth_cap_paces_what_a_node_sends(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    v1 = fleet.publish(make_model("m1", tensors_mb=0.5, seed=5), model, "v1")
    fleet.point(deployment, model, "v1")
    node = spawn("peer-paced", extra=[*PEER, "--upload-bandwidth", "128KiB"])
    await node.ready()
    await node.serving(v1.digest)
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    big = largest_file(v1)
    urls = [chunk_request(peer_url(node), v1, big, i)[0] for i in range(6)]  # 384 KiB
    began = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as http:
        answers = await asyncio.gather(*(http.get(u, headers=auth) for u in urls))
    elapsed = time.monotonic() - began
    assert all(a.status_code == 200 for a in answers)
    # 64 KiB of burst, then 320 KiB at 128 KiB/s: at least 2.5 s.
    assert elapsed >= 2.3, elapsed


async def test_a_node_whose_disk_fills_mid_fetch_still_serves_the_chunks_it_verified(
    tmp_path: Path, fleet: Fleet, proxy: FaultProxy, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    source = make_model("m1", tensors_mb=1.0, seed=4)
    v1 = fleet.publish(source, model, "v1")
    fleet.point(deployment, model, "v1")
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        node = AgentProcess(disk, "peer-full", fleet.cp.url, fleet.agent_token, [deployment], ["--concurrency", "1", *PEER])
        node.log_path = tmp_path / "peer-full.log"
        proxy.hold_after = 2  # two chunks arrive, then the origin stalls while the disk fills
        node.start()
        try:
            await node.ready()
            await eventually(lambda: proxy.held() or None, 30, "the fetch to stall at the origin")
            stat = os.statvfs(disk)
            (disk / "filler").write_bytes(bytes(stat.f_bavail * stat.f_frsize - 48 * 1024))  # < one 64 KiB chunk
            proxy.release()
            failure = await eventually(lambda: fleet.failed("peer-full", v1.digest), 30, "the fetch to fail")
            assert "disk full" in failure.error or "no room" in failure.error, failure.error
            assert "disk full while writing" in node.log()  # it failed mid-fetch, not at the room check

            auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
            fetched = {(s.blob, s.start) for s in proxy.served[:2]}
            served = 0
            async with httpx.AsyncClient(timeout=10) as http:
                for where, f, index, response in await ask_every_chunk(http, peer_url(node), v1, auth):
                    if where in fetched:
                        assert response.status_code == 200, (f, index, response.text)
                        assert response.content == chunk_bytes(source, v1, f, index)
                        served += 1
                    else:
                        assert response.status_code == 404, (f, index, response.text)
            assert served == 2
        finally:
            await node.close()
