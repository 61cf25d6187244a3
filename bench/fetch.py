"""Fetch throughput of one agent against ``curl`` of the same bytes from the same origin, in one run.

Two origins, each measured with both clients:

* ``sendfile``: a static file server (aiohttp ``FileResponse``: ``sendfile``, range requests)
  over the control plane's blob directory, standing in for S3 or nginx: an origin that is not
  the bottleneck and leaves the node's CPUs to the client. The control plane's signed blob URLs
  point at it (a second control-plane process on the same database with that public URL).
  This is the figure that measures the agent, and the one ``ratio_vs_curl`` reports.
* ``controlplane``: the control plane itself serves the blobs on its signed URLs (uvicorn,
  local-directory store), as in the local demo. On a small machine the origin then competes
  with the client for the same CPUs, so this ratio says as much about the co-located origin.

* ``curl``: one ``curl`` process downloads every blob of the version (one GET per blob, one
  connection reused) into files on the same disk. It verifies nothing and syncs nothing.
* ``curl_verified``: what a careful user does instead of the agent: per file,
  ``curl URL | tee FILE | openssl dgst -sha256``, all files at once, then compares each digest
  with the manifest's. It verifies whole files (not chunks before they are written) and syncs
  nothing.
* ``agent``: a real ``weightship-agent`` process, registered and idle, is pointed at the version;
  timed from the pointer update to the local API reporting it ready. That covers the long-poll
  wake-up, manifest, blob URLs, range requests with bounded concurrency, SHA-256 of every chunk
  before it is written, the verification record, the rename into ``versions/`` and the
  ``current`` switch. A fresh data directory and agent each round. Like curl's, the agent's
  bytes are then in the page cache, not yet on the disk: the agent flushes a version just after
  it is ready (``agent.durability``; a crash before that makes it hash the version again at
  start-up). The bench waits for that flush after each timed interval and reports it apart
  (``agent_durable_seconds``: pointer update to flushed).

Rounds alternate curl, curl_verified and agent (``--repeat``) so a noisy shared machine hurts both alike; the
figures use each side's best round, medians are printed too. The origin's files are read once
beforehand so every round starts from a warm page cache on the origin side.

Usage: python bench/fetch.py [--size 2GiB] [--files 4] [--chunk-size 64MiB] [--concurrency 8]
                             [--repeat 3] [--dir PATH]
Last line: one JSON object; ``ratio_vs_curl`` = agent GB/s / curl GB/s (sendfile origin, best
rounds); ``ratio_vs_curl_verified`` = agent GB/s / curl_verified GB/s (same origin, best rounds);
``ratio_vs_curl_controlplane_origin`` the same as ``ratio_vs_curl`` with the control plane serving;
``cpu_seconds_per_gb``: CPU seconds (user + system) per GB of each client's least round (curl and
its pipeline as waited-for children, the agent from ``/proc`` between the pointer update and
ready), less sensitive to a loaded machine than wall time; ``cpu_vs_curl_verified`` and
``cpu_vs_curl`` = agent / rival (when the CPUs are shared with other work, the wall-clock ratio
tends to 1 / ``cpu_vs_curl``; with every core free, to about ``cores / cpu_vs_curl``, since curl
runs on one);
``localapi_p99_ms_during_fetch`` and ``heartbeat_p99_ms_during_fetch``: the agent's local API and
heartbeat p99 latency while it fetches the version, in one more round after the timed ones (its
probes cost CPU, so it counts in no throughput figure); ``others_cores``: per client, the cores
that processes outside the run (not the bench, its origin and control plane, curl, the agent)
kept busy on average during each timed round (``/proc/stat``), i.e. how much of the host the run
did not have.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.hostcpu import cpu_seconds, host_busy
from weightship.client import Client
from weightship.sizes import parse_size
from weightship.testing import eventually as wait_until
from weightship.testing import free_port, wait_for_port

REPO = Path(__file__).resolve().parent.parent
ADMIN = "ws_bench-fetch-admin-token-0123456789abcdef"
PY = sys.executable


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def heartbeat_seconds(log: str) -> list[float]:
    """The durations the agent logs for its heartbeats (``heartbeat.sent``, debug level)."""
    return [float(m) for m in re.findall(r"heartbeat\.sent seconds=([0-9.]+)", log)]


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_static(root: str, port: int) -> None:
    """``--serve-static``: blobs of a local store at ``/v1/blobs/<sha256>`` with sendfile and ranges."""
    from aiohttp import web

    base = Path(root)

    async def blob(request: web.Request) -> web.StreamResponse:
        path = base / request.match_info["sha"]
        return web.FileResponse(path) if path.is_file() else web.Response(status=404)

    app = web.Application()
    app.router.add_get("/v1/blobs/{sha}", blob)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def make_model(root: Path, size: int, files: int) -> None:
    """``files`` safetensors shards of random bytes (distinct chunks: nothing deduplicates)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1234)
    per = size // files
    for i in range(files):
        data = np.frombuffer(rng.bytes(per), dtype=np.uint8)
        save_file({f"layer{i}.weight": data}, str(root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "bench", "files": files}))


