"""`make demo`: the main job end to end on one machine, on embedded defaults.

Starts a local S3 (moto's server, its own process) and the control plane (its own process,
SQLite), generates a ~200 MB llama-style model, publishes v1 and v2 (v2 shares shards with v1,
which are not uploaded again), starts a cluster cache (an agent in ``--role cache --tier
cluster``, which also runs the cluster's tracker) and 4 node agents (their own processes) that
fetch and verify v1 through it and from each other (the origin sends v1 about once), switches the deployment to v2 and waits until the model server answers requests with v2
(hot-swap under traffic), rolls back to v1 and waits until it answers with v1 again, and prints
what happened. The last line is one JSON object of the figures; ``serve_versions_seen`` lists
the digests the answers came from, in order (v1, v2, v1); ``origin_bytes``, ``peer_bytes`` and
``cache_bytes`` say where the bytes came from (the origin's count includes what the cache read
from it), and ``v1_origin_bytes`` ÷ ``v1_bytes`` is how many copies of v1 the origin sent.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from weightship.client import Client
from weightship.schemas import NodeInfo, Role

PY = sys.executable
BIN = Path(PY).parent
MODEL = "demo-llama"
DEPLOYMENT = "demo-chat"
console = Console(highlight=False, width=120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(what: str, check: Callable[[], bool], timeout: float = 60.0, interval: float = 0.02) -> float:
    """Poll ``check`` until true; the seconds it took. Fails loudly on timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if check():
                return time.monotonic() - start
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(interval)
    raise SystemExit(f"demo: timed out after {timeout:.0f}s waiting for {what}")


class Processes:
    """Child processes, each logging to a file, all stopped at exit."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.children: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.children.append(proc)
        return proc

    def check(self) -> None:
        """Fail at once, with the log's tail, if any child has exited."""
        for proc in self.children:
            if proc.poll() is not None:
                name = Path(str(proc.args[0])).name if isinstance(proc.args, list) else "child"
                raise SystemExit(f"demo: {proc.args[:4]} ({name}) exited with {proc.returncode}; logs in {self.logs}")

    def stop(self) -> None:
        for proc in self.children:
            proc.terminate()
        for proc in self.children:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def local_state(port: int) -> dict[str, object]:
    response = httpx.get(f"http://127.0.0.1:{port}/local/v1/deployments/{DEPLOYMENT}", timeout=2)
    response.raise_for_status()
    return dict(response.json())


def all_serving(procs: Processes, ports: list[int], digest: str) -> bool:
    procs.check()
    states = [local_state(p) for p in ports]
    return all(s.get("digest") == digest and s.get("ready") for s in states)


