"""The agent process: wiring, and the loops that talk to the control plane.

Start-up order: recover the store (check every version on disk, empty the trash), repair
``current`` links from the epoch book, open the local API (model servers are served from disk
at once, control plane or not), then register with the node's own token (enrolling first with the
configured enrolment token when it has none, see ``agent.identity``) and run, concurrently:

- the desired-state long-poll: ``GET /v1/nodes/{id}/desired?after=REV&wait=S``; each new
  revision goes to the reconciler, so a pointer change reaches the node as soon as the control
  plane commits it;
- heartbeats: every ``heartbeat_interval`` and right after anything changes (a switch, a fetch
  finishing or failing, a refusal, a validation report);
- the reconciler (fetches and switches);
- with a signing policy, a look at its file every ``POLICY_CHECK_SECONDS``: a changed policy takes
  effect without a restart (``agent.signatures``).

**Deployments followed**: those configured (``--deployment``) plus those that local model servers
name when they ask for a version by digest (``agent.pins``): an empty ``--deployment`` list means
"stage what this node's model servers ask for". When that set changes the agent registers again
(same node, new list) and reads its desired state afresh.

If the control plane is unreachable the node keeps serving what it serves; both control-plane
loops retry with capped, jittered exponential backoff and log ``controlplane.unreachable`` with
the delay. A control plane that no longer knows the node (404) or its token (401: revoked, or a
restored database) gets a fresh registration, which enrols again when the token is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from agent.assemble import Assembler
from agent.cache import ReadThroughCache
from agent.chunkfeed import ChunkFeeds
from agent.chunkorder import chunk_order
from agent.chunkstore import ChunkStore
from agent.config import AgentConfig
from agent.controlplane_client import ControlPlaneClient
from agent.counters import Counters
from agent.durability import Flusher
from agent.durable import atomic_write
from agent.epochs import EpochBook
from agent.fetcher import Fetcher
from agent.identity import CREDENTIAL_FILE, NodeCredential, load_credential, new_credential, save_credential
from agent.localapi import LocalAPI
from agent.metricsserver import MetricsServer
from agent.peerserver import ChunkLocator, PeerServer, VersionChunks
from agent.pins import Pins
from agent.rangeclient import RangeClient
from agent.reconcile import Reconciler
from agent.retention import Retention
from agent.servemetrics import ServeMetricsBook
from agent.serving import Serving
from agent.signatures import load_gate
from agent.sources import Sources
from agent.store import VersionStore
from agent.switchhooks import SwitchHooks
from agent.tickets import TicketKeeper
from agent.tracker import Tracker, TrackerSettings
from agent.tracker_api import TrackerRoutes
from weightship.addresses import parse_networks
from weightship.backoff import DelaySequence
from weightship.errors import AuthError, ConflictError, ForbiddenError, NotFoundError, WeightshipError
from weightship.logs import event
from weightship.manifest import Manifest
from weightship.schemas import (
    DeploymentState,
    NodeCounters,
    NodeEnrolRequest,
    NodeHealth,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistration,
    SourceTally,
    ValidationReport,
)

__all__ = ["Agent"]

log = logging.getLogger("agent.daemon")

#: coalesce bursts of changes into one heartbeat
HEARTBEAT_DEBOUNCE = 0.05
#: validation reports held while the control plane is unreachable
MAX_PENDING_REPORTS = 256
#: shortest time between two desired-state requests that came back unchanged
MIN_POLL_SECONDS = 0.5
#: how often lapsed pins (a model server that died) are looked for
PIN_CHECK_SECONDS = 2.0
#: how often the signing policy file is looked at (one ``stat``): a change takes effect within this
POLICY_CHECK_SECONDS = 5.0


class _Reregister(Exception):
    """The control plane forgot this node or refused its token; register again."""


class _Refollow(Exception):
    """The deployments this node follows changed (a local server asked for another); register again."""


class Agent:
    """One node agent."""

    def __init__(self, config: AgentConfig, controlplane: ControlPlaneClient | None = None) -> None:
        self.config = config
        self.executor = ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) + 2), thread_name_prefix="ws-agent")
        # Small state files (epochs, links, LRU record, runtime file) get a pool of their own, so a
        # switch or a heartbeat never queues behind chunk writes filling the main pool.
        self.state_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ws-state")
        self.store = VersionStore(config.data_dir)
        self.book = EpochBook(self.store.state_dir / "deployments.json")
        self.counters = Counters()
        self.serve_metrics = ServeMetricsBook()
        self.serving = Serving(self.store, self.book)
        self.pins = Pins(self.store.state_dir / "pins.json")
        self._refollow = asyncio.Event()
        self._followed: tuple[str, ...] = ()
        self._pin_view: object = None
        self.controlplane = controlplane or ControlPlaneClient(config.control_plane, config.token)
        self.node_id: str | None = None
        self.local_api_url = ""
        self._reports: list[ValidationReport] = []
        self._usage = 0
        self._changed = asyncio.Event()
        #: the loop ``run`` runs on (worker threads hand it work)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.blob_client = RangeClient(max_idle=max(16, config.concurrency * 2))
        self.sources = self._sources()
        fetcher = Fetcher(
            self.blob_client,
            self.controlplane,
            self.counters,
            self.executor,
            concurrency=config.concurrency,
            memory_bytes=config.memory_bytes,
            attempts=config.chunk_attempts,
            backoff_initial=config.backoff_initial,
            backoff_max=config.backoff_max,
            sources=self.sources,
        )
        self.retention = Retention(self.store, config.quota_bytes, config.min_free_bytes)
        self.flusher = Flusher(config.sync_delay)
        assembler = Assembler(
            self.store,
            self.retention,
            fetcher,
            self.controlplane,
            self.counters,
            self.executor,
            lambda: self.reconciler.protected(),  # the reconciler is created just below
            on_trouble=self._changed.set,
            on_placed=self.serving.poke,
            gate=load_gate(self.config.signing_policy, self.controlplane),
            flusher=self.flusher,
        )
        self.assembler = assembler
        self.chunk_feeds = ChunkFeeds(assembler.staging, self.store)
        fetcher.streamed = self.chunk_feeds.streaming
        self.retention.on_evicted = self._evicted(assembler)
        self.switch_hooks = SwitchHooks(
            {h.deployment: h for h in config.switch_hooks},
            self.store,
            self.book,
            self.state_executor,
            backoff_initial=max(config.backoff_initial, 0.1),
            on_change=self._changed.set,
        )
        self.reconciler = Reconciler(
            self.store,
            self.book,
            self.serving,
            assembler,
            self.retention,
            self.executor,
            state_executor=self.state_executor,
            prefetch=config.prefetch,
            backoff_initial=config.backoff_initial,
            backoff_max=config.backoff_max,
            pins=self.pins,
            on_change=self._reconciled,
        )
        self._peer_setup(assembler)

    def _reconciled(self) -> None:
        """A switch, a fetch ending, a refusal...: heartbeat soon, and let the switch hooks look."""
        self._changed.set()
        self.switch_hooks.poke()

    def _evicted(self, assembler: Assembler) -> Callable[[str], None]:
        """What retention calls (in a worker thread) once it removed a version: stop serving and announcing it."""

        def evicted(digest: str) -> None:
            assembler.staging.pop(digest, None)  # one dict step: safe beside the event loop's reads
            if self.sources is not None and self.loop is not None:
                self.loop.call_soon_threadsafe(self.sources.forget, digest)

        return evicted

    def _sources(self) -> Sources | None:
        """Peers (via the tracker) and caches between local copies and the origin; None on a cache or with none set."""
        cfg = self.config
        if cfg.role == "cache" or not (cfg.tracker or cfg.cluster_cache or cfg.region_cache):
            return None
        return Sources(
            node=cfg.name,
            address="",  # the peer listener's, once it listens; a node without one does not announce
            labels=cfg.labels.model_dump(exclude_none=True),
            tickets=lambda versions, audience=None: self.tickets.ticket_for(versions, audience),
            tracker=cfg.tracker or cfg.cluster_cache,
            cluster_cache=cfg.cluster_cache,
            region_cache=cfg.region_cache,
            counters=self.counters.sources,
            upload_slots=cfg.upload_concurrency,
            concurrency=cfg.peer_concurrency,
            peer_min_rate=cfg.peer_min_rate,
            announce_interval=cfg.announce_interval,
            client=self.blob_client,
        )

    def _tracker_routes(self) -> TrackerRoutes | None:
        """The cluster's tracker, on a cluster cache."""
        cache = self.cache
        if cache is None or self.config.tier != "cluster":
            return None
        settings = TrackerSettings(fanout=self.config.tracker_fanout, upstream_slots=self.config.tracker_upstream_slots)

        async def manifest(version: str) -> Manifest:
            if version not in cache.manifests:
                await cache.refresh()
            if version not in cache.manifests:
                raise NotFoundError(f"version {version} is named by no serving pointer; the tracker does not track it")
            return cache.manifests[version]

        def cached(version: Manifest) -> list[int]:
            # A node asking what is available is about to fetch this version: read it ahead now.
            cache.start_read_ahead(version)
            return cache.held_indexes(version)

        networks = parse_networks(self.config.tracker_networks)
        return TrackerRoutes(Tracker(settings), self.tickets, manifest, cached, cache.store.holds, networks=networks)

    def _peer_setup(self, assembler: Assembler) -> None:
        """The peer listener (when configured; always on a cache), its tickets and, on a cache, the chunk cache."""
        cfg = self.config
        self.tickets = TicketKeeper(self.controlplane, me=cfg.name)
        self.cache: ReadThroughCache | None = None
        locator: ChunkLocator = VersionChunks(self.store.ready, self.store.path, assembler.staging)
        if cfg.role == "cache":
            self.cache = ReadThroughCache(
                ChunkStore(self.store.root / "chunks", cfg.cache_bytes),
                self.controlplane,
                self.tickets,
                self.executor,
                upstream=cfg.upstream,
                upstream_concurrency=cfg.upstream_concurrency,
                read_ahead=cfg.read_ahead,
                upstream_bandwidth=cfg.upstream_bandwidth,
                gate=assembler.gate,
            )
            locator = self.cache
        self.peer: PeerServer | None = None
        if cfg.peer_listener:
            tracker = self._tracker_routes()
            self.peer = PeerServer(
                locator,
                self.tickets,
                upload_concurrency=cfg.upload_concurrency,
                upload_bandwidth=cfg.upload_bandwidth,
                extra_routes=tracker.mount if tracker is not None else None,
                extra_metrics=self._extra_metrics,
            )
        self.peer_url = ""
        #: where ``--metrics-listen`` serves ``/metrics`` ("" when not set)
        self.metrics_url = ""

    def _extra_metrics(self) -> str:
        cache = self.cache.metrics() if self.cache is not None else ""
        return cache + self.counters.sources.metrics() + self.switch_hooks.metrics()

    def metrics_text(self) -> str:
        """Everything the agent exposes to Prometheus: the peer listener's counters when there is one, and its own."""
        return self.peer.metrics_text() if self.peer is not None else self._extra_metrics()

    # --- views ---------------------------------------------------------------------------------

    def heartbeat(self) -> NodeHeartbeat:
        """What the agent reports: inventory, what it serves, counters, health, reports, refusals."""
        total, free = self.store.disk_free()
        return NodeHeartbeat(
            inventory=self.reconciler.inventory(),
            deployments=[
                DeploymentState(
                    name=r.name, digest=r.digest, epoch=r.applied_epoch, hook=self.switch_hooks.result(r.name)
                )
                for r in self.book.records()
            ],
            counters=self._counters(),
            health=NodeHealth(
                disk_total=total,
                disk_free=free,
                quota_bytes=self.config.quota_bytes,
                used_bytes=self._usage,
                errors=self.reconciler.errors() + self.switch_hooks.errors() + self._policy_errors(),
            ),
            validation=list(self._reports),
            refused=self.reconciler.refused(),
            serve=self.serve_metrics.snapshot(),
        )

    def _policy_errors(self) -> list[str]:
        """The signing policy file's problem, while a rewrite of it cannot be read or parsed."""
        problem = self.assembler.gate.problem if self.assembler.gate is not None else None
        return [problem] if problem else []

    def _counters(self) -> NodeCounters:
        """The node's counters; a cache adds the bytes it read upstream for its children (its origin egress).

        Only bytes: the cache reads runs of chunks in one range read, so its read count is no chunk count.
        """
        counters = self.counters.snapshot()
        if self.cache is None:
            return counters
        sources = dict(counters.sources)
        stats = self.cache.stats
        for kind, source in (("origin", "origin"), ("upstream", "region_cache")):
            had = sources.get(source, SourceTally())
            sources[source] = had.model_copy(update={"bytes": had.bytes + stats.fetch_bytes.get(kind, 0)})
        return counters.model_copy(update={"sources": sources})

    def _report(self, report: ValidationReport) -> None:
        self._reports = [*self._reports, report][-MAX_PENDING_REPORTS:]
        self._changed.set()

    def followed(self) -> tuple[str, ...]:
        """The deployments this node follows: configured ones, then those local servers ask for."""
        asked = sorted(self.pins.deployments()) if self.config.role != "cache" else []
        return tuple(dict.fromkeys([*self.config.deployments, *asked]))

    def _pinned(self) -> None:
        """A local server asked for a version, leased one or released it (or a pin lapsed)."""
        view = (self.pins.digests(), self.pins.asked())
        if view != self._pin_view:  # a renewal changes nothing the reconciler acts on
            self._pin_view = view
            self.reconciler.wake()
        if self.followed() != self._followed:
            self._refollow.set()
        data = self.pins.to_save()
        if data is not None and self.loop is not None:
            self.loop.run_in_executor(self.state_executor, self.pins.save, data)

    async def _policy_loop(self) -> None:
        """Follow the signing policy file: on a change, retry what it refused and re-check what a cache holds."""
        gate = self.assembler.gate
        assert gate is not None
        problem = gate.problem
        while True:
            await asyncio.sleep(POLICY_CHECK_SECONDS)  # ok-sleep: the period of looking at the policy file
            if gate.reload():
                self.reconciler.wake()  # versions refused under the old policy are tried again at once
                if self.cache is not None:
                    self.cache.poke()
                self._changed.set()
            if gate.problem != problem:
                problem = gate.problem
                self._changed.set()  # the heartbeat's health errors say so, or stop saying so

    async def _pins_loop(self) -> None:
        while True:
            await asyncio.sleep(PIN_CHECK_SECONDS)  # ok-sleep: the period of looking for lapsed pins
            if self.pins.prune():
                self._pinned()

    # --- running -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set."""
        loop = self.loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, self.store.recover)
        await loop.run_in_executor(self.state_executor, self.pins.load)
        cfg = self.config
        api = LocalAPI(
            self.serving,
            self.heartbeat,
            self._report,
            self.serve_metrics.receive,
            versions=self.reconciler if cfg.role != "cache" else None,
            on_pinned=self._pinned,
            metrics=self.metrics_text,
            chunks=self.chunk_feeds if cfg.role != "cache" else None,
        )
        self.local_api_url = await api.start(cfg.local_api)
        metrics = MetricsServer(self.metrics_text) if cfg.metrics_listen else None
        if metrics is not None:
            self.metrics_url = await metrics.start(cfg.metrics_listen)
        if self.cache is not None:
            await loop.run_in_executor(self.executor, self.cache.store.recover)
        if self.peer is not None:
            listening = await self.peer.start(cfg.peer_listener)
            self.peer_url = cfg.peer_address or listening
        await self._write_runtime()
        event(
            log,
            "agent.started",
            name=cfg.name,
            control_plane=cfg.control_plane,
            data_dir=str(self.store.root),
            local_api=self.local_api_url,
            deployments=",".join(cfg.deployments),
            quota_bytes=cfg.quota_bytes,
        )
        tasks = [
            loop.create_task(self.reconciler.run(), name="reconcile"),
            loop.create_task(self._controlplane_session(), name="controlplane"),
            loop.create_task(self._pins_loop(), name="pins"),
        ]
        if self.cache is not None:
            tasks.append(loop.create_task(self.cache.run(), name="cache-refresh"))
        if cfg.switch_hooks:
            tasks.append(loop.create_task(self.switch_hooks.run(), name="switch-hooks"))
        if self.assembler.gate is not None:
            tasks.append(loop.create_task(self._policy_loop(), name="signing-policy"))
        if self.sources is not None:
            if self.peer_url:
                self.sources.address = self.peer_url
                for manifest in (await loop.run_in_executor(self.executor, self.store.ready)).values():
                    self.sources.holding(manifest, chunk_order(manifest))
            # Without a peer listener too: announcing what it fetched ends the node's upstream grants.
            tasks.append(loop.create_task(self.sources.announce_loop(), name="announce"))
        stopping = loop.create_task(stop.wait(), name="stop")
        crashed: BaseException | None = None
        try:
            done, _pending = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
            # The loops only end by being cancelled; anything else is a bug. Crash-only: exit and
            # let the supervisor restart the agent (everything on disk is crash-safe).
            for task in done - {stopping}:
                crashed = task.exception() or RuntimeError(f"{task.get_name()} loop ended")
                event(log, "agent.crashed", logging.CRITICAL, loop=task.get_name(), error=repr(crashed))
        finally:
            for task in [stopping, *tasks]:
                task.cancel()
            for task in [stopping, *tasks]:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await api.stop()
            if metrics is not None:
                await metrics.stop()
            if self.peer is not None:
                await self.peer.stop()
            if self.cache is not None:
                await self.cache.close()
            if self.sources is not None:
                await self.sources.close()
            await self.blob_client.close()
            await self.controlplane.aclose()
            self.flusher.close()  # a flush not yet run leaves its marker: the next start hashes that version
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.state_executor.shutdown(wait=False, cancel_futures=True)
            c = self.counters.snapshot()
            event(
                log,
                "agent.stopped",
                bytes_downloaded=c.bytes_downloaded,
                bytes_copied_locally=c.bytes_copied_locally,
                chunks_rejected=c.chunks_rejected,
            )
        if crashed is not None:
            raise crashed

    async def _write_runtime(self) -> None:
        doc = {
            "pid": os.getpid(),
            "name": self.config.name,
            "node_id": self.node_id,
            "local_api": self.local_api_url,
            "peer": self.peer_url,
            "metrics": self.metrics_url,
            "control_plane": self.config.control_plane,
            "data_dir": str(self.store.root),
        }
        data = json.dumps(doc, indent=1).encode()
        await self._state_io(atomic_write, self.store.root / "agent.json", data)

    async def _state_io(self, fn: Callable[..., object], *args: object) -> None:
        await asyncio.get_running_loop().run_in_executor(self.state_executor, fn, *args)

    async def _controlplane_session(self) -> None:
        while True:
            self.node_id = await self._register()
            await self._write_runtime()
            if self.peer is not None:
                await self.tickets.keys_until_known()
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._desired_loop(self.node_id))
                    group.create_task(self._heartbeat_loop(self.node_id))
                    group.create_task(self._follow_watch())
            except* _Reregister:
                event(log, "controlplane.node_unknown", logging.WARNING, node_id=self.node_id)
            except* _Refollow:
                event(log, "deployments.follow", node_id=self.node_id, deployments=",".join(self.followed()) or "none")

    async def _follow_watch(self) -> None:
        await self._refollow.wait()
        raise _Refollow()

    async def _register(self) -> str:
        cfg = self.config
        self._refollow.clear()
        self._followed = self.followed()
        body = NodeRegistration(
            name=cfg.name,
            labels=cfg.labels,
            role=cfg.role,
            address=self.peer_url or None,
            deployments=list(self._followed),
        )
        backoff = DelaySequence(cfg.backoff_initial, cfg.backoff_max)
        while True:
            try:
                info = await self._register_with_identity(body)
            except WeightshipError as exc:
                await self._back_off("register", exc, backoff)
                continue
            event(log, "controlplane.registered", node_id=info.id, name=info.name)
            return info.id

    async def _register_with_identity(self, body: NodeRegistration) -> NodeInfo:
        """Register with the stored node token; enrol for a new one when there is none or it is refused."""
        path = self.store.state_dir / CREDENTIAL_FILE
        credential = load_credential(path, body.name)
        if credential is not None:
            self.controlplane.use_token(credential.token)
            try:
                info = await self.controlplane.register(body)
            except AuthError as exc:
                # Revoked by an admin, or unknown to a control plane restored from a backup. A token
                # never confirmed (enrolment refused or never reached) is just replaced, quietly.
                if credential.node_id is not None:
                    event(log, "identity.token_refused", logging.WARNING, node_id=credential.node_id, error=exc.message)
            else:
                if credential.node_id != info.id:
                    await self._save_credential(path, replace(credential, node_id=info.id))
                return info
        credential = new_credential(body.name)
        # Stored before asking, so a lost answer is recovered by re-registering with it next time.
        await self._save_credential(path, credential)
        request = NodeEnrolRequest(**body.model_dump(), token=credential.token)
        enrolment = await self.controlplane.enrol(request, self.config.token)
        await self._save_credential(path, replace(credential, node_id=enrolment.node.id))
        self.controlplane.use_token(credential.token)
        event(log, "identity.enrolled", node_id=enrolment.node.id, token_id=enrolment.token_id, path=str(path))
        return enrolment.node

    async def _save_credential(self, path: Path, credential: NodeCredential) -> None:
        await self._state_io(save_credential, path, credential)

    async def _back_off(self, what: str, exc: WeightshipError, backoff: DelaySequence) -> None:
        if isinstance(exc, (AuthError, ForbiddenError, ConflictError)):
            # A bad token, or a name another machine holds (409 at enrolment), will not fix itself quickly.
            backoff.attempts = max(backoff.attempts, 64)
        delay = backoff.next_delay()
        event(
            log,
            "controlplane.unreachable",
            logging.WARNING,
            call=what,
            error=exc.message,
            code=exc.code,
            retry_in=f"{delay:.3f}",
            attempt=backoff.attempts,
        )
        await asyncio.sleep(delay)

    async def _desired_loop(self, node_id: str) -> None:
        cfg = self.config
        backoff = DelaySequence(cfg.backoff_initial, cfg.backoff_max)
        revision: str | None = None
        while True:
            asked = asyncio.get_running_loop().time()  # loop time: fake-clock tests drive it
            try:
                desired, poll_after = await self.controlplane.desired(node_id, revision, cfg.poll_wait)
                answered = asyncio.get_running_loop().time()
            except (NotFoundError, AuthError):
                raise _Reregister() from None
            except WeightshipError as exc:
                await self._back_off("desired", exc, backoff)
                continue
            if backoff.attempts:
                event(log, "controlplane.reconnected", call="desired", after_attempts=backoff.attempts)
                backoff.reset()
            if desired.revision == revision and asyncio.get_running_loop().time() - asked < MIN_POLL_SECONDS:
                # A control plane that answers at once without waiting must not be polled in a
                # tight loop.
                await asyncio.sleep(MIN_POLL_SECONDS)
            if desired.revision != revision:
                revision = desired.revision
                event(
                    log,
                    "desired.received",
                    revision=revision,
                    deployments=",".join(f"{d.name}@{d.epoch}" for d in desired.deployments),
                )
                await self.reconciler.apply(desired)
            if poll_after:
                # The control plane spreads the return of a fleet that one change answered at once.
                await asyncio.sleep(max(0.0, answered + poll_after - asyncio.get_running_loop().time()))

    async def _heartbeat_loop(self, node_id: str) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        backoff = DelaySequence(cfg.backoff_initial, cfg.backoff_max)
        changed = self._changed
        while True:
            began = loop.time()
            self._usage = await loop.run_in_executor(self.state_executor, self.store.usage_bytes)
            body = self.heartbeat()
            try:
                await self.controlplane.heartbeat(node_id, body)
            except (NotFoundError, AuthError):
                raise _Reregister() from None
            except WeightshipError as exc:
                await self._back_off("heartbeat", exc, backoff)
                continue
            backoff.reset()
            # From due to answered: what bench/fetch.py reads to show heartbeats do not stall.
            event(log, "heartbeat.sent", logging.DEBUG, seconds=f"{loop.time() - began:.4f}")
            sent = set(map(id, body.validation))
            self._reports = [r for r in self._reports if id(r) not in sent]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), cfg.heartbeat_interval)
                await asyncio.sleep(HEARTBEAT_DEBOUNCE)
            changed.clear()


def install_signal_handlers(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT stop the agent cleanly."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
