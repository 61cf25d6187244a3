"""Fan-out of one version to N nodes on a shaped network: every node from the origin vs weightship, in one run.

Topology (``bench/topology.py``): one network namespace per host on a bridge, every link shaped
with ``tc tbf`` in both directions at ``--rate`` (default 100 Mbit/s):

* ``origin``: the real control plane (``python -m controlplane serve``, SQLite, local-directory
  store) serving the blobs on its signed URLs; its link is the origin link, and its ``eth0`` transmit
  counter is the origin's egress.
* ``cache``: a cluster cache (``weightship-agent --role cache --tier cluster``), which also runs the
  cluster's tracker (mode b only).
* ``n00`` … : N real ``weightship-agent`` processes (default 16), each in its own namespace.

Modes, measured in the same run on the same published version:

* (a) ``origin``: every node fetches straight from the origin (no peers, no cache).
* (b) ``weightship``: nodes fetch through the tracker, their peers and the cluster cache, which
  alone goes to the origin.

Each mode: fresh agents (own data directories on tmpfs; (a)'s copies are deleted before (b))
register and idle, then the deployment's pointer is set; the clock runs from that update until
every node's ``current`` link names the version (the agent switches it only after every chunk was
verified and the version installed). ``ideal = S × 8 ÷ rate`` (one node link at line rate).

Prints, per mode, time ÷ ideal, origin egress ÷ S and the CPU busy share over the timed interval
(from ``/proc/stat``; near 1.0 the machine, not the network, set the time); then the speed-up of
(b) over (a). The last line is one JSON object with ``time_over_ideal``, ``origin_egress_over_size``,
``speedup_over_origin`` (mode b's figures), ``nodes``, ``size``, ``rate_bits``, ``cpu_busy_share``
and each mode's figures. Needs root; without it, it prints why and exits 0 with ``"skipped"``.
If mode (b) cannot run on this checkout (the agent lacks the cache/peer flags), (a) is still
measured and reported, the (b) figures are ``null`` with the reason, and the exit status is 3.

Usage: sudo python bench/fanout.py [--nodes 16] [--size 256MiB] [--rate 100Mbit] [--origin-rate RATE]
                                   [--chunk-size 4MiB] [--mode both|origin|weightship] [--dir PATH]
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.topology import Topology, TopologyError, unavailable
from weightship.client import Client
from weightship.digests import hex_of
from weightship.errors import WeightshipError
from weightship.sizes import parse_size
from weightship.testing import eventually

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
ADMIN = "ws_bench-fanout-admin-token-0123456789abcdef"
MODEL = "fanout"
CP_PORT = 8080
PEER_PORT = 7071
#: the agent flags mode (b) needs, and the branch that brings them
B_FLAGS = {
    "--role": "peers (cache role)",
    "--tier": "peers (cache role)",
    "--peer-listen": "peers (peer listener)",
    "--peer-address": "peers (peer listener)",
    "--cluster-cache": "tracker (fetcher source order)",
    "--peer-min-rate": "tracker (fetcher source order)",
}


class ModeUnavailable(RuntimeError):
    """Mode (b) cannot run on this checkout."""


def parse_rate(text: str) -> int:
    """Bits per second from ``100Mbit``, ``1Gbit``, ``500kbit`` or a number."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit)?(?:/s)?\s*", text, re.IGNORECASE)
    if not match:
        raise SystemExit(f"rate {text!r} is not a bit rate such as 100Mbit or 1Gbit")
    return int(float(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2).lower()])


def cpu_times() -> tuple[int, int]:
    """``(busy, total)`` jiffies of all CPUs together (idle and iowait count as not busy)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # guest time is already inside user/nice
    return total - fields[3] - fields[4], total


def process_cpu(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` used so far; gone ones count 0."""
    ticks = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def make_model(root: Path, size: int, files: int) -> None:
    """``files`` safetensors shards of random bytes (distinct chunks: nothing deduplicates)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(4321)
    per = size // files
    for i in range(files):
        data = np.frombuffer(rng.bytes(per), dtype=np.uint8)
        save_file({f"layer{i}.weight": data}, str(root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"))


def agent_flags() -> set[str]:
    """The long flags ``weightship-agent`` accepts in this checkout."""
    out = subprocess.run([PY, "-m", "agent", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    return set(re.findall(r"--[a-z][a-z-]+", out))


def wait_until(probe: Callable[[], Any], seconds: float, what: str) -> Any:
    """Poll ``probe`` until truthy (``weightship.testing.eventually``); exit naming ``what`` after ``seconds``."""
    try:
        return eventually(probe, seconds, what, not_yet=(OSError, ValueError, KeyError, httpx.HTTPError, WeightshipError))
    except AssertionError as timed_out:
        raise SystemExit(str(timed_out)) from None


@dataclass
class Result:
    """One mode's measurement."""

    seconds: float
    origin_egress: int
    cpu_busy_share: float
    ready_seconds: list[float]
    sources: dict[str, int] = field(default_factory=dict)
    #: CPU time of this run's own processes (agents, cache, control plane) ÷ (wall time × CPUs)
    own_cpu_share: float = 0.0
    #: CPU seconds per role over the timed interval: ``nodes`` (all node agents), ``cache``, ``controlplane``
    cpu_seconds: dict[str, float] = field(default_factory=dict)


