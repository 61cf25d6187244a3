"""A stand-in for an external model server (vLLM or TGI), run as its own process in tests.

``python -m tests.agent.external_server --model PATH --flavour vllm|tgi --port-file FILE``

Like ``vllm serve PATH`` or ``text-generation-launcher --model-id PATH`` pointed at an agent's
``<data_dir>/deployments/<name>/current``, it reads the weights from that path (every
``*.safetensors`` file, with the ``safetensors`` package) and answers each request with a checksum
of its tensors: what a test compares with the version it expects. A version holding a NaN
anywhere answers every request with 500, as a server running broken weights errors. It loads
again when told, as a switch hook tells it: ``SIGHUP``, or ``POST /reload`` (the ``http`` hook's
JSON; it answers 409 when the hook's ``digest`` is not what the path holds, so a test sees a hook
called before the link moved). ``GET /reloads`` lists the hook bodies it received. ``--latency``
makes every request take that long (a slow canary). A path with no weights behind it is a server
that refused its version: it answers 503 and exports no metrics.

``/metrics`` carries the real servers' metric names:

- ``vllm``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:request_success_total{finished_reason}``, ``vllm:e2e_request_latency_seconds`` (vLLM's
  buckets), all labelled ``model_name`` and ``engine`` as vLLM labels them, and
  ``http_requests_total{handler,method,status}`` as vLLM's API server counts HTTP answers
  (``prometheus-fastapi-instrumentator``, status grouped as ``2xx``/``5xx``). ``model_name`` is
  the first ``--served-model-name``; with ``--served-model-name-is-digest`` it is the digest of the
  version loaded, as ``vllm serve`` started with ``--served-model-name $WEIGHTSHIP_DIGEST chat``;
- ``tgi``: ``tgi_request_count``, ``tgi_request_success``, ``tgi_request_failure{err}``,
  ``tgi_request_duration`` (histogram), ``tgi_queue_size``, unlabelled, as TGI's router exports them.

Counters restart from zero at every load, as a restarted server's do.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from aiohttp import web
from safetensors.numpy import load_file

from weightship.testing import eventually as poll_until
from weightship.testing import terminate

REPO = Path(__file__).resolve().parents[2]

#: ``vllm:e2e_request_latency_seconds`` buckets (vllm/v1/metrics/loggers.py)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
#: TGI's duration buckets: 0.0001 * 1.5**n, n = 1..35 (router/src/server.rs)
TGI_DURATION_BUCKETS = tuple(0.0001 * 1.5**n for n in range(1, 36))


@dataclass
class Loaded:
    """One load of the weights behind the path."""

    digest: str
    answer: str
    broken: bool


@dataclass
class Counts:
    """What the server counted since its last load."""

    ok: int = 0
    failed: int = 0
    latencies: list[float] = field(default_factory=list)


def load(path: Path) -> Loaded:
    """Read every safetensors file behind ``path``; the checksum of its tensors is the answer."""
    real = Path(os.path.realpath(path))
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(real.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if not tensors:
        raise FileNotFoundError(f"no safetensors file under {real}")
    broken = any(bool(np.isnan(t).any()) for t in tensors.values() if t.dtype.kind == "f")
    return Loaded(f"sha256:{real.name}", answer_of(tensors), broken)


def answer_of(tensors: dict[str, np.ndarray]) -> str:
    """What the server answers for these weights: a checksum of every tensor, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(tensors[name]).tobytes())
    return digest.hexdigest()[:16]