def filesystem(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        fields = out.splitlines()[1].split()
        return f"{fields[1]} on {fields[0]}"
    except (subprocess.CalledProcessError, IndexError, FileNotFoundError):
        return "unknown"


class Bench:
    """The processes of one run and the measurements."""

    def __init__(self, work: Path, concurrency: int) -> None:
        self.work = work
        self.concurrency = concurrency
        self.procs: list[subprocess.Popen[bytes]] = []
        self.rounds = 0
        #: CPU seconds of the last round measured, by client (``curl``, ``curl_verified``, ``agent``)
        self.cpu: dict[str, float] = {}
        #: cores other processes kept busy during the last round measured, by client
        self.others: dict[str, float] = {}
        #: seconds from the last agent round's pointer update to its version flushed to disk
        self.durable_seconds = 0.0

    def _run_cpu(self) -> float:
        """CPU seconds of this run so far: this process, its waited-for children, its live processes."""
        total = cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN)
        for proc in self.procs:
            try:
                total += process_cpu(proc.pid)
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
        return total

    def _start_interval(self) -> tuple[float, float, float]:
        return time.monotonic(), host_busy(), self._run_cpu()

    def _others(self, start: tuple[float, float, float], run_cpu: float | None = None) -> float:
        wall = time.monotonic() - start[0]
        ours = (self._run_cpu() if run_cpu is None else run_cpu) - start[2]
        return max(0.0, host_busy() - start[1] - ours) / max(wall, 1e-9)

    def spawn(self, argv: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.work / log, "ab") as out:
            proc = subprocess.Popen(argv, cwd=REPO, env=env or dict(os.environ), stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def controlplane(self, public_url: str | None = None) -> str:
        """Start a control-plane process on the shared database and store; returns its URL."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "WEIGHTSHIP_DATABASE_URL": f"sqlite:///{self.work / 'cp.db'}",
            "WEIGHTSHIP_STORE": f"local:{self.work / 'origin'}",
            "WEIGHTSHIP_ADMIN_TOKEN": ADMIN,
            "WEIGHTSHIP_PUBLIC_URL": public_url or url,
            "WEIGHTSHIP_URL_SIGNING_KEY": "bench-signing-key",
        }
        self.spawn([PY, "-m", "controlplane", "serve", "--port", str(port), "--log-level", "warning"], "cp.log", env)
        wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, 60, "the control plane")
        return url

    def curl(self, cp_url: str, blobs: list[str], size: int) -> float:
        """Seconds for one curl process to download every blob into files."""
        out = self.work / "curl"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        with Client(cp_url, ADMIN) as client:
            urls = client.blob_urls(blobs).urls
        argv = ["curl", "-sS", "--fail"]
        for blob in blobs:
            argv += ["-o", str(out / blob), urls[blob].url]
        cpu = cpu_seconds(resource.RUSAGE_CHILDREN)
        interval = self._start_interval()
        t = time.monotonic()
        subprocess.run(argv, check=True)
        seconds = time.monotonic() - t
        self.others["curl"] = self._others(interval)
        self.cpu["curl"] = cpu_seconds(resource.RUSAGE_CHILDREN) - cpu
        got = sum((out / b).stat().st_size for b in blobs)
        assert got == size, f"curl fetched {got} bytes, expected {size}"
        shutil.rmtree(out)
        return seconds

    def curl_verified(self, cp_url: str, blobs: list[str], size: int) -> float:
        """Seconds for ``curl | tee FILE | openssl dgst -sha256`` per blob, all at once, digests checked."""
        out = self.work / "curl-verified"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        with Client(cp_url, ADMIN) as client:
            urls = client.blob_urls(blobs).urls
        script = 'set -o pipefail; curl -sS --fail "$1" | tee "$2" | openssl dgst -sha256 -r'
        cpu = cpu_seconds(resource.RUSAGE_CHILDREN)
        interval = self._start_interval()
        t = time.monotonic()
        procs = {
            blob: subprocess.Popen(
                ["bash", "-c", script, "curl-verified", urls[blob].url, str(out / blob)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for blob in blobs
        }
        digests = {blob: proc.communicate()[0].split()[0] for blob, proc in procs.items()}
        seconds = time.monotonic() - t
        self.others["curl_verified"] = self._others(interval)
        self.cpu["curl_verified"] = cpu_seconds(resource.RUSAGE_CHILDREN) - cpu
        for blob, proc in procs.items():
            assert proc.returncode == 0, f"curl | tee | openssl failed for {blob}"
            assert digests[blob] == blob, f"{blob}: openssl computed {digests[blob]}"
        got = sum((out / b).stat().st_size for b in blobs)
        assert got == size, f"curl_verified fetched {got} bytes, expected {size}"
        shutil.rmtree(out)
        return seconds

    def agent(self, cp_url: str, token: str, digest: str) -> tuple[float, int]:
        """Seconds from a pointer update to a fresh agent serving ``digest``, and its bytes downloaded."""
        seconds, downloaded, _latency = self._agent_round(cp_url, token, digest, probe=False)
        return seconds, downloaded

    def agent_latency(self, cp_url: str, token: str, digest: str) -> dict[str, Any]:
        """p99 latency of the agent's local API and heartbeats while it fetches ``digest`` (a round of its own).

        The local API is asked for the deployment (what a model server asks) and for ``/status``
        (the heartbeat body, built as the heartbeat loop builds it) every 20 ms; heartbeats run
        every 0.1 s and the agent logs each one's duration, from due to answered. This round's
        time counts in no throughput figure: the probes cost CPU.
        """
        _seconds, _downloaded, latency = self._agent_round(cp_url, token, digest, probe=True)
        return latency

    def _agent_round(self, cp_url: str, token: str, digest: str, *, probe: bool) -> tuple[float, int, dict[str, Any]]:
        self.rounds += 1
        name = f"bench-{self.rounds}"
        data = self.work / name
        log = self.work / f"{name}.log"
        with Client(cp_url, ADMIN) as client:
            client.create_deployment(name, "bench")
            argv = [
                PY, "-m", "agent", "--control-plane", cp_url, "--name", name, "--data-dir", str(data),
                "--deployment", name, "--local-api", "127.0.0.1:0", "--concurrency", str(self.concurrency),
                "--no-prefetch",
            ]  # fmt: skip
            if probe:
                argv += ["--log-level", "debug", "--heartbeat-interval", "0.1"]
            agent = self.spawn(argv, log.name, {**os.environ, "WEIGHTSHIP_AGENT_TOKEN": token})
            runtime = data / "agent.json"
            wait_until(lambda: json.loads(runtime.read_text())["node_id"], 60, "the agent to register")
            api = json.loads(runtime.read_text())["local_api"]
            if probe:
                wait_until(lambda: heartbeat_seconds(log.read_text()), 60, "a first heartbeat")
            log_start = log.stat().st_size
            cpu = process_cpu(agent.pid)
            interval = self._start_interval()
            t = time.monotonic()
            client.set_pointer(name, digest, expected_epoch=client.get_deployment(name).epoch)
        latency: dict[str, Any] = {}
        if probe:
            local_api: list[float] = []
            status: list[float] = []
            with httpx.Client(base_url=api, timeout=60) as http:
                while True:
                    t0 = time.monotonic()
                    view = http.get(f"/local/v1/deployments/{name}").json()
                    local_api.append(time.monotonic() - t0)
                    t0 = time.monotonic()
                    http.get("/local/v1/status").raise_for_status()
                    status.append(time.monotonic() - t0)
                    if view.get("ready") and view.get("digest") == digest:
                        break
                    time.sleep(0.02)
            with open(log, "rb") as handle:
                handle.seek(log_start)
                heartbeats = heartbeat_seconds(handle.read().decode(errors="replace"))
            latency = {
                "localapi_p99_ms_during_fetch": round(p99(local_api) * 1000, 1),
                "status_p99_ms_during_fetch": round(p99(status) * 1000, 1),
                "heartbeat_p99_ms_during_fetch": round(p99(heartbeats) * 1000, 1) if heartbeats else None,
                "localapi_samples_during_fetch": len(local_api),
                "heartbeats_during_fetch": len(heartbeats),
            }
            view = httpx.get(f"{api}/local/v1/deployments/{name}").json()
        else:
            view = httpx.get(
                f"{api}/local/v1/deployments/{name}/wait", params={"after_epoch": 0, "timeout": 600}, timeout=620
            ).json()
        seconds = time.monotonic() - t
        run_cpu = self._run_cpu()
        self.cpu["agent"] = process_cpu(agent.pid) - cpu
        self.others["agent"] = self._others(interval, run_cpu)
        assert view["ready"], view
        assert view["digest"] == digest, view
        unsynced = data / "versions" / digest.removeprefix("sha256:") / ".weightship" / "unsynced"
        wait_until(lambda: not unsynced.exists(), 600, "the agent to flush the version to disk")
        self.durable_seconds = time.monotonic() - t
        downloaded = int(httpx.get(f"{api}/local/v1/status").json()["counters"]["bytes_downloaded"])
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        self.procs.remove(agent)
        shutil.rmtree(data)
        return seconds, downloaded, latency

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GiB", help="version size (default: %(default)s)")
    parser.add_argument("--files", type=int, default=4, help="weight files (default: %(default)s)")
    parser.add_argument("--chunk-size", default="64MiB", help="manifest chunk size (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="agent chunk requests in flight")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds per origin (default: %(default)s)")
    parser.add_argument(
        "--origins", default="sendfile,controlplane", help="origins measured, comma-separated (default: %(default)s)"
    )
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed afterwards)")
    parser.add_argument("--serve-static", nargs=2, metavar=("DIR", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_static:
        serve_static(args.serve_static[0], int(args.serve_static[1]))
        return
    size, chunk = parse_size(args.size), parse_size(args.chunk_size)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ws-bench-fetch-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    bench = Bench(work, args.concurrency)
    try:
        print(
            f"conditions: {os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}, "
            f"loopback, work dir {work} ({filesystem(work)}), {size / 2**30:.2f} GiB in {args.files} files, "
            f"chunk {chunk / 2**20:.0f} MiB, agent concurrency {args.concurrency}, "
            f"{args.repeat} alternating rounds per origin; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        t = time.monotonic()
        make_model(work / "model", size, args.files)
        print(f"model generated in {time.monotonic() - t:.1f}s", flush=True)
        cp_url = bench.controlplane()
        with Client(cp_url, ADMIN, timeout=600) as client:
            t = time.monotonic()
            version = client.publish_directory(work / "model", "bench", ["v1"], chunk_size=chunk).version
            print(f"published {version.digest} ({version.size} bytes) in {time.monotonic() - t:.1f}s", flush=True)
            blobs = [f["sha256"] for f in json.loads(client.get_manifest("bench", version.digest))["files"]]
            token = client.create_token("bench-agent", "agent").token
        blob_dir = work / "origin" / "blobs" / "sha256"
        for blob in blobs:  # warm the origin's page cache for every round alike
            with open(blob_dir / blob, "rb") as handle:
                while handle.read(16 << 20):
                    pass
        static_port = free_port()
        bench.spawn([PY, __file__, "--serve-static", str(blob_dir), str(static_port)], "static.log")
        # The control plane refuses a public URL on loopback where nothing listens yet.
        wait_for_port(static_port, 60)
        origins = {"sendfile": bench.controlplane(f"http://127.0.0.1:{static_port}"), "controlplane": cp_url}
        origins = {name: url for name, url in origins.items() if name in args.origins.split(",")}

        results: dict[str, dict[str, Any]] = {}
        gb = version.size / 1e9
        for origin, url in origins.items():
            curl_s: list[float] = []
            verified_s: list[float] = []
            agent_s: list[float] = []
            downloaded: list[int] = []
            cpu: dict[str, list[float]] = {"curl": [], "curl_verified": [], "agent": []}
            others: dict[str, list[float]] = {"curl": [], "curl_verified": [], "agent": []}
            durable_s: list[float] = []
            for round_ in range(args.repeat):
                curl_s.append(bench.curl(url, blobs, version.size))
                verified_s.append(bench.curl_verified(url, blobs, version.size))
                seconds, got = bench.agent(url, token, version.digest)
                agent_s.append(seconds)
                downloaded.append(got)
                durable_s.append(bench.durable_seconds)
                for client_name in cpu:
                    cpu[client_name].append(bench.cpu[client_name])
                    others[client_name].append(bench.others[client_name])
                print(
                    f"{origin} round {round_ + 1}: curl {curl_s[-1]:.3f}s "
                    f"({version.size / curl_s[-1] / 1e9:.3f} GB/s), curl|tee|openssl {verified_s[-1]:.3f}s "
                    f"({version.size / verified_s[-1] / 1e9:.3f} GB/s), agent {seconds:.3f}s "
                    f"({version.size / seconds / 1e9:.3f} GB/s), agent downloaded {got} bytes; CPU s/GB: "
                    f"curl {cpu['curl'][-1] / gb:.2f}, curl|tee|openssl {cpu['curl_verified'][-1] / gb:.2f}, "
                    f"agent {cpu['agent'][-1] / gb:.2f}; agent flushed at {durable_s[-1]:.3f}s; cores busy outside the run: "
                    f"{others['curl'][-1]:.2f} / {others['curl_verified'][-1]:.2f} / {others['agent'][-1]:.2f}",
                    flush=True,
                )
            cpu_per_gb = {name: round(min(values) / gb, 3) for name, values in cpu.items()}
            curl_gbps = version.size / min(curl_s) / 1e9
            verified_gbps = version.size / min(verified_s) / 1e9
            agent_gbps = version.size / min(agent_s) / 1e9
            print(
                f"{origin}: curl best {curl_gbps:.3f} GB/s (median {statistics.median(curl_s):.3f}s), "
                f"curl|tee|openssl best {verified_gbps:.3f} GB/s (median {statistics.median(verified_s):.3f}s), "
                f"agent best {agent_gbps:.3f} GB/s (median {statistics.median(agent_s):.3f}s), "
                f"ratio vs curl {agent_gbps / curl_gbps:.3f}, vs curl verified {agent_gbps / verified_gbps:.3f}; "
                f"CPU s/GB (least): {cpu_per_gb}",
                flush=True,
            )
            results[origin] = {
                "curl_seconds": [round(s, 4) for s in curl_s],
                "curl_verified_seconds": [round(s, 4) for s in verified_s],
                "agent_seconds": [round(s, 4) for s in agent_s],
                "agent_durable_seconds": [round(s, 4) for s in durable_s],
                "others_cores": {name: [round(v, 2) for v in values] for name, values in others.items()},
                "agent_bytes_downloaded": downloaded,
                "curl_gbps": round(curl_gbps, 4),
                "curl_verified_gbps": round(verified_gbps, 4),
                "agent_gbps": round(agent_gbps, 4),
                "ratio": round(agent_gbps / curl_gbps, 4),
                "ratio_vs_curl_verified": round(agent_gbps / verified_gbps, 4),
                "cpu_seconds_per_gb": cpu_per_gb,
                "cpu_vs_curl_verified": round(cpu_per_gb["agent"] / max(cpu_per_gb["curl_verified"], 1e-9), 3),
                "cpu_vs_curl": round(cpu_per_gb["agent"] / max(cpu_per_gb["curl"], 1e-9), 3),
            }
        latency = bench.agent_latency(origins["sendfile"], token, version.digest)
        print(
            f"during a {version.size / 2**30:.2f} GiB fetch (sendfile origin): local API p99 "
            f"{latency['localapi_p99_ms_during_fetch']} ms, /status p99 {latency['status_p99_ms_during_fetch']} ms, "
            f"heartbeat p99 {latency['heartbeat_p99_ms_during_fetch']} ms "
            f"({latency['localapi_samples_during_fetch']} samples, {latency['heartbeats_during_fetch']} heartbeats)",
            flush=True,
        )
        print(
            json.dumps(
                {
                    "bench": "fetch",
                    "bytes": version.size,
                    "files": len(blobs),
                    "chunk_size": chunk,
                    "concurrency": args.concurrency,
                    "rounds": args.repeat,
                    "cpus": os.cpu_count(),
                    "sendfile_origin": results["sendfile"],
                    "controlplane_origin": results.get("controlplane"),
                    "curl_gbps": results["sendfile"]["curl_gbps"],
                    "agent_gbps": results["sendfile"]["agent_gbps"],
                    "ratio_vs_curl": results["sendfile"]["ratio"],
                    "curl_verified_gbps": results["sendfile"]["curl_verified_gbps"],
                    "ratio_vs_curl_verified": results["sendfile"]["ratio_vs_curl_verified"],
                    "cpu_seconds_per_gb": results["sendfile"]["cpu_seconds_per_gb"],
                    "cpu_vs_curl_verified": results["sendfile"]["cpu_vs_curl_verified"],
                    "cpu_vs_curl": results["sendfile"]["cpu_vs_curl"],
                    "agent_durable_seconds": results["sendfile"]["agent_durable_seconds"],
                    "others_cores": results["sendfile"]["others_cores"],
                    "load_average": round(os.getloadavg()[0], 2),
                    "ratio_vs_curl_controlplane_origin": results["controlplane"]["ratio"]
                    if "controlplane" in results
                    else None,
                    **latency,
                }
            )
        )
    finally:
        bench.close()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
