"""`make demo`: the main job end to end on one machine, on embedded defaults.

Starts a local S3 (moto's server, its own process) and the control plane (its own process,
SQLite), generates a ~200 MB llama-style model in three versions (v2 redraws one shard; v3 also
has NaNs in one layer), publishes them (shared shards are not uploaded again), and rolls v1 out. A
cluster cache (an agent in ``--role cache --tier cluster``, which also runs the cluster's tracker)
and 4 node agents start, each agent with a model server beside it; they fetch and verify v1
through the cache and from each other (the origin sends v1 about once) while requests flow.

Then the rollouts, started with ``weightship rollout start``: v2 is prefetched on every node, 25 %
of the nodes switch to it, the control plane judges the canary on the model servers' own counters
(validation, error rate) against stable, and promotes it. v3 goes the same way until its canary
fails validation: the rollout aborts by itself and the canary nodes switch back to v2, already on
their disks (0 bytes). Finally ``weightship rollback`` by hand returns everyone to v1.

Every version is signed at publish (``--sign-key``, the OpenSSF model-signing format) and every
agent and the cache run with a signing policy of their own that requires the release key. At the
end a tampered copy of v1 is published unsigned and the pointer moved to it (the control plane
plays one that was taken over: it has no policy): every node refuses it before fetching a byte,
says why, and keeps serving what it served.

With ``--model-dir`` the story runs on a real checkpoint instead (any model ``weightship-serve``
builds, e.g. a Hugging Face directory): v1 is the directory as it is, v2 the same with one norm
scale nudged (``gpu_loader.variants --nudge``: a stand-in for a fine-tune, one weight file
changes), v3 is v2 with NaN in one weight matrix. Traffic goes to ``/v1/completions`` or
``/v1/embeddings``, whichever the model serves. With ``--analysis FILE`` (a JSON list of analysis
metrics, e.g. the Prometheus examples of docs/rollouts.md) the canary is judged by those instead
of the built-in provider; ``--prometheus-targets DIR`` lists the model servers there for
Prometheus' file-based discovery while the demo runs.

The last line is one JSON object of the figures: ``rollouts``, ``auto_rollback_seconds`` (failed
measurement -> every canary node back on stable), ``canary_max_share``, ``serve_failed_requests``,
``serve_versions_seen`` (node-0's answers, in order: v1, v2, v1; node-0 is never a canary at 25 %
or 50 %), ``origin_bytes``, ``peer_bytes`` and ``cache_bytes`` (where the bytes came from; the
origin's count includes what the cache read from it), and ``v1_origin_bytes`` / ``v1_bytes`` (how
many copies of v1 the origin sent), ``signed_versions`` (how many versions were signed) and
``unsigned_refused`` (true only when every node refused the tampered, unsigned version).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from weightship.client import Client
from weightship.schemas import NodeInfo, Role, Rollout
from weightship.testing import eventually, free_port

PY = sys.executable
BIN = Path(PY).parent
MODEL = "demo-llama"
DEPLOYMENT = "demo-chat"
console = Console(highlight=False, width=120)


def wait_until(what: str, check: Callable[[], bool], timeout: float = 60.0, interval: float = 0.02) -> float:
    """Poll ``check`` until true (``weightship.testing.eventually``); the seconds it took. Exits on timeout."""
    start = time.monotonic()
    try:
        eventually(check, timeout, what, interval=interval, not_yet=(httpx.HTTPError, OSError))
    except AssertionError:
        raise SystemExit(f"demo: timed out after {timeout:.0f}s waiting for {what}") from None
    return time.monotonic() - start


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
    """Inference requests against the model servers in turn, counting failures, until stopped.

    ``route`` and ``body`` are the request each server gets; the version that answered is read from
    the ``X-Weightship-Digest`` header every route sets.
    """

    def __init__(self, urls: list[str], route: str = "/v1/generate", body: dict[str, object] | None = None) -> None:
        self.urls = urls
        self.route = route
        self.body = body if body is not None else {"input_ids": [[1, 2, 3, 4]], "max_new_tokens": 1}
        self.ok = 0
        self.failed = 0
        self.digests: set[str] = set()
        #: per server, the digests its answers came from, in order, each change recorded once (v1, v2, v1, ...)
        self._sequences: list[list[str]] = [[] for _ in urls]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                for url, sequence in zip(self.urls, self._sequences, strict=True):
                    try:
                        r = http.post(url + self.route, json=self.body)
                    except httpx.HTTPError:
                        self.failed += 1
                        continue
                    if r.status_code != 200:
                        self.failed += 1
                        continue
                    self.ok += 1
                    digest = r.headers["X-Weightship-Digest"]
                    self.digests.add(digest)
                    if not sequence or sequence[-1] != digest:
                        sequence.append(digest)

    def sequence(self, server: int) -> list[str]:
        return list(self._sequences[server])

    def answered_with(self, server: int, digest: str, changes: int) -> bool:
        """Whether ``server`` answered from ``digest`` after at least ``changes`` changes of version."""
        sequence = self._sequences[server]
        return len(sequence) > changes and sequence[-1] == digest

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def start_serve(procs: Processes, env: dict[str, str], index: int, agent_port: int) -> str:
    """``weightship-serve`` beside agent ``index``, pushing its counters every half second; its URL."""
    port = free_port()
    argv = [PY, "-m", "gpu_loader.serve", "--agent", f"http://127.0.0.1:{agent_port}", "--deployment", DEPLOYMENT,
            "--port", str(port), "--device", "cpu", "--verify", "trust", "--workers", "1",
            "--metrics-push-seconds", "0.5"]  # fmt: skip
    procs.start(f"serve-{index}", argv, env)
    return f"http://127.0.0.1:{port}"


def cli(url: str, token: str, *argv: str) -> str:
    """Run the ``weightship`` CLI as a user would; its standard output. Fails the demo on a non-zero exit."""
    env = {**os.environ, "WEIGHTSHIP_URL": url, "WEIGHTSHIP_TOKEN": token, "COLUMNS": "120"}
    run = subprocess.run([str(BIN / "weightship"), *argv], env=env, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"demo: `weightship {' '.join(argv)}` failed ({run.returncode}): {run.stderr.strip()}")
    return run.stdout


def rollout_spec(weight: int, analysis: list[dict[str, object]] | None = None) -> dict[str, object]:
    """Prefetch everywhere, move ``weight`` % of the nodes, then judge the canary against stable.

    ``golden``: any failed validation (golden check, NaN scan) of the canary fails the rollout.
    ``error-rate``: the canary's 5xx rate may exceed stable's by at most 5 points. Both compare the
    model servers' own counters, reported through their agents, over the same 20 s window (the
    control plane needs samples covering half a window, so a longer one would see no data in a
    demo that starts its rollouts a minute after the control plane).
    """
    # Up to 4 measurements 2 s apart: the canary's model server loads and validates after its agent
    # switched, and its counters reach the control plane a second or two later (push, heartbeat,
    # sample); measurements before that are no data, tolerated 3 times, never counted as success.
    timing = {"initialDelay": "2s", "interval": "2s", "count": 4, "inconclusiveLimit": 3}
    golden = {"metric": "validation", "window": "20s", "timeout": "1s"}
    errors = {"metric": "errorRate", "minRequests": 5, "window": "20s", "timeout": "1s"}
    metrics = [
        {"name": "golden", "provider": {"builtin": golden}, "failureCondition": "result['canary_failed'] > 0", **timing},
        {"name": "error-rate", "provider": {"builtin": errors}, "successCondition": "result['delta'] <= 0.05", **timing},
    ]
    if analysis is not None:  # the metrics the user gave (--analysis), as they are
        metrics = analysis
    return {"steps": [{"prefetch": {"percent": 100}}, {"setWeight": weight}, {"analysis": {"metrics": metrics}}]}


def start_rollout(
    url: str,
    token: str,
    label: str,
    work: Path,
    weight: int,
    *,
    steps: bool = True,
    analysis: list[dict[str, object]] | None = None,
) -> str:
    """``weightship rollout start DEPLOYMENT LABEL --spec FILE``; the rollout's id."""
    spec = work / f"rollout-{label}.json"
    spec.write_text(json.dumps(rollout_spec(weight, analysis) if steps else {"steps": []}))
    answer = json.loads(cli(url, token, "rollout", "start", DEPLOYMENT, label, "--spec", str(spec), "--json"))
    return str(answer["id"])


