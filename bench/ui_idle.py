"""What open status pages (/ui/) cost an idle control plane: database queries per second and CPU.

Runs the real control plane (``python -m controlplane serve``, SQLite) with a fleet written
straight into its database (``--nodes`` nodes across clusters, ``--versions`` versions of one
model and as many pointer moves in one deployment's history; a share of the nodes stuck on a
fetch), signs in over the login form, and then measures three equal windows of ``--seconds``
while nothing changes:

- no page open;
- one page open (its server-sent-events stream, ``GET /ui/events``);
- ``--pages`` pages open (each its own session and stream).

For each window: ``queries_per_s`` (the server's ``weightship_db_queries_total`` delta; every
window is bracketed by the same two scrapes, so what scrapes cost cancels out in the ratios) and
``cpu_share`` (the server process's user+system CPU over the window). It also times what a person
waits for with that fleet: ``page_load_ms`` (``GET /ui/``, summary read and rendered when no page
kept it) and ``nodes_page_ms`` (one page of the node list) and their sizes.

Printed ratio: ``queries_many_pages_over_idle``: queries per second with ``--pages`` pages open
over those with none (1.0: open pages cost the database nothing while nothing changes; the
scrapes bracketing each window are the same in both). ``extra_queries_per_s_*`` give the
differences, per second, for one page and for ``--pages``.

Usage: python bench/ui_idle.py [--nodes 5000] [--versions 50] [--pages 50] [--seconds 30]
Last line: one JSON object with the figures above.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from controlplane.persistence.rows import DeploymentRow, LabelRow, ModelRow, NodeRow, PointerEventRow, VersionRow
from weightship.testing import free_port

REPO = Path(__file__).resolve().parents[1]
ADMIN = "ws_bench-ui-idle-admin-0123456789abcdef"
_QUERIES = re.compile(r"^weightship_db_queries_total (\S+)$", re.MULTILINE)


def _digest(i: int) -> str:
    return "sha256:" + f"{i:064x}"


def seed(database_url: str, nodes: int, versions: int) -> None:
    """Write the fleet, its versions and a pointer history straight into the (migrated) database."""
    now = datetime.now(UTC)
    engine = create_engine(database_url)
    with Session(engine) as session:
        session.add(ModelRow(name="m", allow_pickle=False, created_at=now))
        session.flush()
        for i in range(versions):
            session.add(VersionRow(digest=_digest(i), model="m", size=10 << 30, files=4, manifest_size=100, state="ready", created_at=now, created_by="bench"))
            session.flush()
            session.add(LabelRow(model="m", label=f"v{i}", digest=_digest(i), created_at=now, created_by="bench"))
        stable, previous = _digest(versions - 1), _digest(max(versions - 2, 0))
        session.add(DeploymentRow(name="chat", model="m", stable=stable, previous_stable=previous, canary=None, canary_share=0.0, epoch=versions, updated_at=now))
        session.flush()
        for i in range(versions):
            session.add(PointerEventRow(deployment="chat", epoch=i + 1, action="set", actor="bench", reason="", from_stable=_digest(i - 1) if i else None, to_stable=_digest(i), from_canary=None, to_canary=None, canary_share=0.0, at=now))
        for n in range(nodes):
            stuck = n % 50 == 0
            inventory: list[dict[str, Any]] = [
                {"digest": previous, "state": "ready", "bytes_total": 10 << 30, "bytes_present": 10 << 30},
                {"digest": stable, "state": "fetching" if stuck else "ready", "bytes_total": 10 << 30, "bytes_present": 3 << 30 if stuck else 10 << 30},
            ]
            if stuck:
                inventory[1]["problem"] = {"reason": "corrupt_origin", "message": "chunk 7 of model-00002.safetensors never matched its digest", "since": now.isoformat(), "attempts": 3, "blob": "ab" * 32, "file": "model-00002.safetensors", "chunk_index": 7}
            report = {
                "inventory": inventory,
                "deployments": [{"name": "chat", "digest": previous if stuck else stable, "epoch": versions}],
                "counters": {"sources": {"origin": {"bytes": 1 << 28}, "peer": {"bytes": 5 << 30}, "cluster_cache": {"bytes": 4 << 30}}},
            }
            labels = {"region": f"r{n % 4}", "cluster": f"c{n % 40}", "zone": "z", "rack": "k", "gpu_type": "h100"}
            session.add(NodeRow(id=f"n{n:06d}", name=f"gpu-{n:05d}", labels=labels, role="node", address=None, deployments=["chat"], registered_at=now, last_seen=now, report=report, assigned=None, enrolled=True))
        session.commit()
    engine.dispose()


class Server:
    """The control plane as a process."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = f"sqlite:///{workdir / 'cp.db'}"
        env = {
            **os.environ,
            "WEIGHTSHIP_DATABASE_URL": self.database_url,
            "WEIGHTSHIP_STORE": f"local:{workdir / 'origin'}",
            "WEIGHTSHIP_ADMIN_TOKEN": ADMIN,
            # a node heard from within the window stays live: nothing goes stale while we measure
            "WEIGHTSHIP_NODE_STALE_SECONDS": "86400",
        }
        argv = [sys.executable, "-m", "controlplane", "serve", "--port", str(self.port), "--log-level", "warning"]
        self.log = open(workdir / "controlplane.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the control plane exited with {self.proc.returncode}; see its log")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # ok-sleep: polling interval of a deadline loop
        raise SystemExit("the control plane did not become ready within 60 s")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def queries(self) -> float:
        found = _QUERIES.search(httpx.get(self.url + "/metrics", timeout=30).text)
        return float(found.group(1)) if found else 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def window(server: Server, seconds: float) -> dict[str, float]:
    """Queries per second and CPU share of the server over ``seconds`` of quiet."""
    q0, c0, t0 = server.queries(), server.cpu_seconds(), time.monotonic()
    await asyncio.sleep(seconds)  # ok-sleep: the measured window itself
    q1, c1, t1 = server.queries(), server.cpu_seconds(), time.monotonic()
    return {"queries_per_s": round((q1 - q0) / (t1 - t0), 3), "cpu_share": round((c1 - c0) / (t1 - t0), 4)}


