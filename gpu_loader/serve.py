"""``weightship-serve``: the reference model server.

::

    weightship-serve --agent http://127.0.0.1:7070 --deployment chat --device cuda:0
    weightship-serve --version-dir /var/lib/weightship/versions/<hex> --device cpu

With ``--agent`` the server asks the agent's local API what to serve for the deployment, loads it
through ``gpu_loader`` and validates it, then long-polls for the next pointer epoch. On a switch
it loads and validates the new version while the old one keeps answering, swaps atomically, and
frees the old model once its last request is done, so no request fails during a swap. A version
that fails to load or validate is reported to the agent (``ValidationReport``) and not served;
the previous one stays. ``--version-dir`` serves one version without an agent and exits with
status 1 if it fails.

``--digest sha256:...`` (or ``WEIGHTSHIP_DIGEST``, as the Kubernetes operator sets it in every pod
of a version's ReplicaSet; ``WEIGHTSHIP_DEPLOYMENT`` likewise gives ``--deployment``) pins the
server to that one version: it asks the agent for it by digest, which makes the agent stage it
when the deployment's pointer names it, waits (not ready; ``/readyz`` and ``/v1/status`` say
which digest it waits for and where the node stands with it) until the node holds it verified,
loads it once and serves it for as long as it runs. It never follows the pointer and never
swaps. A version the node is still fetching is loaded while it is fetched (``gpu_loader.streamfeed``):
each tensor as soon as the agent has verified every chunk it spans, so the first answer comes once
the last tensor is in, not after the fetch *and then* a full load; ``/v1/status`` shows the load's
progress under ``loading``. ``--no-stream`` (or ``WEIGHTSHIP_STREAM=0``) waits for the whole
version instead. It holds a lease on the version (renewed every third of ``--lease-seconds``, dropped at a
clean stop), so the agent never evicts a version while this server serves it.

HTTP:

``POST /v1/completions``  OpenAI-style greedy completions (causal LMs; ``api`` has the fields).
``POST /v1/embeddings``   OpenAI-style embeddings (embedding and encoder models).
``POST /v1/generate``  ``{"input_ids": [[int, ...], ...], "max_new_tokens": 1}`` ->
    ``{"digest", "epoch", "output_ids"}`` (greedy, causal LMs); 503 until a version is ready.
    Every answer from a model carries ``X-Weightship-Digest``: the version that computed it.
``GET /v1/status``     what is served, load statistics and validation checks.
``GET /healthz``       the process is up.  ``GET /readyz``  200 only while a validated version serves.
``GET /metrics``       Prometheus metrics (``metrics.ServeMetrics``).

With ``--agent`` the server also pushes its cumulative counters per version (requests, errors,
latency histogram, queue depth, load failures, validation results: ``metrics.VersionTallies``) to
the agent every ``--metrics-push-seconds`` (``POST /local/v1/serve-metrics``). Pushing, not
being scraped, keeps the agent free of any list of servers; counters are cumulative, so a lost
push loses nothing but freshness.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from aiohttp import web

from gpu_loader import api
from gpu_loader.agent_api import LocalAgent, validation_report
from gpu_loader.inference import complete, decode, embed, encode
from gpu_loader.loader import Loader, LoadOptions, VerifyMode
from gpu_loader.metrics import ServeMetrics, VersionTallies
from gpu_loader.serving import ModelSlot, Prepared, ServedModel, generate_tokens, prepare
from gpu_loader.streamfeed import ChunkStream
from gpu_loader.streaming import StreamingLoader, StreamingSession, StreamProgress
from gpu_loader.validation import TensorStats
from weightship.backoff import DelaySequence
from weightship.errors import WeightshipError
from weightship.logs import event
from weightship.problems import PROBLEM_MEDIA_TYPE, problem_document

__all__ = ["ServeConfig", "Server", "main"]

_log = logging.getLogger("gpu_loader.serve")
_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_BATCH = 32
MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class ServeConfig:
    """Command-line settings."""

    deployment: str
    agent: str | None
    version_dir: Path | None
    host: str = "127.0.0.1"
    port: int = 8000
    port_file: Path | None = None
    device: str = "cpu"
    dtype: torch.dtype | None = None
    verify: VerifyMode = "fast"
    workers: int = 2
    poll_seconds: float = 30.0
    checksum_dir: Path | None = None
    metrics_push_seconds: float = 5.0
    #: serve exactly this version (pinned mode), never what the deployment's pointer says
    digest: str | None = None
    #: pinned mode: how long the agent keeps the version for this server without a renewal
    lease_seconds: float = 30.0
    #: pinned mode: load a version the node still fetches as its chunks are verified
    stream: bool = True


def _problem(request: web.Request, status: int, code: str, detail: str) -> web.Response:
    """An error answer as RFC 9457 problem details with our stable ``code``, as every weightship server gives."""
    body = json.dumps(problem_document(status, code, detail, request.path))
    return web.Response(text=body, status=status, content_type=PROBLEM_MEDIA_TYPE)


_BadRequest = api.BadRequest
_Body = TypeVar("_Body")
DIGEST_HEADER = "X-Weightship-Digest"
_KINDS = {"causal-lm": "a causal LM", "embedding": "an embedding model"}


class Server:
    """The HTTP server, the served-model slot and the agent follower."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics = ServeMetrics()
        self.tallies = VersionTallies()
        #: names this process in its pushes: a new instance is a counter reset for the agent
        self.instance = uuid.uuid4().hex
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self.slot = ModelSlot()
        self.loader = Loader(LoadOptions(checksum_dir=config.checksum_dir))
        self._infer = ThreadPoolExecutor(max(1, config.workers), thread_name_prefix="ws-infer")
        self._load = ThreadPoolExecutor(1, thread_name_prefix="ws-load")
        self.last_failure: Prepared | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        #: pinned mode, until the version is loaded: what the server waits for and where the node stands
        self.waiting_for: dict[str, Any] | None = (
            {"digest": config.digest, "deployment": config.deployment, "agent": config.agent, "state": "starting"}
            if config.digest is not None
            else None
        )
        #: pinned mode, while a streaming load runs: its progress
        self.loading: StreamProgress | None = None

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_post("/v1/generate", self._generate)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        return app

    # --- HTTP handlers -------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.Response:
        return await self._answer(request, _parse_generate, _run_generate, task="causal-lm")

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._answer(request, api.parse_completion, _run_completion, task="causal-lm")

    async def _embeddings(self, request: web.Request) -> web.Response:
        return await self._answer(request, api.parse_embedding, _run_embedding, task="embedding")

    async def _answer(
        self,
        request: web.Request,
        parse: Callable[[bytes], _Body],
        compute: Callable[[ServedModel, _Body], dict[str, Any]],
        *,
        task: str,
    ) -> web.Response:
        """Parse, check the task, compute in an inference thread; count the answer for its version."""
        started = time.perf_counter()
        code = 200
        answered_by: str | None = None
        try:
            parsed = parse(await request.read())
            served = self.slot.acquire()
            if served is None:
                code = 503
                return _problem(request, 503, "not_ready", "no validated version is loaded yet; see /readyz")
            answered_by = served.digest
            try:
                if served.card.task != task:
                    route = "/v1/completions" if served.card.task == "causal-lm" else "/v1/embeddings"
                    raise _BadRequest(
                        f"{request.path} needs {_KINDS[task]}, but {served.card.name} ({served.digest}) is "
                        f"{served.card.architecture}, {_KINDS[served.card.task]}: use {route}"
                    )
                self.metrics.queue_depth.inc()
                with self._waiting_lock:
                    self._waiting += 1
                loop = asyncio.get_running_loop()
                body = await loop.run_in_executor(self._infer, self._compute, served, partial(compute, served, parsed))
            finally:
                self.slot.release(served)
            return web.json_response(body, headers={DIGEST_HEADER: served.digest})
        except _BadRequest as exc:
            code = 400
            response = _problem(request, 400, "invalid_request", str(exc))
            if answered_by is not None:
                response.headers[DIGEST_HEADER] = answered_by
            return response
        except Exception as exc:
            code = 500
            self.metrics.errors.inc()
            event(_log, "serve.request_failed", logging.ERROR, error=repr(exc))
            return _problem(request, 500, "internal", f"the model server failed this request: {exc!r}")
        finally:
            seconds = time.perf_counter() - started
            self.metrics.requests.labels(code=str(code)).inc()
            self.metrics.latency.observe(seconds)
            if answered_by is not None:
                self.tallies.request(answered_by, failed=code >= 500, seconds=seconds)

    def _compute(self, served: ServedModel, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        self.metrics.queue_depth.dec()
        with self._waiting_lock:  # a worker thread, while the event loop adds
            self._waiting -= 1
        self.metrics.inflight.inc()
        try:
            assert served.model is not None, "a model in use is never dropped"
            return compute()
        finally:
            self.metrics.inflight.dec()

    async def _status(self, request: web.Request) -> web.Response:
        served = self.slot.current
        body: dict[str, Any] = {
            "deployment": self.config.deployment,
            "ready": served is not None,
            "serving": None,
            "pinned": self.config.digest,
            "waiting_for": self.waiting_for,
        }
        progress = self.loading
        if progress is not None:
            body["loading"] = {
                "streaming": True,
                "tensors_loaded": progress.tensors_loaded,
                "tensors_total": progress.tensors_total,
                "bytes_loaded": progress.bytes_loaded,
                "bytes_total": progress.bytes_total,
                "first_tensor_ms": progress.first_tensor_ms,
            }
        if served is not None:
            body["serving"] = {
                "digest": served.digest,
                "epoch": served.epoch,
                "model": served.card.to_json(),
                "directory": str(served.directory),
                "load": {
                    "seconds": served.stats.seconds,
                    "gbps": served.stats.gbps,
                    "bytes_read": served.stats.bytes_read,
                    "verify": served.stats.verify,
                    "device": served.stats.device,
                },
                "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in served.outcome.checks],
                "tensor_stats": [
                    {
                        "name": s.name,
                        "dtype": s.dtype,
                        "shape": list(s.shape),
                        "mean": s.mean,
                        "std": s.std,
                        "absmax": s.absmax,
                    }
                    for s in served.outcome.stats
                ],
            }
        failure = self.last_failure
        if failure is not None:
            body["last_failure"] = {
                "digest": failure.digest,
                "error": failure.error,
                "checks": [
                    {"name": c.name, "passed": c.passed, "detail": c.detail}
                    for c in (failure.outcome.checks if failure.outcome else [])
                ],
            }
        return web.json_response(body)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        served = self.slot.current
        if served is None:
            body: dict[str, Any] = {"ready": False}
            if self.config.digest is not None:
                body["pinned"] = self.config.digest
                body["waiting_for"] = self.waiting_for
                failure = self.last_failure
                if failure is not None:
                    failed = failure.outcome.failures() if failure.outcome is not None else []
                    body["refused"] = failure.error or "; ".join(f"{c.name}: {c.detail}" for c in failed)
            return web.json_response(body, status=503)
        return web.json_response({"ready": True, "digest": served.digest, "epoch": served.epoch})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    # --- loading and swapping ------------------------------------------------------------------

    async def install(
        self,
        directory: Path,
        digest: str | None,
        epoch: int,
        loader: Loader | None = None,
        known: Mapping[str, TensorStats] | None = None,
    ) -> Prepared:
        """Load and validate a version (in a worker thread) and, if it passes, swap it in."""
        event(_log, "serve.loading", logging.INFO, digest=digest or "-", epoch=epoch, directory=directory)
        loop = asyncio.get_running_loop()
        c = self.config
        use = loader or self.loader
        prepared = await loop.run_in_executor(
            self._load,
            lambda: prepare(
                use, directory, digest=digest, epoch=epoch, device=c.device, dtype=c.dtype, verify=c.verify, known=known
            ),
        )
        if prepared.stats is not None:
            self.metrics.load_seconds.labels(digest=prepared.digest).set(prepared.stats.seconds)
            self.metrics.load_gbps.labels(digest=prepared.digest).set(prepared.stats.gbps)
        self.metrics.validation.labels(digest=prepared.digest).set(1 if prepared.passed else 0)
        self.tallies.loaded(
            prepared.digest,
            load_failed=prepared.error is not None,
            validation_passed=None if prepared.outcome is None else prepared.outcome.passed,
        )
        if prepared.served is None:
            self.last_failure = prepared
            event(
                _log,
                "serve.version_refused",
                logging.WARNING,
                digest=prepared.digest,
                epoch=epoch,
                error=prepared.error or "-",
                failed=",".join(c.name for c in prepared.outcome.failures()) if prepared.outcome else "load",
            )
            return prepared
        old = self.slot.swap(prepared.served)
        self.metrics.ready.set(1)
        self.metrics.version.labels(digest=prepared.digest, epoch=str(epoch)).set(1)
        if old is not None:
            self.metrics.swaps.inc()
            with contextlib.suppress(KeyError):
                self.metrics.version.remove(old.digest, str(old.epoch))
            task = asyncio.create_task(self._retire(old))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        event(
            _log,
            "serve.serving",
            logging.INFO,
            digest=prepared.digest,
            epoch=epoch,
            load_seconds=prepared.served.stats.seconds,
            gbps=prepared.served.stats.gbps,
        )
        return prepared

    async def _retire(self, old: ServedModel) -> None:
        drained = await asyncio.to_thread(old.drained.wait, 300.0)
        old.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        event(_log, "serve.retired", logging.INFO, digest=old.digest, drained=drained)

    async def follow(self, agent: LocalAgent) -> None:
        """Serve what the agent says, forever: long-poll each epoch after the one applied.

        ``wait`` with ``after_epoch=0`` doubles as "wait until the deployment has a version".
        """
        name = self.config.deployment
        epoch = 0
        backoff = DelaySequence(initial=0.5, maximum=10.0)
        while True:
            try:
                waited = await agent.wait(name, epoch, self.config.poll_seconds)
                backoff.reset()
            except WeightshipError as exc:
                delay = backoff.next_delay()
                event(
                    _log,
                    "serve.agent_unavailable",
                    logging.WARNING,
                    agent=agent.address,
                    error=exc.message,
                    retry_in=f"{delay:.2f}",
                )
                await asyncio.sleep(delay)
                continue
            if waited is None:
                continue
            deployment = waited
            if deployment.epoch <= epoch:
                continue  # not newer than the pointer already applied: ignore it
            if deployment.digest is None or deployment.path is None or not deployment.ready:
                # The agent answers a wait only once the version is ready; be patient if not.
                event(_log, "serve.nothing_to_load", logging.INFO, epoch=deployment.epoch, ready=deployment.ready)
                await asyncio.sleep(1.0)
                continue
            epoch = deployment.epoch
            current = self.slot.current
            if current is not None and current.digest == deployment.digest:
                with contextlib.suppress(KeyError):
                    self.metrics.version.remove(current.digest, str(current.epoch))
                current.epoch = epoch
                self.metrics.version.labels(digest=current.digest, epoch=str(epoch)).set(1)
                continue
            prepared = await self.install(Path(deployment.path), deployment.digest, epoch)
            report = validation_report(
                name, deployment.digest, outcome=prepared.outcome, stats=prepared.stats, error=prepared.error
            )
            try:
                await agent.report(report)
            except WeightshipError as exc:
                event(_log, "serve.report_failed", logging.WARNING, digest=deployment.digest, error=exc.message)

    async def pinned(self, agent: LocalAgent) -> None:
        """Serve exactly ``config.digest``, forever: wait until the node holds it verified, load it once.

        Every step renews the lease (``PUT /local/v1/leases/{instance}``), which is also the ask that
        makes the agent stage the version; while it is not ready the server long-polls it.
        """
        digest, name, lease = self.config.digest, self.config.deployment, self.config.lease_seconds
        assert digest is not None
        backoff = DelaySequence(initial=0.5, maximum=10.0)
        loaded = False
        while True:
            try:
                view = await agent.lease(self.instance, name, digest, lease)
                if not loaded and view.path is None and not self.config.stream:
                    self._wait_state(view.state.value, view.reason, view.bytes_present, view.bytes_total)
                    view = await agent.wait_version(digest, name, max(1.0, min(self.config.poll_seconds, lease / 3)))
                backoff.reset()
            except WeightshipError as exc:
                delay = backoff.next_delay()
                event(_log, "serve.agent_unavailable", logging.WARNING, agent=agent.address, error=exc.message,
                      retry_in=f"{delay:.2f}")  # fmt: skip
                if not loaded:
                    self._wait_state("agent_unavailable", exc.message, 0, 0)
                await asyncio.sleep(delay)
                continue
            if loaded:
                await asyncio.sleep(lease / 3)  # ok-sleep: the lease's renewal period
                continue
            if view.path is None:
                self._wait_state(view.state.value, view.reason, view.bytes_present, view.bytes_total)
                if not self.config.stream:
                    continue
                prepared_or_none = await self._install_streamed(agent, digest, name)
                if prepared_or_none is None:
                    continue  # not fetched yet (renew the lease, ask again), or installed meanwhile
                loaded = True
                prepared = prepared_or_none
            else:
                loaded = True
                self.waiting_for = None
                prepared = await self.install(Path(view.path), digest, 0)
            report = validation_report(
                name, digest, outcome=prepared.outcome, stats=prepared.stats, error=prepared.error
            )
            try:
                await agent.report(report)
            except WeightshipError as exc:
                event(_log, "serve.report_failed", logging.WARNING, digest=digest, error=exc.message)

    async def _install_streamed(self, agent: LocalAgent, digest: str, name: str) -> Prepared | None:
        """Load ``digest`` while the agent fetches it (``gpu_loader.streamfeed``); ``None`` if it got installed first.

        Until the last tensor is loaded the server stays not ready; the feed's view of the fetch
        (fetching, failed and retried, the agent unreachable) shows in ``waiting_for``.
        """
        stream = ChunkStream(
            agent, digest, name, poll=max(1.0, min(self.config.poll_seconds, 10.0)),
            on_state=lambda state, reason: self._wait_state(state, reason, 0, 0),
        )  # fmt: skip
        try:
            # Back to the caller now and then, so it renews its lease while the fetch has not begun.
            version = await asyncio.wait_for(stream.start(), max(1.0, self.config.lease_seconds / 3))
        except TimeoutError:
            return None
        if version is None:
            return None
        # The agent renames the staging directory into versions/ once the fetch ends, maybe in the middle
        # of this load (side files are read again by validation, after the last tensor). A descriptor of
        # the directory follows it through the rename: the load names it through /proc/self/fd.
        try:
            dirfd = os.open(version.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None  # installed already: load it as usual
        follower = asyncio.create_task(stream.run())

        def attach(session: StreamingSession) -> None:
            self.loading = session.progress
            stream.attach(session)

        try:
            through = Path(f"/proc/self/fd/{dirfd}")
            loader = StreamingLoader(self.loader, attach, scan=True)
            prepared = await self.install(through, digest, 0, loader=loader, known=loader.stats)
            if prepared.served is not None:
                prepared.served.directory = Path(os.readlink(through))  # where it is now, for /v1/status
        finally:
            os.close(dirfd)
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            for session in stream.sessions:
                session.stream.fail(RuntimeError("the streaming load was stopped"))
        self.waiting_for = None
        return prepared

    def _wait_state(self, state: str, reason: str, present: int, total: int) -> None:
        """Pinned mode: record (and log, when it changed) where the node stands with the version."""
        previous = self.waiting_for or {}
        self.waiting_for = {
            "digest": self.config.digest,
            "deployment": self.config.deployment,
            "agent": self.config.agent,
            "state": state,
            "reason": reason,
            "bytes_present": present,
            "bytes_total": total,
        }
        if (previous.get("state"), previous.get("reason")) != (state, reason):
            event(_log, "serve.waiting_for_version", logging.INFO, digest=self.config.digest,
                  deployment=self.config.deployment, state=state, reason=reason or "-")  # fmt: skip

    async def push_metrics(self, agent: LocalAgent) -> None:
        """Push the per-version counters to the agent every ``metrics_push_seconds``, forever."""
        failing = False
        while True:
            await asyncio.sleep(self.config.metrics_push_seconds)  # ok-sleep: the push period itself
            current = self.slot.current
            report = self.tallies.report(
                self.config.deployment,
                self.instance,
                serving=current.digest if current is not None else None,
                queue_depth=self._waiting,
            )
            if not report.versions:
                continue
            try:
                await agent.push_metrics(report)
            except WeightshipError as exc:
                if not failing:  # counters are cumulative: the next push catches up; say it once
                    event(_log, "serve.metrics_push_failed", logging.WARNING, agent=agent.address, error=exc.message)
                failing = True
                continue
            failing = False

    async def close(self) -> None:
        """Stop workers and free the loader's pinned memory."""
        for task in list(self._retiring):
            task.cancel()
        self._infer.shutdown(wait=True)
        self._load.shutdown(wait=True)
        self.loader.close()


def _parse_generate(raw: bytes) -> tuple[list[list[int]], int]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise _BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object")
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        ids = [ids]
    if (
        not isinstance(ids, list)
        or not ids
        or len(ids) > MAX_BATCH
        or not all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in ids
        )
        or len({len(p) for p in ids}) != 1
    ):
        raise _BadRequest(f"input_ids must be 1 to {MAX_BATCH} non-empty lists of token ids, all of the same length")
    new_tokens = body.get("max_new_tokens", 1)
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or not 0 <= new_tokens <= MAX_NEW_TOKENS:
        raise _BadRequest(f"max_new_tokens must be an integer from 0 to {MAX_NEW_TOKENS}")
    return ids, new_tokens


def _run_generate(served: ServedModel, request: tuple[list[list[int]], int]) -> dict[str, Any]:
    prompts, new_tokens = request
    assert served.model is not None
    _check_vocab(served, prompts, new_tokens)
    output = generate_tokens(served.model.logits_module, prompts, new_tokens)
    return {"digest": served.digest, "epoch": served.epoch, "output_ids": output}


def _run_completion(served: ServedModel, request: api.CompletionRequest) -> dict[str, Any]:
    built = served.model
    assert built is not None
    prompts = request.token_ids
    if prompts is None:
        prompts = encode(built, _texts(served, request.texts), for_embedding=False)
    _check_vocab(served, prompts, request.max_tokens)
    done = complete(built, prompts, request.max_tokens)
    text = built.tokenizer is not None
    choices = [(c.token_ids, decode(built, c.token_ids) if text else None, c.finish_reason) for c in done]
    return api.completion_body(
        model=served.card.name, digest=served.digest, epoch=served.epoch, prompt_tokens=prompts, choices=choices
    )


def _run_embedding(served: ServedModel, request: api.EmbeddingRequest) -> dict[str, Any]:
    built = served.model
    assert built is not None
    inputs = request.token_ids
    if inputs is None:
        inputs = encode(built, _texts(served, request.texts), for_embedding=True)
    _check_vocab(served, inputs, 0)
    vectors: list[list[float]] = embed(built, inputs).tolist()
    return api.embedding_body(
        model=served.card.name, digest=served.digest, epoch=served.epoch, prompt_tokens=inputs, vectors=vectors
    )


def _check_vocab(served: ServedModel, prompts: list[list[int]], new_tokens: int) -> None:
    card = served.card
    if card.vocab_size and any(not 0 <= t < card.vocab_size for p in prompts for t in p):
        raise _BadRequest(f"token ids must be in [0, {card.vocab_size})")
    longest = max(len(p) for p in prompts)
    if card.max_positions is not None and longest + new_tokens > card.max_positions:
        raise _BadRequest(f"prompt plus new tokens exceed {card.max_positions} positions")


def _texts(served: ServedModel, texts: list[str] | None) -> list[str]:
    """Text inputs, refused with a clear 400 when the version ships no tokenizer."""
    assert texts is not None
    if not served.card.has_tokenizer:
        raise _BadRequest(
            f"{served.card.name} ({served.digest}) ships no tokenizer: send token ids instead of text, "
            "or publish the version with its tokenizer files (tokenizer.json)"
        )
    return texts


async def _run(config: ServeConfig) -> int:
    server = Server(config)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else config.port
    event(_log, "serve.listening", logging.INFO, host=config.host, port=port, deployment=config.deployment)
    if config.port_file is not None:
        config.port_file.write_text(str(port), encoding="utf-8")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent: LocalAgent | None = None
    follower: asyncio.Task[None] | None = None
    pusher: asyncio.Task[None] | None = None
    try:
        if config.version_dir is not None:
            prepared = await server.install(config.version_dir, None, 0)
            if not prepared.passed:
                checks = prepared.outcome.failures() if prepared.outcome is not None else []
                failed = prepared.error or "; ".join(f"{c.name}: {c.detail}" for c in checks)
                print(f"weightship-serve: {config.version_dir} failed to load or validate: {failed}", file=sys.stderr)
                return 1
        else:
            assert config.agent is not None
            agent = LocalAgent(config.agent)
            follower = asyncio.create_task(server.pinned(agent) if config.digest else server.follow(agent))
            pusher = asyncio.create_task(server.push_metrics(agent))
        await stop.wait()
    finally:
        if pusher is not None:
            pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pusher
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        if agent is not None:
            if config.digest is not None:
                with contextlib.suppress(WeightshipError):  # else the lease lapses by itself
                    await agent.release(server.instance)
            await agent.aclose()
        await runner.cleanup()
        await server.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``weightship-serve``."""
    parser = argparse.ArgumentParser(
        prog="weightship-serve", description="Reference model server for weightship versions."
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--agent",
        default=os.environ.get("WEIGHTSHIP_AGENT_URL") or None,
        help="agent local API: http://127.0.0.1:PORT or unix:/path/agent.sock (default: $WEIGHTSHIP_AGENT_URL)",
    )
    source.add_argument("--version-dir", type=Path, help="serve this version directory, without an agent")
    parser.add_argument(
        "--deployment",
        default=os.environ.get("WEIGHTSHIP_DEPLOYMENT") or "default",
        help="deployment name to ask the agent about (default: $WEIGHTSHIP_DEPLOYMENT, else 'default')",
    )
    parser.add_argument(
        "--digest",
        default=os.environ.get("WEIGHTSHIP_DIGEST") or None,
        help="serve exactly this version (sha256:...), never what the pointer says (default: $WEIGHTSHIP_DIGEST)",
    )
    parser.add_argument(
        "--lease-seconds", type=float, default=30.0, help="with --digest: how long the agent holds it without renewal"
    )
    parser.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="with --digest: wait until the node holds the whole version before loading (default: load while it is "
        "fetched; also WEIGHTSHIP_STREAM=0)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --port-file)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="auto", help="cast weights (auto: as stored)")
    parser.add_argument("--verify", choices=("full", "fast", "trust"), default="fast")
    parser.add_argument("--workers", type=int, default=2, help="inference threads")
    parser.add_argument("--poll-seconds", type=float, default=30.0, help="long-poll timeout towards the agent")
    parser.add_argument("--checksum-dir", type=Path, help="where verify=fast keeps its CRC32 records")
    parser.add_argument(
        "--metrics-push-seconds", type=float, default=5.0, help="how often to push per-version counters to the agent"
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.version_dir is not None:
        args.agent = None  # an explicit --version-dir wins over $WEIGHTSHIP_AGENT_URL
    elif args.agent is None:
        parser.error("one of --agent (or $WEIGHTSHIP_AGENT_URL) or --version-dir is required")
    if args.digest is not None and (args.version_dir is not None or not re.fullmatch(r"sha256:[0-9a-f]{64}", args.digest)):
        parser.error(
            f"--digest {args.digest!r}: give a version digest, sha256:<64 hex digits>, together with --agent"
            if args.version_dir is None
            else "--digest pins a version served through the agent; drop it with --version-dir"
        )
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per long-poll is noise
    config = ServeConfig(
        deployment=args.deployment,
        agent=args.agent,
        version_dir=args.version_dir,
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        device=args.device,
        dtype=_DTYPES[args.dtype],
        verify=args.verify,
        workers=args.workers,
        poll_seconds=args.poll_seconds,
        checksum_dir=args.checksum_dir,
        metrics_push_seconds=max(0.1, args.metrics_push_seconds),
        digest=args.digest,
        lease_seconds=min(3600.0, max(3.0, args.lease_seconds)),
        stream=args.stream and os.environ.get("WEIGHTSHIP_STREAM", "1") != "0",
    )
    return asyncio.run(_run(config))


if __name__ == "__main__":
    sys.exit(main())