@dataclass
class Followed:
    """What the demo saw while a rollout ran."""

    rollout: Rollout
    seconds: float
    #: the largest share of the agents serving the version while it was a canary
    max_share: float
    #: each node's bytes received when the canary step began
    bytes_at_canary: dict[str, int]
    #: when the measurement that failed the analysis finished (server clock), if one did
    failed_at: datetime | None
    reason: str


def follow(
    ops: Client, rollout_id: str, version: str, procs: Processes, ports: list[int], counters: Callable[[], dict[str, int]]
) -> Followed:
    """Print each step as the rollout takes it, until it completes or is aborted."""
    start = time.monotonic()
    shown = ""
    max_share = 0.0
    bytes_at_canary: dict[str, int] = {}
    while time.monotonic() - start < 300:
        procs.check()
        rollout = ops.get_rollout(DEPLOYMENT, rollout_id)
        current = rollout.steps[rollout.step_index] if rollout.step_index < len(rollout.steps) else None
        if current is not None and current.kind == "setWeight" and not bytes_at_canary:
            bytes_at_canary = counters()
        line = f"{rollout.phase}: {current.summary if current else 'done'} — {rollout.message}"
        if line != shown:
            console.print(f"  [{time.monotonic() - start:5.1f}s] step {min(rollout.step_index + 1, rollout.steps_total)}"
                          f"/{rollout.steps_total} {line}")  # fmt: skip
            shown = line
        if rollout.phase == "Paused":
            raise SystemExit(f"demo: rollout {rollout_id} paused: {rollout.message}")
        if rollout.completed or rollout.aborted:
            failed = [
                (m.finished_at, f"{metric.name}: {m.message or m.value}")
                for run in rollout.analysis_runs
                for metric in run.metrics
                for m in metric.measurements
                if m.phase == "Failed" and m.finished_at is not None
            ]
            # Aborted without a failed measurement: the engine refused the canary before any analysis
            # (its model server refused the version); the rollout's last update is when it aborted.
            aborted_at = rollout.updated_at if rollout.aborted else None
            failed_at, reason = min(failed, key=lambda f: f[0]) if failed else (aborted_at, rollout.message)
            return Followed(rollout, time.monotonic() - start, max_share, bytes_at_canary, failed_at, reason)
        # The share of agents serving the version while it is the canary: the pointer read before
        # and after the agents' states must both name it as canary (a promotion in between would
        # count the whole fleet).
        if ops.get_deployment(DEPLOYMENT).canary == version:
            states = [local_state(p).get("digest") for p in ports]
            if ops.get_deployment(DEPLOYMENT).canary == version:
                max_share = max(max_share, sum(d == version for d in states) / len(states))
        time.sleep(0.1)
    raise SystemExit(f"demo: rollout {rollout_id} of {version[:19]} did not finish in 300 s")


