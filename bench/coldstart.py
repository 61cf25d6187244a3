"""Cold start of a fresh node joining a warm fleet: streamed vs sequential vs ideal, in one run.

Topology: the one of ``bench/fanout.py`` (``bench/topology.py``: a network namespace per host on a
bridge, every link shaped with ``tc tbf`` at ``--rate`` L each way): the control plane as origin, a
cluster cache (with the tracker), ``--warm`` nodes that already hold the version (cache and peers
warm), and one fresh node whose agent and ``weightship-serve --digest`` start with empty disks.

Each mode starts a fresh agent and a pinned server on the fresh node, waits until both idle (the
server's deployment has no pointer yet), then sets the pointer; the clock runs from that update
until the server's first successful ``POST /v1/generate``:

* ``streamed``: the server loads the version while the agent fetches it (``gpu_loader.streamfeed``);
* ``sequential``: the same with ``--no-stream`` (fetch, then load);
* ``ideal``: the larger of ``S × 8 ÷ L`` and the load time from a warm page cache, measured in this
  run after the modes: the server's own load-and-validate step (``gpu_loader.serving.prepare``) on
  the installed version, same device and verification mode.

The last stdout line is one JSON object with ``coldstart_over_ideal`` (streamed ÷ ideal),
``speedup_over_sequential`` (sequential ÷ streamed), ``first_tensor_ms`` (from the first chunk the
server was told of to its first tensor loaded), each mode's seconds, the conditions and the load
average. Needs root; without it, it prints why and exits 0 with ``"skipped"``.

Usage: sudo python bench/coldstart.py [--size 512MiB] [--rate 200Mbit] [--device cpu|cuda:0]
                                      [--warm 2] [--chunk-size 4MiB] [--verify fast]
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fanout import ADMIN, CP_PORT, MODEL, PEER_PORT, PY, REPO, Fanout, parse_rate, wait_until
from bench.topology import TopologyError, unavailable
from weightship.client import Client
from weightship.digests import hex_of
from weightship.sizes import parse_size

SERVE_PORT = 8000
PROMPT = {"input_ids": [[1, 2, 3, 4]], "max_new_tokens": 1}


class Coldstart(Fanout):
    """The fan-out network with warm nodes and one fresh node."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        args.nodes = args.warm + 1
        super().__init__(args, work)
        self.fresh = self.nodes[-1]
        self.warm = self.nodes[:-1]
        self.procs: list[subprocess.Popen[bytes]] = []

    def publish(self) -> int:
        """A servable generated model of ``--size``, published over the origin's loopback."""
        from gpu_loader.modelgen import generate

        model_dir = self.work / "model"
        generate(model_dir, size_mb=self.args.size / 2**20, seed=7, dtype=self.args.dtype)
        with self.net.inside("origin"), Client(f"http://127.0.0.1:{CP_PORT}", ADMIN, timeout=600) as client:
            wait_until(lambda: self._ready(client), 60, "the control plane")
            version = client.publish_directory(model_dir, MODEL, ["v1"], chunk_size=self.args.chunk).version
            self.token = client.create_token("coldstart-agents", "agent").token
            self.cache_token = client.create_token("coldstart-cache", "agent", node_role="cache").token
        shutil.rmtree(model_dir)
        self.digest = version.digest
        return int(version.size)

    def node_flags(self, node: str) -> list[str]:
        address = f"http://{self.net.hosts[node].ip}:{PEER_PORT}"
        cache = f"http://{self.net.hosts['cache'].ip}:{PEER_PORT}"
        return [
            "--peer-listen", f"0.0.0.0:{PEER_PORT}", "--peer-address", address, "--cluster-cache", cache,
            "--rack", f"r{int(node[1:]) % 4}", "--peer-min-rate", str(self.args.rate_bits // 8 // 8),
        ]  # fmt: skip

    def point(self, deployment: str) -> None:
        with self.net.inside("origin"), Client(f"http://127.0.0.1:{CP_PORT}", ADMIN) as client:
            client.set_pointer(deployment, self.digest, expected_epoch=client.get_deployment(deployment).epoch)

    def create(self, deployment: str) -> None:
        with self.net.inside("origin"), Client(f"http://127.0.0.1:{CP_PORT}", ADMIN) as client:
            client.create_deployment(deployment, MODEL)

    def warm_fleet(self) -> None:
        """The cluster cache and the warm nodes, holding the version."""
        cache = self.net.hosts["cache"]
        flags = [
            "--role", "cache", "--tier", "cluster", "--peer-listen", f"0.0.0.0:{PEER_PORT}",
            "--peer-address", f"http://{cache.ip}:{PEER_PORT}", "--token", self.cache_token,
        ]  # fmt: skip
        proc = self.start_agent("cache", "cache", None, flags)
        self.procs.append(proc)
        wait_until(lambda: self.registered("cache", proc), 120, "the cluster cache to register")
        self.create("warm")
        warm = {n: self.start_agent(n, n, "warm", self.node_flags(n)) for n in self.warm}
        self.procs += warm.values()
        for name, p in warm.items():
            wait_until(functools.partial(self.registered, name, p), 120, f"warm node {name} to register")
        self.point("warm")
        for name in warm:
            link = self.work / "agents" / name / "deployments" / "warm" / "current"
            wait_until(functools.partial(self._names, link), self.args.timeout, f"warm node {name} to hold the version")

    def _names(self, link: Path) -> bool:
        return os.readlink(link).rstrip("/").endswith(hex_of(self.digest))

    def serve_argv(self, deployment: str, stream: bool, crc_dir: Path) -> list[str]:
        argv = [
            PY, "-m", "gpu_loader.serve", "--agent", "http://127.0.0.1:7070", "--deployment", deployment,
            "--digest", self.digest, "--port", str(SERVE_PORT), "--device", self.args.device,
            "--verify", self.args.verify, "--checksum-dir", str(crc_dir), "--poll-seconds", "5",
            "--metrics-push-seconds", "30",
        ]  # fmt: skip
        return argv if stream else [*argv, "--no-stream"]

    def _get(self, path: str) -> httpx.Response:
        with self.net.inside(self.fresh):
            return httpx.get(f"http://127.0.0.1:{SERVE_PORT}{path}", timeout=5)

    def _answers(self) -> bool:
        with self.net.inside(self.fresh):
            return httpx.post(f"http://127.0.0.1:{SERVE_PORT}/v1/generate", json=PROMPT, timeout=30).status_code == 200

    def run_cold(self, mode: str, stream: bool) -> dict[str, Any]:
        """One fresh node (agent + pinned server) from pointer update to first answer."""
        deployment = f"cold-{mode}"
        self.create(deployment)
        name = f"{mode}-{self.fresh}"
        agent = self.start_agent(self.fresh, name, deployment, self.node_flags(self.fresh))
        wait_until(lambda: self.registered(name, agent), 120, f"the fresh agent ({mode}) to register")
        env = {**self.env, "WEIGHTSHIP_AGENT_URL": ""}
        server = self.net.spawn(
            self.fresh, self.serve_argv(deployment, stream, self.work / f"crc-{mode}"), self.work / f"serve-{mode}.log",
            env, REPO,
        )  # fmt: skip
        try:
            wait_until(lambda: self._get("/v1/status").json()["waiting_for"]["state"] == "unknown", 180,
                       f"the {mode} server to wait for its version")  # fmt: skip
            t0 = time.monotonic()
            self.point(deployment)
            deadline = t0 + self.args.timeout
            while True:
                try:
                    if self._answers():
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or agent.poll() is not None:
                    raise SystemExit(f"the {mode} server or agent exited; see {self.work}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"mode {mode}: no answer after {self.args.timeout}s; see {self.work}")
                time.sleep(0.02)
            seconds = time.monotonic() - t0
            loading = self._get("/v1/status").json().get("loading") or {}
            return {"seconds": round(seconds, 2), "first_tensor_ms": loading.get("first_tensor_ms")}
        finally:
            self.net.stop(server)
            self.net.stop(agent)

    def warm_load_seconds(self, mode: str) -> float:
        """The server's load-and-validate step on the installed version, from a warm page cache."""
        from gpu_loader.loader import Loader, LoadOptions
        from gpu_loader.serving import prepare

        directory = self.work / "agents" / f"{mode}-{self.fresh}" / "versions" / hex_of(self.digest)
        for path in directory.rglob("*"):  # the page cache warm (it is on tmpfs by default anyway)
            if path.is_file():
                path.read_bytes()
        with Loader(LoadOptions(checksum_dir=self.work / "crc-warm")) as loader:
            t0 = time.perf_counter()
            prepared = prepare(loader, directory, digest=self.digest, epoch=0, device=self.args.device, dtype=None,
                               verify=self.args.verify)  # fmt: skip
            seconds = time.perf_counter() - t0
        if prepared.served is None:
            raise SystemExit(f"the warm load failed: {prepared.error}")
        return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="512MiB", help="model size S (default: %(default)s)")
    parser.add_argument("--rate", default="200Mbit", help="every link L, each way (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument("--warm", type=int, default=2, help="nodes that already hold the version")
    parser.add_argument("--chunk-size", default="4MiB", help="manifest chunk size (default: %(default)s)")
    parser.add_argument("--verify", choices=("full", "fast", "trust"), default="fast", help="the servers' --verify")
    parser.add_argument("--dtype", default="bfloat16", help="the generated model's dtype")
    parser.add_argument("--concurrency", type=int, default=8, help="agent chunk requests in flight per version")
    parser.add_argument("--subnet", default="10.78.0", help="private /24 used inside the namespaces only")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a step may take before it fails")
    parser.add_argument("--dir", help="work directory (default: a new one on /dev/shm, removed afterwards)")
    args = parser.parse_args()
    args.size, args.chunk = parse_size(args.size), parse_size(args.chunk_size)
    args.rate_bits = parse_rate(args.rate)
    args.origin_rate_bits = args.cache_rate_bits = args.rate_bits
    args.files, args.cache_flag, args.node_flag = 1, [], []

    why = unavailable()
    if why:
        print(f"skipped: bench/coldstart.py {why}", flush=True)
        print(json.dumps({"bench": "coldstart", "skipped": why}))
        return 0
    shm = Path("/dev/shm")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ws-cold-", dir=shm if shm.is_dir() else None))
    work.mkdir(parents=True, exist_ok=True)
    bench = Coldstart(args, work)

    def clean_up() -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        bench.net.close()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    atexit.register(clean_up)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    load = os.getloadavg()
    print(
        f"conditions: {os.cpu_count()} CPUs ({platform.machine()}), load average {load[0]:.1f}/{load[1]:.1f}/"
        f"{load[2]:.1f}; S = {args.size / 2**20:.0f} MiB, L = {args.rate_bits / 1e6:g} Mbit/s (tbf), "
        f"{args.warm} warm nodes, chunk {args.chunk / 2**20:g} MiB, device {args.device}, verify {args.verify}; "
        f"work dir {work}",
        flush=True,
    )
    try:
        bench.build()
        size = bench.publish()
        print(f"published {bench.digest} ({size} bytes)", flush=True)
        bench.warm_fleet()
        print("warm fleet ready", flush=True)
        streamed = bench.run_cold("streamed", stream=True)
        print(f"streamed: first answer {streamed['seconds']}s after the pointer update", flush=True)
        sequential = bench.run_cold("sequential", stream=False)
        print(f"sequential: first answer {sequential['seconds']}s after the pointer update", flush=True)
        warm_load = bench.warm_load_seconds("sequential")
    except TopologyError as exc:
        print(f"skipped: bench/coldstart.py cannot build the network: {exc}", flush=True)
        print(json.dumps({"bench": "coldstart", "skipped": str(exc)}))
        return 0
    finally:
        clean_up()
    link_seconds = size * 8 / args.rate_bits
    ideal = max(link_seconds, warm_load)
    print(f"ideal: max(S/L = {link_seconds:.2f}s, warm load {warm_load:.2f}s) = {ideal:.2f}s", flush=True)
    print(
        json.dumps(
            {
                "bench": "coldstart",
                "size": size,
                "rate_bits": args.rate_bits,
                "device": args.device,
                "verify": args.verify,
                "chunk_size": args.chunk,
                "warm_nodes": args.warm,
                "streamed_seconds": streamed["seconds"],
                "sequential_seconds": sequential["seconds"],
                "link_seconds": round(link_seconds, 2),
                "warm_load_seconds": round(warm_load, 2),
                "ideal_seconds": round(ideal, 2),
                "coldstart_over_ideal": round(streamed["seconds"] / ideal, 3),
                "speedup_over_sequential": round(sequential["seconds"] / streamed["seconds"], 3),
                "first_tensor_ms": streamed["first_tensor_ms"],
                "cpus": os.cpu_count(),
                "load_average_before": round(load[0], 2),
                "load_average_after": round(os.getloadavg()[0], 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