class Fanout:
    """The network, the control plane, and one mode's agents at a time."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.nodes = [f"n{i:02d}" for i in range(args.nodes)]
        self.net = Topology(f"wsf{os.getpid()}", args.subnet)
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.cp_url = ""
        self.token = ""
        #: the cache enrols with a token minted for its role
        self.cache_token = ""
        self.digest = ""
        self.cp_proc: subprocess.Popen[bytes] | None = None

    # -- setup -------------------------------------------------------------------------------
    def build(self) -> None:
        """Namespaces, links, and the control plane in the origin namespace."""
        net, rate = self.net, self.args.rate_bits
        net.create()
        origin = net.add_host("origin", 1, self.args.origin_rate_bits)
        net.add_host("cache", 2, self.args.cache_rate_bits)
        for i, node in enumerate(self.nodes):
            net.add_host(node, 10 + i, rate)
        self.cp_url = f"http://{origin.ip}:{CP_PORT}"
        env = {
            **self.env,
            "WEIGHTSHIP_DATABASE_URL": f"sqlite:///{self.work / 'cp.db'}",
            "WEIGHTSHIP_STORE": f"local:{self.work / 'origin'}",
            "WEIGHTSHIP_ADMIN_TOKEN": ADMIN,
            "WEIGHTSHIP_PUBLIC_URL": self.cp_url,
            "WEIGHTSHIP_URL_SIGNING_KEY": "bench-fanout-signing-key",
        }
        argv = [PY, "-m", "controlplane", "serve", "--host", "0.0.0.0", "--port", str(CP_PORT)]
        argv += ["--log-level", "warning"]
        self.cp_proc = net.spawn("origin", argv, self.work / "controlplane.log", env, REPO)

    def publish(self) -> int:
        """Publish the artifact over the origin's loopback (unshaped, uncounted); returns its size."""
        make_model(self.work / "model", self.args.size, self.args.files)
        with self.net.inside("origin"):
            local = f"http://127.0.0.1:{CP_PORT}"
            with Client(local, ADMIN, timeout=600) as client:
                wait_until(lambda: self._ready(client), 60, "the control plane")
                version = client.publish_directory(
                    self.work / "model", MODEL, ["v1"], chunk_size=self.args.chunk
                ).version
                self.token = client.create_token("fanout-agents", "agent").token
                self.cache_token = client.create_token("fanout-cache", "agent", node_role="cache").token
        shutil.rmtree(self.work / "model")
        self.digest = version.digest
        return int(version.size)

    def _ready(self, client: Client) -> bool:
        if self.cp_proc is not None and self.cp_proc.poll() is not None:
            log = (self.work / "controlplane.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"the control plane exited with {self.cp_proc.returncode}:\n{log}")
        client.list_models()
        return True

    # -- one mode ----------------------------------------------------------------------------
    def agent_argv(self, name: str, deployment: str | None, extra: Sequence[str]) -> list[str]:
        argv = [
            PY, "-m", "agent", "--control-plane", self.cp_url, "--name", name,
            "--data-dir", str(self.work / "agents" / name), "--local-api", "127.0.0.1:7070",
            "--concurrency", str(self.args.concurrency), "--memory", "64MiB", "--no-prefetch",
            "--heartbeat-interval", "2", "--poll-wait", "25", "--backoff-initial", "0.1", "--backoff-max", "2",
        ]  # fmt: skip
        if deployment:
            argv += ["--deployment", deployment]
        return argv + list(extra)

    def start_agent(
        self, host: str, name: str, deployment: str | None, extra: Sequence[str]
    ) -> subprocess.Popen[bytes]:
        env = {**self.env, "WEIGHTSHIP_AGENT_TOKEN": self.token}
        (self.work / "agents").mkdir(exist_ok=True)
        argv = self.agent_argv(name, deployment, extra)
        return self.net.spawn(host, argv, self.work / f"{name}.log", env, REPO)

    def registered(self, name: str, proc: subprocess.Popen[bytes]) -> bool:
        if proc.poll() is not None:
            log = (self.work / f"{name}.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"agent {name} exited with {proc.returncode}:\n{log}")
        runtime = self.work / "agents" / name / "agent.json"
        return runtime.exists() and bool(json.loads(runtime.read_text()).get("node_id"))

    def run_mode(self, mode: str, node_extra: Callable[[str], list[str]]) -> Result:
        """Start fresh agents for ``mode``, set the pointer, time until every node serves the version."""
        deployment = f"{MODEL}-{mode}"
        with self.net.inside("origin"), Client(f"http://127.0.0.1:{CP_PORT}", ADMIN) as client:
            client.create_deployment(deployment, MODEL)
        procs = {f"{mode}-{n}": (n, self.start_agent(n, f"{mode}-{n}", deployment, node_extra(n))) for n in self.nodes}
        for name, (_host, proc) in procs.items():
            wait_until(functools.partial(self.registered, name, proc), 120, f"agent {name} to register")
        hexdigest = hex_of(self.digest)
        pending = {name: self.work / "agents" / name / "deployments" / deployment / "current" for name in procs}
        ready: dict[str, float] = {}
        origin_tx = self.net.counters("origin")[1]
        busy0, total0 = cpu_times()
        ours = [p.pid for p in self.net.procs if p.poll() is None]
        roles = {
            "nodes": [proc.pid for _host, proc in procs.values()],
            "controlplane": [self.cp_proc.pid] if self.cp_proc is not None else [],
        }
        roles["cache"] = [pid for pid in ours if not any(pid in pids for pids in roles.values())]
        role0 = {role: process_cpu(pids) for role, pids in roles.items()}
        own0 = process_cpu(ours)
        with self.net.inside("origin"), Client(f"http://127.0.0.1:{CP_PORT}", ADMIN) as client:
            t0 = time.monotonic()
            client.set_pointer(deployment, self.digest, expected_epoch=client.get_deployment(deployment).epoch)
        deadline = t0 + self.args.timeout
        while pending:
            for name, link in list(pending.items()):
                try:
                    if os.readlink(link).rstrip("/").endswith(hexdigest):
                        ready[name] = time.monotonic() - t0
                        del pending[name]
                except OSError:
                    pass
            for name, (_host, proc) in procs.items():
                if name in pending and proc.poll() is not None:
                    raise SystemExit(f"agent {name} exited with {proc.returncode} during mode {mode}; see {self.work}")
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"mode {mode}: {len(pending)} nodes not ready after {self.args.timeout}s: {sorted(pending)}"
                )
            time.sleep(0.05)
        seconds = max(ready.values())
        busy1, total1 = cpu_times()
        own = (process_cpu(ours) - own0) / (seconds * (os.cpu_count() or 1))
        role_cpu = {role: round(process_cpu(pids) - role0[role], 1) for role, pids in roles.items()}
        egress = self.net.counters("origin")[1] - origin_tx
        sources = self.source_bytes(procs)
        for _host, proc in procs.values():
            self.net.stop(proc)
        for name in procs:  # tmpfs: (a)'s copies must not crowd out (b)'s
            shutil.rmtree(self.work / "agents" / name, ignore_errors=True)
        share = (busy1 - busy0) / max(1, total1 - total0)
        return Result(seconds, egress, share, sorted(ready.values()), sources, own, role_cpu)

    def source_bytes(self, procs: dict[str, tuple[str, subprocess.Popen[bytes]]]) -> dict[str, int]:
        """Bytes the nodes received per source (peer, cluster_cache, origin...), summed over their local APIs.

        Empty where the agents do not count per source (a checkout without the sources counters).
        """
        total: dict[str, int] = {}
        for host, _proc in procs.values():
            try:
                with self.net.inside(host):
                    doc = httpx.get("http://127.0.0.1:7070/local/v1/status", timeout=10).json()
            except (httpx.HTTPError, ValueError) as exc:  # informative only: the timing stands without it
                print(f"note: no per-source counters from {host}: {exc}", flush=True)
                continue
            for source, tally in doc.get("counters", {}).get("sources", {}).items():
                total[source] = total.get(source, 0) + int(tally.get("bytes", 0))
        return {k: v for k, v in total.items() if v}

    def check_weightship_mode(self) -> None:
        """Raise ``ModeUnavailable`` naming the missing agent flags (and their branches)."""
        missing = {flag: why for flag, why in B_FLAGS.items() if flag not in agent_flags()}
        if missing:
            names = ", ".join(f"{flag} (branch {why})" for flag, why in missing.items())
            raise ModeUnavailable(
                f"mode (b) needs weightship-agent flags this checkout lacks: {names}; "
                "merge the branches that bring them, or run with --mode origin"
            )

    def run_weightship(self) -> Result:
        """Mode (b): a cluster cache (with the tracker) and nodes that fetch from each other."""
        self.check_weightship_mode()
        cache = self.net.hosts["cache"]
        cache_url = f"http://{cache.ip}:{PEER_PORT}"
        cache_flags = [
            "--role", "cache", "--tier", "cluster", "--peer-listen", f"0.0.0.0:{PEER_PORT}",
            "--peer-address", cache_url, "--token", self.cache_token, *self.args.cache_flag,
        ]  # fmt: skip
        proc = self.start_agent("cache", "b-cache", None, cache_flags)
        try:
            wait_until(lambda: self.registered("b-cache", proc), 120, "the cluster cache to register")

            def node_flags(node: str) -> list[str]:
                address = f"http://{self.net.hosts[node].ip}:{PEER_PORT}"
                return [
                    "--peer-listen", f"0.0.0.0:{PEER_PORT}", "--peer-address", address,
                    "--cluster-cache", cache_url, "--rack", f"r{int(node[1:]) % 4}",
                    # A parent shares its link among up to 4 children (the tracker's default fan-out); the
                    # agent's 5 MB/s default would cut healthy parents off on a 100 Mbit/s link. Floor: half
                    # a fair share of a node link.
                    "--peer-min-rate", str(self.args.rate_bits // 8 // 8), *self.args.node_flag,
                ]  # fmt: skip

            return self.run_mode("b", node_flags)
        finally:
            self.net.stop(proc)


def sources_text(sources: dict[str, int], size: int) -> str:
    return ", ".join(f"{v / size:.2f}× S from {k}" for k, v in sorted(sources.items()))


def report(label: str, result: Result, size: int, ideal: float) -> None:
    spread = (
        f"first node {result.ready_seconds[0]:.1f}s, median {result.ready_seconds[len(result.ready_seconds) // 2]:.1f}s"
    )
    print(
        f"{label}: all ready in {result.seconds:.1f}s = {result.seconds / ideal:.2f}× ideal ({spread}); "
        f"origin egress {result.origin_egress / size:.2f}× S; CPU busy {result.cpu_busy_share:.0%} "
        f"(this run's processes {result.own_cpu_share:.0%}; CPU s {result.cpu_seconds})"
        + (f"; nodes received {sources_text(result.sources, size)}" if result.sources else ""),
        flush=True,
    )


def figures(result: Result | None, size: int, ideal: float) -> dict[str, Any] | None:
    if result is None:
        return None
    return {
        "seconds": round(result.seconds, 2),
        "time_over_ideal": round(result.seconds / ideal, 3),
        "origin_egress_over_size": round(result.origin_egress / size, 3),
        "cpu_busy_share": round(result.cpu_busy_share, 3),
        "own_cpu_share": round(result.own_cpu_share, 3),
        "cpu_seconds": result.cpu_seconds,
        "node_ready_seconds": [round(s, 2) for s in result.ready_seconds],
        "node_bytes_by_source": result.sources,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=16, help="node agents (default: %(default)s)")
    parser.add_argument("--size", default="256MiB", help="artifact size (default: %(default)s)")
    parser.add_argument("--files", type=int, default=4, help="weight files the artifact is split into")
    parser.add_argument("--rate", default="100Mbit", help="every node link and the cache link, each way")
    parser.add_argument("--origin-rate", help="the origin link (default: --rate)")
    parser.add_argument("--cache-rate", help="the cluster cache's link (default: --rate)")
    parser.add_argument("--chunk-size", default="4MiB", help="manifest chunk size (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="agent chunk requests in flight per version")
    parser.add_argument("--mode", choices=("both", "origin", "weightship"), default="both")
    parser.add_argument("--subnet", default="10.77.0", help="private /24 used inside the namespaces only")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a mode may take before it fails")
    parser.add_argument("--cache-flag", action="append", default=[], help="extra flag for the cache agent")
    parser.add_argument("--node-flag", action="append", default=[], help="extra flag for mode (b) node agents")
    parser.add_argument("--logs", help="copy every process's log into this directory before cleaning up")
    parser.add_argument("--dir", help="work directory (default: a new one on /dev/shm, removed afterwards)")
    args = parser.parse_args()
    args.size, args.chunk = parse_size(args.size), parse_size(args.chunk_size)
    args.rate_bits = parse_rate(args.rate)
    args.origin_rate_bits = parse_rate(args.origin_rate) if args.origin_rate else args.rate_bits
    args.cache_rate_bits = parse_rate(args.cache_rate) if args.cache_rate else args.rate_bits
    if not 1 <= args.nodes <= 200:
        raise SystemExit("--nodes must be between 1 and 200 (one /24, addresses .10 upwards)")

    why = unavailable()
    if why:
        print(f"skipped: bench/fanout.py {why}", flush=True)
        print(json.dumps({"bench": "fanout", "skipped": why}))
        return 0

    shm = Path("/dev/shm")
    work = (
        Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ws-fanout-", dir=shm if shm.is_dir() else None))
    )
    work.mkdir(parents=True, exist_ok=True)
    bench = Fanout(args, work)

    def clean_up() -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        bench.net.close()
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in work.glob("*.log"):
                shutil.copy(log, Path(args.logs) / log.name)
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through ``finally``

    atexit.register(clean_up)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)

    ideal = args.size * 8 / args.rate_bits
    load = os.getloadavg()
    print(
        f"conditions: {os.cpu_count()} CPUs ({platform.machine()}), kernel {platform.release()}, "
        f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; {args.nodes} nodes, "
        f"S = {args.size / 2**20:.0f} MiB in {args.files} files, chunk {args.chunk / 2**20:g} MiB, "
        f"node links {args.rate_bits / 1e6:g} Mbit/s, origin link {args.origin_rate_bits / 1e6:g} Mbit/s "
        f"(tbf), ideal {ideal:.1f}s; work dir {work}",
        flush=True,
    )
    origin: Result | None = None
    weightship: Result | None = None
    missing = ""
    try:
        bench.build()
        size = bench.publish()
        ideal = size * 8 / args.rate_bits
        print(f"published {bench.digest} ({size} bytes)", flush=True)
        if args.mode in ("both", "origin"):
            origin = bench.run_mode("a", lambda _node: [])
            report("(a) every node from the origin", origin, size, ideal)
        if args.mode in ("both", "weightship"):
            try:
                weightship = bench.run_weightship()
                report("(b) weightship: cluster cache + tracker + peers", weightship, size, ideal)
            except ModeUnavailable as exc:
                missing = str(exc)
                print(f"(b) not measured: {missing}", flush=True)
    except TopologyError as exc:
        print(f"skipped: bench/fanout.py cannot build the network: {exc}", flush=True)
        print(json.dumps({"bench": "fanout", "skipped": str(exc)}))
        return 0
    finally:
        clean_up()
    speedup = origin.seconds / weightship.seconds if origin and weightship else None
    if speedup is not None:
        print(f"speed-up of (b) over (a): {speedup:.1f}×", flush=True)
    main_result = weightship or origin
    assert main_result is not None
    print(
        json.dumps(
            {
                "bench": "fanout",
                "nodes": args.nodes,
                "size": size,
                "rate_bits": args.rate_bits,
                "origin_rate_bits": args.origin_rate_bits,
                "cache_rate_bits": args.cache_rate_bits,
                "cache_flags": args.cache_flag,
                "node_flags": args.node_flag,
                "chunk_size": args.chunk,
                "ideal_seconds": round(ideal, 2),
                "time_over_ideal": round(weightship.seconds / ideal, 3) if weightship else None,
                "origin_egress_over_size": round(weightship.origin_egress / size, 3) if weightship else None,
                "speedup_over_origin": round(speedup, 2) if speedup is not None else None,
                "cpu_busy_share": round(main_result.cpu_busy_share, 3),
                "cpus": os.cpu_count(),
                "load_average_before": round(load[0], 2),
                "load_average_after": round(os.getloadavg()[0], 2),
                "origin": figures(origin, size, ideal),
                "weightship": figures(weightship, size, ideal),
                **({"weightship_missing": missing} if missing else {}),
            }
        )
    )
    return 3 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