def request_for(url: str) -> tuple[str, dict[str, object]]:
    """The request the model at ``url`` answers: a route for its task, text when it ships a tokenizer."""
    model = httpx.get(url + "/v1/status", timeout=5).json()["serving"]["model"]
    if model["task"] == "embedding":
        return "/v1/embeddings", {"input": "weightship rolls out model weights" if model["tokenizer"] else [1, 2, 3, 4]}
    return "/v1/completions", {"prompt": "The weights are" if model["tokenizer"] else [1, 2, 3, 4], "max_tokens": 1}


def scrape_targets(directory: Path, urls: list[str]) -> Path:
    """List the model servers in ``directory`` (Prometheus file_sd), written whole by a rename; the file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"weightship-demo-{os.getpid()}.json"
    groups = [{"targets": [url.removeprefix("http://")], "labels": {"job_demo": DEPLOYMENT}} for url in urls]
    path.with_suffix(".tmp").write_text(json.dumps(groups))
    path.with_suffix(".tmp").rename(path)
    return path


def served_digest(url: str) -> str | None:
    response = httpx.get(url + "/readyz", timeout=2)
    return str(response.json().get("digest")) if response.status_code == 200 else None


def start_cache(procs: Processes, work: Path, cp_url: str, token: str, env: dict[str, str], policy: Path) -> str:
    """A cluster cache (``--role cache --tier cluster``, the cluster's tracker too) reading from the origin; its URL.

    No ``--upstream``: the demo has no region cache, so the cache's misses and read-ahead go to the
    origin through the control plane's blob URLs.
    """
    peer, api = free_port(), free_port()
    argv = [PY, "-m", "agent", "--role", "cache", "--tier", "cluster", "--control-plane", cp_url, "--token", token,
            "--name", "demo-cache", "--data-dir", str(work / "cache"), "--local-api", f"127.0.0.1:{api}",
            "--peer-listen", f"127.0.0.1:{peer}", "--heartbeat-interval", "0.5",
            "--signing-policy", str(policy)]  # fmt: skip
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


def signing_setup(work: Path, model: str) -> tuple[bytes, Path]:
    """A release key (EC P-256) and a signing policy requiring it for ``model``: (private key PEM, policy file)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (work / "keys").mkdir()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (work / "keys" / "release.key").write_bytes(pem)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    policy = work / "signing-policy.json"
    body = {"require_signature": True, "keys": [{"id": "release", "public_key": public.decode()}]}
    policy.write_text(json.dumps({"models": {model: body}}, indent=2))
    return pem, policy


def tampered_act(
    work: Path, cp_url: str, publisher: str, ops: Client, model: str, nodes: Callable[[], list[NodeInfo]], agents: int
) -> bool:
    """Publish a tampered, unsigned copy of v1 and point at it; whether every node refused it (and why)."""
    tampered = work / "v1-tampered"
    shutil.copytree(work / "v1", tampered)
    weights = sorted(tampered.glob("*.safetensors"))[-1]
    with open(weights, "r+b") as handle:  # one byte of the last tensor changed: what an attacker would ship
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0x01]))
    with Client(cp_url, publisher) as client:
        digest = client.publish_directory(tampered, model, ["v1-tampered"]).version.digest
    ops.set_pointer(DEPLOYMENT, digest, expected_epoch=ops.get_deployment(DEPLOYMENT).epoch, reason="tampered")

    def refusals() -> dict[str, str]:
        found = {}
        for node in nodes():
            item = next((i for i in node.inventory if i.digest == digest), None)
            if item is not None and item.problem is not None and item.problem.reason.value == "signature_refused":
                found[node.name] = item.problem.message
        return found

    took = wait_until("every node to refuse the tampered, unsigned version", lambda: len(refusals()) >= agents)
    found = refusals()
    for name, why in sorted(found.items()):
        console.print(f"{name} refused {digest[:19]} (tampered copy of v1, unsigned) in {took:.1f}s: "
                      f"{why.split(' (version')[0]}")  # fmt: skip
    never_ready = not any(i.digest == digest and i.state.value == "ready" for n in nodes() for i in n.inventory)
    ops.rollback(DEPLOYMENT, reason="tampered version refused by every node")
    return len(found) >= agents and never_ready