async def open_page(client: httpx.AsyncClient) -> asyncio.Task[None]:
    """Sign in and hold the page's event stream open (until cancelled); returns once its first summary arrived."""
    answer = await client.post("/ui/login", data={"token": ADMIN})
    if answer.status_code != 303:
        raise SystemExit(f"sign-in answered {answer.status_code}: {answer.text[:200]}")
    first = asyncio.get_running_loop().create_future()

    async def hold() -> None:
        async with client.stream("GET", "/ui/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("event: summary") and not first.done():
                    first.set_result(None)

    task = asyncio.create_task(hold())
    await asyncio.wait_for(first, timeout=60)
    return task


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-ui-") as tmp:
        server = Server(Path(tmp))
        clients: list[httpx.AsyncClient] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            server.ready()
            seed(server.database_url, args.nodes, args.versions)
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as one:
                await one.post("/ui/login", data={"token": ADMIN})
                started = time.perf_counter()
                page = await one.get("/ui/")
                page_ms = (time.perf_counter() - started) * 1000
                started = time.perf_counter()
                nodes_page = await one.get("/ui/nodes", params={"page": 3})
                nodes_ms = (time.perf_counter() - started) * 1000
            await asyncio.sleep(1)  # ok-sleep: let the page load's read settle before measuring quiet
            idle = await window(server, args.seconds)
            for count in (1, args.pages):
                while len(clients) < count:
                    client = httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(60, read=None))
                    clients.append(client)
                    tasks.append(await open_page(client))
                # a stream gets the summary held at once, and the hub's first fresh read right after
                await asyncio.sleep(1)  # ok-sleep: let that read settle before measuring quiet
                result = await window(server, args.seconds)
                if count == 1:
                    one_page = result
                else:
                    many = result
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for client in clients:
                await client.aclose()
            server.stop()
    extra_one = one_page["queries_per_s"] - idle["queries_per_s"]
    extra_many = many["queries_per_s"] - idle["queries_per_s"]
    return {
        "nodes": args.nodes,
        "versions": args.versions,
        "pages": args.pages,
        "seconds": args.seconds,
        "idle": idle,
        "one_page": one_page,
        "many_pages": many,
        "extra_queries_per_s_one_page": round(extra_one, 3),
        "extra_queries_per_s_many_pages": round(extra_many, 3),
        "queries_many_pages_over_idle": round(many["queries_per_s"] / idle["queries_per_s"], 3) if idle["queries_per_s"] else None,
        "extra_cpu_share_many_pages": round(many["cpu_share"] - idle["cpu_share"], 4),
        "page_load_ms": round(page_ms, 1),
        "page_kib": round(len(page.content) / 1024, 1),
        "nodes_page_ms": round(nodes_ms, 1),
        "nodes_page_kib": round(len(nodes_page.content) / 1024, 1),
    }


def main() -> None:
    """Parse flags, run, print the figures; the last line is JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--versions", type=int, default=50)
    parser.add_argument("--pages", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(
        f"{args.pages} open pages add {result['extra_queries_per_s_many_pages']} queries/s and "
        f"{result['extra_cpu_share_many_pages'] * 100:.2f}% CPU to an idle control plane with {args.nodes} nodes "
        f"(one page adds {result['extra_queries_per_s_one_page']} queries/s); "
        f"page load {result['page_load_ms']} ms ({result['page_kib']} KiB)"
    )
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