class Server:
    """The stand-in's state and routes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.path = Path(args.model)
        self.flavour: str = args.flavour
        self.names: list[str] = args.served_model_name or ["model"]
        self.name_is_digest: bool = args.served_model_name_is_digest
        self.loaded: Loaded | None = None
        self.counts = Counts()
        self.reloads: list[dict[str, object]] = []
        self.running = 0
        self.latency: float = args.latency

    def reload(self) -> Loaded | None:
        """Load the weights the path holds now (nothing yet is not an error: the agent has not switched)."""
        try:
            self.loaded = load(self.path)
        except FileNotFoundError:
            self.loaded = None
        self.counts = Counts()
        print(json.dumps({"event": "loaded", "digest": self.loaded.digest if self.loaded else None}), flush=True)
        return self.loaded

    def model_name(self) -> str:
        if self.name_is_digest and self.loaded is not None:
            return self.loaded.digest
        return self.names[0]

    async def infer(self, request: web.Request) -> web.Response:
        began = time.monotonic()
        self.running += 1
        try:
            await request.read()
            if self.latency:
                await asyncio.sleep(self.latency)  # ok-sleep: deliberate pacing, not a wait for a condition
            if self.loaded is None:
                return web.json_response({"error": "no model loaded"}, status=503)
            if self.loaded.broken:
                self.counts.failed += 1
                return web.json_response({"error": "the model produced NaN"}, status=500)
            self.counts.ok += 1
            self.counts.latencies.append(time.monotonic() - began)
            answer = self.loaded.answer
            if self.flavour == "tgi":
                return web.json_response({"generated_text": answer, "digest": self.loaded.digest})
            body = {"model": self.names[-1], "choices": [{"text": answer, "finish_reason": "stop"}]}
            return web.json_response({**body, "digest": self.loaded.digest})
        finally:
            self.running -= 1

    async def reload_route(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        self.reloads.append(body)
        loaded = self.reload()
        if loaded is None:
            return web.json_response({"error": f"nothing to load at {self.path}"}, status=503)
        if body.get("digest") not in (None, loaded.digest):
            return web.json_response(
                {"error": f"the hook announced {body.get('digest')}, but {self.path} holds {loaded.digest}"}, status=409
            )
        return web.json_response({"digest": loaded.digest})

    async def reloads_route(self, _request: web.Request) -> web.Response:
        return web.json_response(self.reloads)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.loaded is not None else 503)

    async def metrics(self, _request: web.Request) -> web.Response:
        if self.loaded is None:  # a server that could not load its model exports nothing
            return web.Response(status=503, text="no model loaded")
        text = self._tgi() if self.flavour == "tgi" else self._vllm()
        return web.Response(text=text, content_type="text/plain")

    def _vllm(self) -> str:
        labels = f'model_name="{self.model_name()}",engine="0"'
        c = self.counts
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0",
            "# TYPE vllm:request_success_total counter",
            *(
                f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {c.ok if reason == "stop" else 0}'
                for reason in ("stop", "length", "abort")
            ),
            *_histogram("vllm:e2e_request_latency_seconds", labels, VLLM_LATENCY_BUCKETS, c.latencies),
            "# TYPE http_requests_total counter",
            f'http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} {c.ok}',
            f'http_requests_total{{handler="/v1/completions",method="POST",status="5xx"}} {c.failed}',
        ]
        return "\n".join(lines) + "\n"

    def _tgi(self) -> str:
        c = self.counts
        lines = [
            "# TYPE tgi_request_count counter",
            f"tgi_request_count {c.ok + c.failed}",
            "# TYPE tgi_request_success counter",
            f"tgi_request_success {c.ok}",
            "# TYPE tgi_request_failure counter",
            f'tgi_request_failure{{err="backend"}} {c.failed}',
            "# TYPE tgi_queue_size gauge",
            "tgi_queue_size 0",
            *_histogram("tgi_request_duration", "", TGI_DURATION_BUCKETS, c.latencies),
        ]
        return "\n".join(lines) + "\n"


def _histogram(name: str, labels: str, bounds: tuple[float, ...], values: list[float]) -> list[str]:
    sep = "," if labels else ""
    lines = [f"# TYPE {name} histogram"]
    for bound in bounds:
        lines.append(f'{name}_bucket{{{labels}{sep}le="{bound:g}"}} {sum(1 for v in values if v <= bound)}')
    lines.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {len(values)}')
    braces = f"{{{labels}}}" if labels else ""
    lines.append(f"{name}_sum{braces} {sum(values)}")
    lines.append(f"{name}_count{braces} {len(values)}")
    return lines


async def main(args: argparse.Namespace) -> None:
    server = Server(args)
    server.reload()
    app = web.Application()
    route = "/generate" if args.flavour == "tgi" else "/v1/completions"
    app.add_routes(
        [
            web.post(route, server.infer),
            web.post("/reload", server.reload_route),
            web.get("/reloads", server.reloads_route),
            web.get("/health", server.health),
            web.get("/metrics", server.metrics),
        ]
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = runner.addresses[0][1]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    _announce(args, port)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _announce(args: argparse.Namespace, port: int) -> None:
    """Write the pidfile, then the port file (renamed into place: a reader never sees half of it)."""
    if args.pidfile:
        Path(args.pidfile).write_text(str(os.getpid()))
    staging = Path(args.port_file + ".tmp")
    staging.write_text(str(port))
    staging.rename(args.port_file)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The stand-in's command line."""
    parser = argparse.ArgumentParser(prog="external_server")
    parser.add_argument("--model", required=True, help="the path to read weights from (a deployment's current link)")
    parser.add_argument("--flavour", choices=("vllm", "tgi"), default="vllm")
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--served-model-name-is-digest", action="store_true")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--pidfile", default="")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds each request takes (a slow canary)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))


class ExternalServerProcess:
    """The stand-in as a process under test: ``start()``, then ``ask()`` what it answers."""

    def __init__(self, workdir: Path, model: Path, *extra: str, flavour: str = "vllm") -> None:
        self.workdir = workdir
        self.model = model
        self.flavour = flavour
        self.extra = list(extra)
        self.pidfile = workdir / "server.pid"
        self.port_file = workdir / "port"
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.port = 0

    def start(self, within: float = 30.0) -> ExternalServerProcess:
        """Launch it and wait until it listens."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "tests.agent.external_server", "--model", str(self.model),
            "--flavour", self.flavour, "--port-file", str(self.port_file), "--pidfile", str(self.pidfile),
            *self.extra,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.port = int(str(poll_until(self._port, within, "the stand-in model server to listen")))
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def _port(self) -> str | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"stand-in server exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
        return self.port_file.read_text() if self.port_file.exists() else None

    def ask(self) -> tuple[int, dict[str, object]]:
        """One inference request: (status, JSON body)."""
        route = "/generate" if self.flavour == "tgi" else "/v1/completions"
        response = httpx.post(self.url + route, json={"prompt": "hello", "inputs": "hello"}, timeout=10)
        return response.status_code, response.json()

    def answer(self) -> str | None:
        """What it answers now (``None`` while it errors or holds no model)."""
        status, body = self.ask()
        if status != 200:
            return None
        if self.flavour == "tgi":
            return str(body["generated_text"])
        return str(body["choices"][0]["text"])  # type: ignore[index]

    def reloads(self) -> list[dict[str, object]]:
        """The ``http`` hook bodies it received."""
        return list(httpx.get(self.url + "/reloads", timeout=10).json())

    def stop(self) -> None:
        """SIGTERM and wait."""
        terminate(self.proc)