class Traffic:
    """Inference requests against the model server in a loop, counting failures, until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ok = 0
        self.failed = 0
        self.digests: set[str] = set()
        #: the digests answers came from, in order, each change recorded once (v1, v2, v1, ...)
        self.sequence: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                try:
                    r = http.post(self.url + "/v1/generate", json={"input_ids": [[1, 2, 3, 4]], "max_new_tokens": 1})
                    if r.status_code == 200:
                        self.ok += 1
                        digest = str(r.json()["digest"])
                        self.digests.add(digest)
                        if not self.sequence or self.sequence[-1] != digest:
                            self.sequence.append(digest)
                    else:
                        self.failed += 1
                except httpx.HTTPError:
                    self.failed += 1

    def answered_with(self, digest: str, changes: int) -> bool:
        """Whether answers came from ``digest`` after at least ``changes`` changes of version."""
        return len(self.sequence) > changes and self.sequence[-1] == digest

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def served_digest(url: str) -> str | None:
    response = httpx.get(url + "/readyz", timeout=2)
    return str(response.json().get("digest")) if response.status_code == 200 else None


def start_cache(procs: Processes, work: Path, cp_url: str, token: str, env: dict[str, str]) -> str:
    """A cluster cache (``--role cache --tier cluster``, the cluster's tracker too) reading from the origin; its URL.

    No ``--upstream``: the demo has no region cache, so the cache's misses and read-ahead go to the
    origin through the control plane's blob URLs.
    """
    peer, api = free_port(), free_port()
    argv = [PY, "-m", "agent", "--role", "cache", "--tier", "cluster", "--control-plane", cp_url, "--token", token,
            "--name", "demo-cache", "--data-dir", str(work / "cache"), "--local-api", f"127.0.0.1:{api}",
            "--peer-listen", f"127.0.0.1:{peer}", "--heartbeat-interval", "0.5"]  # fmt: skip
    procs.start("cache", argv, env)
    url = f"http://127.0.0.1:{peer}"
    wait_until("the cluster cache", lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200)
    return url


def by_source(node: NodeInfo) -> dict[str, int]:
    """Bytes a node received per source (``origin``, ``cluster_cache``, ``peer``, ``local``), from its heartbeat."""
    return {name: tally.bytes for name, tally in node.counters.sources.items()}


def source_total(nodes: list[NodeInfo], source: str) -> int:
    return sum(by_source(n).get(source, 0) for n in nodes)


def origin_bytes(nodes: list[NodeInfo], cache_url: str) -> int:
    """What left the origin: the nodes' own origin reads plus the cache's (its ``/metrics``)."""
    text = httpx.get(cache_url + "/metrics", timeout=5).text
    cache = sum(
        int(float(line.rpartition(" ")[2]))
        for line in text.splitlines()
        if line.startswith('weightship_cache_fetch_bytes_total{source="origin"}')
    )
    return source_total(nodes, "origin") + cache


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--size-mb", type=float, default=200.0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="weightship-demo-"))
    (work / "logs").mkdir()
    procs = Processes(work / "logs")
    admin = "ws_" + secrets.token_urlsafe(24)
    # moto accepts any credentials; set them here so this process and its children agree.
    os.environ.update({"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo", "AWS_DEFAULT_REGION": "us-east-1"})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        console.rule("[bold]weightship demo")
        console.print(f"work directory: {work}")

        # 1. Local S3 and the control plane, each its own process.
        s3_port = free_port()
        procs.start("s3", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)], env)
        s3_url = f"http://127.0.0.1:{s3_port}"
        wait_until("the local S3 server", lambda: httpx.get(s3_url, timeout=1).status_code < 500)
        import boto3

        boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1").create_bucket(Bucket="weightship-demo")
        cp_port = free_port()
        cp_url = f"http://127.0.0.1:{cp_port}"
        cp_env = {
            **env,
            "WEIGHTSHIP_DATABASE_URL": f"sqlite:///{work / 'controlplane.db'}",
            "WEIGHTSHIP_STORE": "s3://weightship-demo",
            "WEIGHTSHIP_S3_ENDPOINT_URL": s3_url,
            "WEIGHTSHIP_ADMIN_TOKEN": admin,
            "WEIGHTSHIP_PUBLIC_URL": cp_url,
        }
        procs.start("controlplane", [PY, "-m", "controlplane", "serve", "--port", str(cp_port)], cp_env)
        wait_until("the control plane", lambda: httpx.get(cp_url + "/readyz", timeout=1).status_code == 200)
        console.print(f"control plane at {cp_url} (SQLite), origin store s3://weightship-demo on {s3_url} (moto)")

        with Client(cp_url, admin) as root:
            publisher = root.create_token("demo-publisher", Role.publisher).token
            operator = root.create_token("demo-operator", Role.operator).token
            # An enrolment token: each agent enrols with it once and then uses its own node token.
            agent_token = root.create_token("demo-enrolment", Role.agent).token

        # 2. Two versions of a real safetensors model; v2 redraws only the last shard.
        t0 = time.monotonic()
        gen = [PY, "-m", "gpu_loader.modelgen"]
        common = ["--size-mb", str(args.size_mb), "--seed", "7", "--shards", "4"]
        subprocess.run([*gen, str(work / "v1"), *common], check=True, env=env, stdout=subprocess.DEVNULL)
        subprocess.run(
            [*gen, str(work / "v2"), *common, "--variant", "1"], check=True, env=env, stdout=subprocess.DEVNULL
        )
        console.print(f"generated v1 and v2 ({args.size_mb:.0f} MB each, 4 shards) in {time.monotonic() - t0:.1f}s")

        # 3. Publish both; v2's unchanged shards are already in the store.
        table = Table("version", "digest", "files", "total", "uploaded", "deduplicated", "hash s", "upload s")
        results = []
        with Client(cp_url, publisher) as client:
            for label in ("v1", "v2"):
                r = client.publish_directory(work / label, MODEL, [label])
                results.append(r)
                table.add_row(
                    label,
                    r.version.digest[:19],
                    str(r.files),
                    mb(r.bytes_total),
                    mb(r.bytes_uploaded),
                    mb(r.bytes_deduplicated),
                    f"{r.hash_seconds:.2f}",
                    f"{r.upload_seconds:.2f}",
                )
        console.print(table)
        v1, v2 = (r.version.digest for r in results)

        # 4. A deployment on v1, served by N agents that fetch through a cluster cache and each other.
        ops = Client(cp_url, operator)
        epoch = ops.create_deployment(DEPLOYMENT, MODEL).epoch
        ops.set_pointer(DEPLOYMENT, stable="v1", expected_epoch=epoch, reason="first release")
        cache_url = start_cache(procs, work, cp_url, agent_token, env)
        console.print(f"cluster cache (and the cluster's tracker) at {cache_url}, reading from the origin")
        ports = [free_port() for _ in range(args.agents)]
        for i, port in enumerate(ports):
            peer_port = free_port()
            procs.start(
                f"agent-{i}",
                [
                    PY,
                    "-m",
                    "agent",
                    "--control-plane",
                    cp_url,
                    "--token",
                    agent_token,
                    "--name",
                    f"node-{i}",
                    "--data-dir",
                    str(work / f"node-{i}"),
                    "--deployment",
                    DEPLOYMENT,
                    "--local-api",
                    f"127.0.0.1:{port}",
                    "--heartbeat-interval",
                    "0.5",
                    "--zone",
                    f"zone-{i % 2}",
                    "--gpu-type",
                    "demo",
                    "--peer-listen",
                    f"127.0.0.1:{peer_port}",
                    "--cluster-cache",
                    cache_url,
                ],
                env,
            )
        took = wait_until(
            f"{args.agents} agents to fetch, verify and serve v1", lambda: all_serving(procs, ports, v1), timeout=180
        )
        console.print(f"{args.agents} agents fetched, verified and switched to v1 in {took:.1f}s")

        # A model server beside node-0: loads through gpu_loader, validates, hot-swaps on switches.
        serve_port = free_port()
        serve_url = f"http://127.0.0.1:{serve_port}"
        procs.start(
            "serve",
            [
                PY,
                "-m",
                "gpu_loader.serve",
                "--agent",
                f"http://127.0.0.1:{ports[0]}",
                "--deployment",
                DEPLOYMENT,
                "--port",
                str(serve_port),
                "--device",
                "cpu",
                "--verify",
                "trust",
            ],
            env,
        )
        took = wait_until(
            "the model server to load and validate v1", lambda: served_digest(serve_url) == v1, timeout=120
        )
        console.print(f"model server on node-0 loaded v1 (verify=trust), passed validation and is ready in {took:.1f}s")
        traffic = Traffic(serve_url)
        traffic.start()

        def counters() -> dict[str, int]:
            """Bytes each node received over the network, from any source (origin, cache, peers)."""
            return {n.name: sum(b for s, b in by_source(n).items() if s != "local") for n in nodes()}

        def nodes() -> list[NodeInfo]:
            return [n for n in ops.list_nodes() if n.role != "cache"]

        def reported(digest: str) -> bool:
            found = nodes()
            return len(found) == args.agents and all(
                any(s.name == DEPLOYMENT and s.digest == digest for s in n.serving) for n in found
            )

        wait_until("heartbeats to report v1", lambda: reported(v1))
        after_v1 = counters()
        v1_origin = origin_bytes(nodes(), cache_url)
        v1_size = results[0].version.size
        console.print(
            f"v1 ({mb(v1_size)}) to {args.agents} agents: the origin sent {mb(v1_origin)} "
            f"= {v1_origin / v1_size:.2f} copies (cache {mb(source_total(nodes(), 'cluster_cache'))}, "
            f"peers {mb(source_total(nodes(), 'peer'))})"
        )

        # 5. Switch to v2: only the changed shard is downloaded.
        ops.set_pointer(
            DEPLOYMENT, stable="v2", expected_epoch=ops.get_deployment(DEPLOYMENT).epoch, reason="new weights"
        )
        took = wait_until("all agents to serve v2", lambda: all_serving(procs, ports, v2), timeout=180)
        wait_until("heartbeats to report v2", lambda: reported(v2))
        after_v2 = counters()
        console.print(f"all agents switched to v2 in {took:.1f}s")
        # Hot-swap under traffic: the model server must answer with v2 before anything rolls back.
        took = wait_until(
            "the model server to answer requests with v2", lambda: traffic.answered_with(v2, 1), timeout=120
        )
        console.print(f"model server hot-swapped to v2 under traffic; answering with v2 after {took:.1f}s more")

        # 6. Roll back: a pointer flip to the copy already on every disk.
        start = time.monotonic()
        ops.rollback(DEPLOYMENT, reason="demo: roll back v2")
        rollback_api = time.monotonic() - start
        wait_until("all agents to serve v1 again", lambda: all_serving(procs, ports, v1), timeout=60, interval=0.005)
        rollback_all = time.monotonic() - start
        wait_until("heartbeats to report the rollback", lambda: reported(v1))
        after_rb = counters()
        wait_until(
            "the model server to answer requests with v1 again", lambda: traffic.answered_with(v1, 2), timeout=120
        )
        traffic.stop()
        seen = " -> ".join(("v1" if d == v1 else "v2" if d == v2 else d[:19]) for d in traffic.sequence)
        console.print(
            f"model server: {traffic.ok} requests answered during the switch and the rollback, "
            f"{traffic.failed} failed; versions seen in answers, in order: {seen}"
        )

        final = nodes()
        table = Table(
            "agent", "v1 download", "v2 switch download", "rollback download", "from origin", "from cache", "from peers"
        )
        for node in sorted(final, key=lambda n: n.name):
            name, got = node.name, by_source(node)
            table.add_row(
                name,
                mb(after_v1[name]),
                mb(after_v2[name] - after_v1[name]),
                mb(after_rb[name] - after_v2[name]),
                mb(got.get("origin", 0)),
                mb(got.get("cluster_cache", 0)),
                mb(got.get("peer", 0)),
            )
        console.print(table)
        origin_total = origin_bytes(final, cache_url)
        console.print(
            f"sources: the origin sent {mb(origin_total)} (the cache's reads included), the cache served "
            f"{mb(source_total(final, 'cluster_cache'))}, peers {mb(source_total(final, 'peer'))}"
        )
        rollback_bytes = sum(after_rb[n] - after_v2[n] for n in after_rb)
        console.print(
            f"rollback: API call {rollback_api * 1000:.0f} ms, all {args.agents} agents switched in "
            f"{rollback_all * 1000:.0f} ms, {rollback_bytes} bytes downloaded"
        )

        history = Table("epoch", "action", "actor", "from", "to", "reason")
        for ev in ops.history(DEPLOYMENT):
            history.add_row(
                str(ev.epoch), ev.action, ev.actor, (ev.from_stable or "-")[:19], (ev.to_stable or "-")[:19], ev.reason
            )
        console.print(history)
        ops.close()

        figures = {
            "versions_published": len(results),
            "bytes_uploaded": sum(r.bytes_uploaded for r in results),
            "bytes_deduplicated": sum(r.bytes_deduplicated for r in results),
            "rollback_seconds": round(rollback_api, 4),
            "agents": args.agents,
            "rollback_bytes_downloaded": rollback_bytes,
            "rollback_all_switched_seconds": round(rollback_all, 4),
            "v2_switch_bytes_downloaded": sum(after_v2[n] - after_v1[n] for n in after_v2),
            "serve_requests": traffic.ok + traffic.failed,
            "serve_failed_requests": traffic.failed,
            "serve_versions_seen": traffic.sequence,
            "origin_bytes": origin_total,
            "peer_bytes": source_total(final, "peer"),
            "cache_bytes": source_total(final, "cluster_cache"),
            "v1_bytes": v1_size,
            "v1_origin_bytes": v1_origin,
        }
        print(json.dumps(figures))
    finally:
        procs.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