def make_versions(work: Path, model_dir: Path | None, size_mb: float, env: dict[str, str]) -> float:
    """v1, v2 and v3 in ``work``: variants of ``model_dir``, or a generated model; the seconds it took.

    ``model_dir``: v1 is a copy, v2 has one norm scale nudged, v3 is v2 with NaN in one weight
    matrix (``gpu_loader.variants``, one after the other). Otherwise ``gpu_loader.modelgen`` makes
    all three at once (v2 and v3 redraw only the last shard, v3 is broken): one process each, since
    each is independent of the others.
    """
    t0 = time.monotonic()
    if model_dir is not None:
        shutil.copytree(model_dir, work / "v1")
        variants = [PY, "-m", "gpu_loader.variants"]
        subprocess.run([*variants, str(work / "v1"), str(work / "v2"), "--nudge"], check=True, env=env,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        subprocess.run([*variants, str(work / "v2"), str(work / "v3"), "--nan"], check=True, env=env,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        return time.monotonic() - t0
    gen = [PY, "-m", "gpu_loader.modelgen"]
    common = ["--size-mb", str(size_mb), "--seed", "7", "--shards", "4"]
    argvs = [
        [*gen, str(work / "v1"), *common],
        [*gen, str(work / "v2"), *common, "--variant", "1"],
        [*gen, str(work / "v3"), *common, "--variant", "2", "--corrupt", "nan"],
    ]
    running = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL) for argv in argvs]
    codes = [proc.wait() for proc in running]
    if any(codes):
        raise SystemExit(f"demo: gpu_loader.modelgen failed ({codes}) making v1, v2 and v3 in {work}")
    return time.monotonic() - t0


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--size-mb", type=float, default=200.0)
    parser.add_argument(
        "--canary-weight", type=int, default=25, help="percent of the nodes the canary step moves (at least one must fall in it)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--hold", type=float, default=0.0, help="after the story, keep the control plane and its status page up this many seconds")
    parser.add_argument("--model-dir", type=Path, help="roll out this checkpoint (and variants of it) instead of a generated model")
    parser.add_argument("--analysis", type=Path, help="JSON list of analysis metrics judging each canary (default: built-in)")
    parser.add_argument("--prometheus-targets", type=Path, help="write the model servers here for Prometheus' file_sd")
    args = parser.parse_args()
    model_name = args.model_dir.name.lower() if args.model_dir else MODEL
    analysis = json.loads(args.analysis.read_text()) if args.analysis else None
    targets_file: Path | None = None

    work = Path(tempfile.mkdtemp(prefix="weightship-demo-"))
    (work / "logs").mkdir()
    procs = Processes(work / "logs")
    admin = "ws_" + secrets.token_urlsafe(24)
    # moto accepts any credentials; set them here so this process and its children agree.
    os.environ.update({"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo", "AWS_DEFAULT_REGION": "us-east-1"})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    background = ThreadPoolExecutor(max_workers=1)
    try:
        console.rule("[bold]weightship demo")
        console.print(f"work directory: {work}")
        # The versions are made in the background: their processes start while S3 and the control plane do.
        versions = background.submit(make_versions, work, args.model_dir, args.size_mb, env)

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
            # the demo's clock runs fast: rollouts reconcile twice a second, serving counters sampled each second
            "WEIGHTSHIP_ROLLOUT_TICK_SECONDS": "0.5",
            "WEIGHTSHIP_SERVE_SAMPLE_SECONDS": "1",
        }
        procs.start("controlplane", [PY, "-m", "controlplane", "serve", "--port", str(cp_port)], cp_env)
        wait_until("the control plane", lambda: httpx.get(cp_url + "/readyz", timeout=1).status_code == 200)
        console.print(f"control plane at {cp_url} (SQLite), origin store s3://weightship-demo on {s3_url} (moto)")

        with Client(cp_url, admin) as root:
            publisher = root.create_token("demo-publisher", Role.publisher).token
            operator = root.create_token("demo-operator", Role.operator).token
            # An enrolment token: each agent enrols with it once and then uses its own node token.
            agent_token = root.create_token("demo-enrolment", Role.agent).token
            cache_token = root.create_token("demo-cache-enrolment", Role.agent, node_role="cache").token
            viewer = root.create_token("demo-viewer", Role.read).token
        # The status page follows the whole story live (docs/ui.md); it needs a token that may read.
        console.print(f"status page: {cp_url}/ui/ (sign in with the read token {viewer}; live until the demo ends)")

        # The release key signs every version at publish; each agent's own policy file trusts only it.
        release_key, policy = signing_setup(work, model_name)
        console.print(f"signing: release key {work / 'keys'}/release.key; every node's policy ({policy.name}) requires it")

        # 2. Three versions of a real safetensors model (made while S3 and the control plane start).
        made_seconds = versions.result()
        if args.model_dir is not None:
            console.print(f"{args.model_dir.name}: v1 as given, v2 one norm scale nudged, v3 NaN in one weight matrix "
                          f"({made_seconds:.1f}s)")  # fmt: skip
        else:
            console.print(
                f"generated v1, v2 and v3 ({args.size_mb:.0f} MB each, 4 shards; v3 has NaNs in one layer) "
                f"in {made_seconds:.1f}s"
            )

        # 3. Publish all three; unchanged shards are already in the store.
        table = Table("version", "digest", "files", "total", "uploaded", "deduplicated", "hash s", "upload s")
        results = []
        with Client(cp_url, publisher) as client:
            for label in ("v1", "v2", "v3"):
                r = client.publish_directory(work / label, model_name, [label], sign_key=release_key)
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
        v1, v2, v3 = (r.version.digest for r in results)

        # 4. A deployment whose first rollout (v1) makes it stable at once; N agents behind a cluster cache.
        ops = Client(cp_url, operator)
        ops.create_deployment(DEPLOYMENT, model_name)
        rollouts: list[dict[str, object]] = []
        first = start_rollout(cp_url, operator, "v1", work, args.canary_weight, steps=False, analysis=analysis)
        wait_until("the v1 rollout to make v1 stable", lambda: ops.get_rollout(DEPLOYMENT, first).completed)
        rollouts.append({"version": "v1", "phase": ops.get_rollout(DEPLOYMENT, first).phase, "steps": 0})
        cache_url = start_cache(procs, work, cp_url, cache_token, env, policy)
        console.print(f"cluster cache (and the cluster's tracker) at {cache_url}, reading from the origin")
        ports = [free_port() for _ in range(args.agents)]
        for i, port in enumerate(ports):
            peer_port = free_port()
            argv = [PY, "-m", "agent", "--control-plane", cp_url, "--token", agent_token, "--name", f"node-{i}",
                    "--data-dir", str(work / f"node-{i}"), "--deployment", DEPLOYMENT,
                    "--local-api", f"127.0.0.1:{port}", "--heartbeat-interval", "0.5", "--zone", f"zone-{i % 2}",
                    "--gpu-type", "demo", "--peer-listen", f"127.0.0.1:{peer_port}",
                    "--cluster-cache", cache_url, "--signing-policy", str(policy)]  # fmt: skip
            procs.start(f"agent-{i}", argv, env)
        took = wait_until(
            f"{args.agents} agents to fetch, verify and serve v1", lambda: all_serving(procs, ports, v1), timeout=180
        )
        console.print(f"{args.agents} agents fetched, verified and switched to v1 in {took:.1f}s")

        # A model server beside each agent: loads through gpu_loader, validates, hot-swaps on switches,
        # and reports per-version counters (requests, errors, latency, validation) to its agent.
        serve_urls = [start_serve(procs, env, i, port) for i, port in enumerate(ports)]
        took = wait_until(
            "the model servers to load and validate v1",
            lambda: all(served_digest(u) == v1 for u in serve_urls),
            timeout=180,
        )
        console.print(f"{len(serve_urls)} model servers loaded v1 (verify=trust), passed validation, ready in {took:.1f}s")
        if args.prometheus_targets is not None:
            targets_file = scrape_targets(args.prometheus_targets, serve_urls)
            console.print(f"model servers listed for Prometheus in {targets_file}")
        traffic = Traffic(serve_urls, *request_for(serve_urls[0]))
        console.print(f"traffic: POST {traffic.route} {json.dumps(traffic.body)} to each model server in turn")
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

        # 5. v2 (good): prefetch everywhere, canary, judged on the model servers' own figures, promoted.
        console.rule("rollout of v2 (good weights)")
        v2_id = start_rollout(cp_url, operator, "v2", work, args.canary_weight, analysis=analysis)
        v2_run = follow(ops, v2_id, v2, procs, ports, counters)
        if not v2_run.rollout.completed:
            raise SystemExit(f"demo: the v2 rollout did not complete: {v2_run.rollout.phase}: {v2_run.rollout.message}")
        rollouts.append({"version": "v2", "phase": v2_run.rollout.phase, "steps": v2_run.rollout.steps_total})
        wait_until("all agents to serve v2", lambda: all_serving(procs, ports, v2), timeout=120)
        wait_until("heartbeats to report v2", lambda: reported(v2))
        after_v2 = counters()
        took = wait_until(
            "node-0's model server to answer requests with v2", lambda: traffic.answered_with(0, v2, 1), timeout=120
        )
        console.print(
            f"v2 promoted after {v2_run.seconds:.1f}s; canary reached {v2_run.max_share:.0%} of the nodes; "
            f"every model server answers with v2 (hot-swapped under traffic)"
        )

        # 6. v3 (NaNs in one layer): canary fails validation; the rollout rolls itself back, 0 bytes.
        console.rule("rollout of v3 (broken weights: NaNs in one layer)")
        v3_id = start_rollout(cp_url, operator, "v3", work, args.canary_weight, analysis=analysis)
        v3_run = follow(ops, v3_id, v3, procs, ports, counters)
        if v3_run.failed_at is None:
            raise SystemExit(f"demo: the v3 rollout was not aborted: {v3_run.rollout.phase}: {v3_run.rollout.message}")
        wait_until("the canary nodes to serve v2 again", lambda: all_serving(procs, ports, v2), timeout=60,
                   interval=0.005)  # fmt: skip
        auto_rollback = (datetime.now(UTC) - v3_run.failed_at).total_seconds()
        wait_until("heartbeats to report the automatic rollback", lambda: reported(v2))
        after_auto = counters()
        auto_bytes = sum(after_auto[n] - v3_run.bytes_at_canary.get(n, 0) for n in after_auto)
        rollouts.append({"version": "v3", "phase": ops.get_rollout(DEPLOYMENT, v3_id).phase,
                         "steps": v3_run.rollout.steps_total})  # fmt: skip
        console.print(
            f"v3 failed its analysis ({v3_run.reason}); all canary nodes back on v2 {auto_rollback:.2f}s after "
            f"the failed measurement, {auto_bytes} bytes downloaded"
        )
        print(cli(cp_url, operator, "rollout", "status", DEPLOYMENT, "--rollout", v3_id), end="")  # as the CLI drew it

        # 7. Roll back by hand: `weightship rollback` flips the pointer to the copy already on every disk.
        console.rule("manual rollback to v1")
        start = time.monotonic()
        answer = json.loads(cli(cp_url, operator, "--json", "rollback", DEPLOYMENT, "--reason", "demo: back to v1"))
        rollback_cli = time.monotonic() - start
        wait_until("all agents to serve v1 again", lambda: all_serving(procs, ports, v1), timeout=60, interval=0.005)
        rollback_all = time.monotonic() - start
        wait_until("heartbeats to report the rollback", lambda: reported(v1))
        after_rb = counters()
        wait_until(
            "node-0's model server to answer with v1 again", lambda: traffic.answered_with(0, v1, 2), timeout=120
        )
        traffic.stop()
        names = {v1: "v1", v2: "v2", v3: "v3"}
        seen = " -> ".join(names.get(d, d[:19]) for d in traffic.sequence(0))
        console.print(
            f"model servers: {traffic.ok} requests answered through two rollouts and a rollback, "
            f"{traffic.failed} failed; node-0 answered with, in order: {seen}; "
            f"versions any server answered with: {', '.join(sorted(names.get(d, d[:19]) for d in traffic.digests))}"
        )

        final = nodes()
        table = Table("agent", "v1 download", "v2 rollout download", "v3 prefetch", "auto rollback", "manual rollback",
                      "from origin", "from cache", "from peers")  # fmt: skip
        for node in sorted(final, key=lambda n: n.name):
            name, got = node.name, by_source(node)
            table.add_row(
                name,
                mb(after_v1[name]),
                mb(after_v2[name] - after_v1[name]),
                mb(v3_run.bytes_at_canary.get(name, 0) - after_v2[name]),
                mb(after_auto[name] - v3_run.bytes_at_canary.get(name, 0)),
                mb(after_rb[name] - after_auto[name]),
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
        rollback_bytes = sum(after_rb[n] - after_auto[n] for n in after_rb)
        console.print(
            f"manual rollback: `weightship rollback` took {rollback_cli * 1000:.0f} ms (API {answer['seconds'] * 1000:.0f} "
            f"ms), all {args.agents} agents switched in {rollback_all * 1000:.0f} ms, {rollback_bytes} bytes downloaded"
        )

        history = Table("epoch", "action", "actor", "stable", "canary", "share", "reason")
        for ev in ops.history(DEPLOYMENT):
            history.add_row(
                str(ev.epoch), ev.action, ev.actor, names.get(ev.to_stable or "", "-"),
                names.get(ev.to_canary or "", "-"), f"{ev.canary_share:.0%}", ev.reason,
            )  # fmt: skip
        console.print(history)
        unsigned_refused = tampered_act(work, cp_url, publisher, ops, model_name, nodes, args.agents)
        ops.close()

        figures = {
            "versions_published": len(results),
            "bytes_uploaded": sum(r.bytes_uploaded for r in results),
            "bytes_deduplicated": sum(r.bytes_deduplicated for r in results),
            "rollouts": rollouts,
            "canary_max_share": round(max(v2_run.max_share, v3_run.max_share), 4),
            "auto_rollback_seconds": round(auto_rollback, 4),
            "auto_rollback_bytes_downloaded": auto_bytes,
            "rollback_seconds": round(float(answer["seconds"]), 4),
            "rollback_cli_seconds": round(rollback_cli, 4),
            "agents": args.agents,
            "rollback_bytes_downloaded": rollback_bytes,
            "rollback_all_switched_seconds": round(rollback_all, 4),
            "v2_switch_bytes_downloaded": sum(after_v2[n] - after_v1[n] for n in after_v2),
            "serve_requests": traffic.ok + traffic.failed,
            "serve_failed_requests": traffic.failed,
            "serve_versions_seen": traffic.sequence(0),
            "serve_versions_answered": sorted(traffic.digests),
            "origin_bytes": origin_total,
            "peer_bytes": source_total(final, "peer"),
            "cache_bytes": source_total(final, "cluster_cache"),
            "v1_bytes": v1_size,
            "v1_origin_bytes": v1_origin,
            "signed_versions": sum(1 for r in results if r.signatures),
            "unsigned_refused": unsigned_refused,
        }
        if args.hold > 0:
            console.print(f"status page still at {cp_url}/ui/ for {args.hold:.0f} s (Ctrl-C to stop)")
            with contextlib.suppress(KeyboardInterrupt):
                time.sleep(args.hold)  # ok-sleep: the person looks at the page meanwhile
        print(json.dumps(figures))
    finally:
        background.shutdown(wait=True)
        procs.stop()
        if targets_file is not None:
            targets_file.unlink(missing_ok=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
