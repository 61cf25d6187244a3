"""The cache role: a read-through chunk cache for a cluster or a region, by chunk digest.

A cache is the agent run with ``--role cache``: no deployments of its own, a peer listener
(``agent.peerserver``) whose ``ChunkLocator`` is a ``ReadThroughCache``:

1. **What it knows.** Every ``refresh_seconds`` it lists the serving pointers
   (``GET /v1/deployments``) and reads the manifest of every version they name (stable, previous
   stable, canary) or a standing preheat stages (``preheated``). Those versions' chunks are
   *pinned* in the ``ChunkStore`` (a preheated version is warmed by the nodes that pull it
   through the cache: the first request of each chunk fetches it once); a request for a
   version it does not know makes it re-read once (at most every ``refresh_seconds``), then 404.
   With a signing policy, a version it refuses is not known; when the policy changes
   (``agent.signatures``) every version it knows is checked again, and one now refused becomes
   unknown (its chunks age out by LRU). A version whose manifest cannot be had (corrupt or
   missing at the origin) is unknown too, and the others are refreshed all the same.
   The manifest also tells it where chunk ``index`` of ``blob`` lies, and refuses (409) a request
   whose (blob, index) is not that chunk.
2. **A hit** is served from disk (``sendfile``). **A miss** is fetched once, however many ask:
   the first request starts the fetch (a task, so a requester that hangs up does not cancel it
   for the others) and every request for the same digest awaits it (*single flight*).
3. **Upstream.** The fetch goes to ``upstream`` (the next tier's cache, ``/v1/chunks`` with the
   cache's *own* ticket for that version, bound to the upstream cache's name: it is entitled to
   every version a pointer names; requesters' tickets are never forwarded) or, with no upstream,
   or when the upstream is unreachable or does not have it, to the origin through a blob URL from
   the control plane (a ``Range`` read). At most
   ``upstream_concurrency`` fetches run at once, paced by ``upstream_bandwidth``.
4. **Read-ahead.** The first request for a version (a chunk, or the tracker's availability for
   it) starts reading the whole version from upstream in chunk order, ``read_ahead`` streams at
   once (from the origin, one range read per run of up to ``STREAM_CHUNKS`` chunks, each chunk
   kept and served as soon as its bytes are in), through the same single flight: the origin link
   stays busy without gaps while nodes are still busy with earlier chunks, and each chunk is
   fetched once whether a node or the read-ahead asked.
5. **Verified before stored or served.** The bytes must hash to the chunk digest. If they do
   not, nothing is stored, every waiting requester gets 502 ``upstream_corrupt``, the event
   ``cache.upstream_corrupt`` names the source, the counter
   ``weightship_cache_upstream_corrupt_total{source=...}`` grows, and a corrupt upstream cache
   is skipped (origin used) for ``avoid_seconds``. The requester falls back up the tiers itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

import aiohttp

from agent.bandwidth import SLICE, TokenBucket
from agent.chunkorder import chunk_order
from agent.chunkstore import ChunkStore
from agent.peerserver import ChunkLocation, chunk_path
from agent.problems import answer_error
from agent.signatures import SignatureGate
from agent.tickets import Audiences, TicketKeeper
from weightship.digests import sha256_hex
from weightship.errors import IntegrityError, NotFoundError, TemporaryError, ValidationError, WeightshipError
from weightship.logs import event
from weightship.manifest import Manifest, parse_manifest
from weightship.schemas import BlobURL, Deployment
from weightship.signing import SignatureRefused

__all__ = ["CacheStats", "ReadThroughCache", "UpstreamCorrupt"]

log = logging.getLogger("agent.cache")

#: a blob URL is renewed this long before it expires
_URL_MARGIN = timedelta(seconds=30)
#: most consecutive chunks one read-ahead stream brings in one origin range read
STREAM_CHUNKS = 16


class UpstreamCorrupt(WeightshipError):
    """The bytes a cache's upstream sent do not hash to the chunk's digest; nothing was stored."""

    status_code = 502
    code = "upstream_corrupt"


class CacheSource(Protocol):
    """The control-plane calls a cache makes (``ControlPlaneClient``)."""

    async def deployments(self) -> list[Deployment]:
        """Every deployment and its pointer."""

    async def manifest(self, model: str, digest: str) -> bytes:
        """A version's manifest bytes, checked against ``digest``."""

    async def blob_urls(self, blobs: list[str]) -> dict[str, BlobURL]:
        """Read URLs of blobs at the origin."""


@dataclass
class CacheStats:
    """Counters of one cache, for ``/metrics``."""

    hits: int = 0
    misses: int = 0
    waited: int = 0
    fetches: dict[str, int] = field(default_factory=lambda: {"upstream": 0, "origin": 0})
    fetch_bytes: dict[str, int] = field(default_factory=lambda: {"upstream": 0, "origin": 0})
    corrupt: dict[str, int] = field(default_factory=dict)
    errors: int = 0


class ReadThroughCache:
    """``ChunkLocator`` of a cache: hits from the ``ChunkStore``, misses fetched once upstream and verified."""

    def __init__(
        self,
        store: ChunkStore,
        source: CacheSource,
        tickets: TicketKeeper,
        executor: Executor,
        *,
        upstream: str = "",
        upstream_concurrency: int = 8,
        upstream_bandwidth: float = 0.0,
        refresh_seconds: float = 5.0,
        avoid_seconds: float = 60.0,
        read_ahead: int = 2,
        gate: SignatureGate | None = None,
    ) -> None:
        self.store = store
        self.source = source
        #: the cache's signing policy: a version it refuses is unknown here (404), never fetched or served
        self.gate = gate
        #: digest -> why the signing policy refuses it
        self.refused: dict[str, str] = {}
        self.tickets = tickets
        self.executor = executor
        self.upstream = upstream.rstrip("/")
        self.refresh_seconds = refresh_seconds
        self.avoid_seconds = avoid_seconds
        self.stats = CacheStats()
        self.manifests: dict[str, Manifest] = {}
        self.pinned: frozenset[str] = frozenset()
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self.read_ahead = read_ahead
        self._ahead: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(upstream_concurrency)
        self._bucket = TokenBucket(upstream_bandwidth)
        self._refreshed = float("-inf")
        self._refresh_lock = asyncio.Lock()
        self._poked = asyncio.Event()
        self._avoid_upstream_until = 0.0
        self._http: aiohttp.ClientSession | None = None
        self._urls: dict[str, BlobURL] = {}
        self._audiences = Audiences()

    async def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=30))
        return self._http

    async def close(self) -> None:
        """Stop in-flight fetches and close connections."""
        for task in [*self._ahead.values(), *self._inflight.values()]:
            task.cancel()
        if self._http is not None:
            await self._http.close()
        await self._audiences.close()

    # --- what the cache knows ------------------------------------------------------------------

    async def refresh(self) -> None:
        """Re-read the pointers and the manifests of the versions they name; re-pin their chunks."""
        async with self._refresh_lock:
            named = {
                digest: d.model
                for d in await self.source.deployments()
                for digest in (d.stable, d.previous_stable, d.canary, *d.preheated)
                if digest is not None
            }
            if self.gate is not None:
                self.gate.reload()
            for digest, model in named.items():
                manifest = self.manifests.get(digest)
                if manifest is None:
                    try:
                        manifest = parse_manifest(await self.source.manifest(model, digest))
                    except (IntegrityError, ValidationError, NotFoundError) as exc:
                        # This version's own trouble (a corrupt or missing manifest), not the others'.
                        event(log, "cache.manifest_refused", logging.WARNING, version=digest, error=exc.message)
                        continue
                elif self.gate is None or self.gate.accepted(digest):
                    continue  # known, and accepted by the policy in effect
                if await self._passes(manifest):
                    self.manifests[digest] = manifest
                else:
                    self.manifests.pop(digest, None)  # refused by a changed policy: unknown here from now on
            for digest in set(self.manifests) - set(named):
                del self.manifests[digest]  # no pointer names it any more: its chunks age out by LRU
            self.pinned = frozenset(c for m in self.manifests.values() for f in m.files for c in f.chunks)
            self._refreshed = time.monotonic()
        event(log, "cache.refreshed", versions=len(self.manifests), pinned_chunks=len(self.pinned))

    async def _passes(self, manifest: Manifest) -> bool:
        """Whether the cache's signing policy accepts ``manifest``'s version (no policy: yes)."""
        if self.gate is None:
            return True
        try:
            await self.gate.check(manifest)
        except SignatureRefused as exc:
            self.refused[manifest.digest] = str(exc.fields.get("reason"))
            return False
        self.refused.pop(manifest.digest, None)
        return True

    def poke(self) -> None:
        """Refresh now rather than at the next period (the signing policy changed)."""
        self._poked.set()

    async def run(self) -> None:
        """Refresh every ``refresh_seconds``, or when poked, until cancelled; control-plane trouble is logged."""
        while True:
            self._poked.clear()
            try:
                await self.refresh()
            except WeightshipError as exc:
                event(log, "cache.refresh_failed", logging.WARNING, error=exc.message)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poked.wait(), self.refresh_seconds)

    async def _manifest(self, version: str) -> Manifest:
        manifest = self.manifests.get(version)
        if manifest is None and time.monotonic() - self._refreshed >= min(self.refresh_seconds, 1.0):
            await self.refresh()
            manifest = self.manifests.get(version)
        if manifest is None:
            raise NotFoundError(f"version {version} is named by no serving pointer; this cache does not serve it")
        return manifest

    # --- serving -------------------------------------------------------------------------------

    async def locate(self, chunk: str, version: str, blob: str, index: int) -> ChunkLocation:
        """See ``agent.peerserver.ChunkLocator``: a hit, or a miss fetched once and verified."""
        manifest = await self._manifest(version)
        number, _rel = chunk_path(manifest, chunk, blob, index)
        self.start_read_ahead(manifest)
        size = self.store.get(chunk)
        if size is not None:
            self.stats.hits += 1
            return ChunkLocation(self.store.path(chunk), 0, size)
        if chunk in self._inflight:
            self.stats.waited += 1
        else:
            self.stats.misses += 1
        await asyncio.shield(self._flight(manifest, number, index, chunk))
        size = self.store.get(chunk)
        if size is None:  # evicted at once by a store full of pinned chunks
            raise TemporaryError(f"chunk {chunk} was evicted as soon as it was stored; the cache is full", delay=1.0)
        return ChunkLocation(self.store.path(chunk), 0, size)

    def _flight(self, manifest: Manifest, number: int, index: int, chunk: str) -> asyncio.Future[None]:
        """The one fetch of ``chunk`` (single flight): the running one (maybe a read-ahead stream), or a new one."""
        flight = self._inflight.get(chunk)
        if flight is None:
            flight = asyncio.get_running_loop().create_task(self._fill(manifest, number, index, chunk))
            self._in_flight(chunk, flight)
        return flight

    def _in_flight(self, chunk: str, flight: asyncio.Future[None]) -> None:
        """Register ``flight`` as the one fetch of ``chunk`` until it is done."""
        self._inflight[chunk] = flight
        flight.add_done_callback(lambda _f: self._inflight.pop(chunk, None))

    def start_read_ahead(self, manifest: Manifest) -> None:
        """Start reading ``manifest``'s version ahead (once per version; no-op with ``read_ahead`` 0)."""
        if self.read_ahead > 0 and manifest.digest not in self._ahead:
            self._ahead[manifest.digest] = asyncio.get_running_loop().create_task(self._read_version(manifest))

    def held_indexes(self, manifest: Manifest) -> list[int]:
        """The chunk-order indexes of ``manifest``'s chunks held here."""
        return [i for i, digest in enumerate(chunk_order(manifest)) if self.store.holds(digest)]

    async def _read_version(self, manifest: Manifest) -> None:
        """Fetch every chunk of ``manifest`` not held, in chunk order, ``read_ahead`` streams at a time.

        From the origin each stream is one range read over up to ``STREAM_CHUNKS`` consecutive
        chunks of a file, kept and served one by one as their bytes arrive: one request per run
        rather than per chunk, so the origin link has no gaps between chunks and chunks reach the
        cluster one after another at the link's pace. From an upstream cache, chunk by chunk.
        """
        where: dict[str, tuple[int, int]] = {}
        for number, entry in enumerate(manifest.files):
            for index, digest in enumerate(entry.chunks):
                where.setdefault(digest, (number, index))
        todo = [digest for digest in chunk_order(manifest) if not self.store.holds(digest)]
        fetched = 0

        async def stream() -> None:
            nonlocal fetched
            while todo:
                run = self._claim_run(manifest, where, todo)
                if run:
                    fetched += await self._stream(manifest, *run)
                    continue
                digest = todo.pop(0)
                if not self.store.holds(digest):
                    done, _ = await asyncio.wait({self._flight(manifest, *where[digest], digest)})
                    fetched += _count_done(done)

        await asyncio.gather(*(stream() for _ in range(max(1, self.read_ahead))))
        event(log, "cache.read_ahead_done", version=manifest.digest, fetched=fetched)

    def _claim_run(
        self, manifest: Manifest, where: dict[str, tuple[int, int]], todo: list[str]
    ) -> tuple[int, list[tuple[int, str, asyncio.Future[None]]]] | None:
        """Take the next chunks of ``todo`` that one origin range read can bring (None: fetch the next alone).

        Consecutive chunks of one file, neither held nor in flight, at most ``STREAM_CHUNKS``; each
        gets a future in the single flight, so requesters wait for the stream instead of fetching again.
        """
        if self.upstream and time.monotonic() >= self._avoid_upstream_until:
            return None
        number, first = where[todo[0]]
        entry = manifest.files[number]
        loop = asyncio.get_running_loop()
        run: list[tuple[int, str, asyncio.Future[None]]] = []
        index = first
        while todo and index < len(entry.chunks) and len(run) < STREAM_CHUNKS:
            digest = entry.chunks[index]
            if todo[0] != digest or where[digest] != (number, index):
                break
            if self.store.holds(digest) or digest in self._inflight:
                break
            todo.pop(0)
            future: asyncio.Future[None] = loop.create_future()
            self._in_flight(digest, future)
            run.append((index, digest, future))
            index += 1
        return (number, run) if run else None

    async def _stream(self, manifest: Manifest, number: int, run: list[tuple[int, str, asyncio.Future[None]]]) -> int:
        """Read the chunks of ``run`` (consecutive, file ``number``) in one origin range read; returns how many were kept."""
        entry = manifest.files[number]
        start = entry.chunk_range(run[0][0], manifest.chunk_size)[0]
        end = entry.chunk_range(run[-1][0], manifest.chunk_size)[1]
        # One task per chunk whose bytes are all in: it verifies and stores the chunk, then settles
        # the chunk's single-flight future itself, whatever becomes of the rest of the stream.
        keeping: list[asyncio.Task[bool]] = []
        try:
            async with self._slots:
                url = await self._origin_url(entry.sha256)
                what = f"origin blob {entry.sha256}"
                http = await self._session()
                headers = {"Range": f"bytes={start}-{end - 1}"}
                try:
                    async with http.get(url.url, headers=headers) as response:
                        if response.status != 206 or response.content_length != end - start:
                            self._urls.pop(entry.sha256, None)
                            refusal = await answer_error(response, what) if response.status >= 400 else None
                            raise TemporaryError(f"{what} answered HTTP {response.status} to a range read"
                                                 f"{f': {refusal.message}' if refusal else ''}")  # fmt: skip
                        for index, digest, future in run:
                            lo, hi = entry.chunk_range(index, manifest.chunk_size)
                            await self._bucket.take(hi - lo)
                            data = await response.content.readexactly(hi - lo)
                            self.stats.fetches["origin"] += 1
                            self.stats.fetch_bytes["origin"] += len(data)
                            # Verified and stored while the next chunk arrives: the stream never waits on disk.
                            keeping.append(asyncio.create_task(self._keep_for(manifest, digest, data, what, future)))
                except (aiohttp.ClientError, asyncio.IncompleteReadError, TimeoutError) as exc:
                    raise TemporaryError(f"{what} failed: {exc!r}") from None
        except WeightshipError as exc:
            event(log, "cache.stream_failed", logging.WARNING, blob=entry.sha256, error=exc.message)
            for _index, _digest, future in run[len(keeping) :]:
                if not future.done():
                    future.set_exception(exc)
                    future.exception()  # retrieved here: a requester that waits sees it too
        finally:
            for _index, _digest, future in run[len(keeping) :]:
                if not future.done():
                    future.cancel()  # the stream itself was cancelled (shutdown)
        return sum(await asyncio.gather(*keeping))

    async def _fill(self, manifest: Manifest, number: int, index: int, chunk: str) -> None:
        entry = manifest.files[number]
        start, end = entry.chunk_range(index, manifest.chunk_size)
        async with self._slots:
            use_upstream = bool(self.upstream) and time.monotonic() >= self._avoid_upstream_until
            data: bytes | None = None
            where = "origin"
            if use_upstream:
                where = "upstream"
                try:
                    data = await self._from_upstream(manifest.digest, entry.sha256, index, chunk, end - start)
                except (TemporaryError, NotFoundError) as exc:
                    event(log, "cache.upstream_failed", logging.WARNING, upstream=self.upstream, chunk=chunk,
                          error=exc.message, fallback="origin")  # fmt: skip
                    where, data = "origin", None
            if data is None:
                data = await self._from_origin(entry.sha256, start, end - start)
            self.stats.fetches[where] += 1
            self.stats.fetch_bytes[where] += len(data)
        source = self.upstream if where == "upstream" else f"origin blob {entry.sha256}"
        await self._keep(manifest, chunk, data, where, source)

    async def _keep_for(
        self, manifest: Manifest, chunk: str, data: bytes, source: str, future: asyncio.Future[None]
    ) -> bool:
        """``_keep`` a streamed chunk and settle its single-flight ``future``; True once stored."""
        try:
            await self._keep(manifest, chunk, data, "origin", source)
        except WeightshipError as exc:
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: requesters that wait see it too
            return False
        if not future.done():
            future.set_result(None)
        return True

    async def _keep(self, manifest: Manifest, chunk: str, data: bytes, where: str, source: str) -> None:
        """Store ``data`` as ``chunk`` if it hashes to it; else count, log and raise ``UpstreamCorrupt``."""
        loop = asyncio.get_running_loop()
        actual = await loop.run_in_executor(self.executor, sha256_hex, data)
        if actual != chunk:
            self.stats.corrupt[where] = self.stats.corrupt.get(where, 0) + 1
            if where == "upstream":
                self._avoid_upstream_until = time.monotonic() + self.avoid_seconds
            event(log, "cache.upstream_corrupt", logging.ERROR, source=source, chunk=chunk, got=actual,
                  version=manifest.digest, action="rejected_not_stored")  # fmt: skip
            raise UpstreamCorrupt(
                f"{source} sent bytes for chunk {chunk} that hash to {actual}; rejected and not stored. "
                "Fetch the chunk from another source"
            )
        await loop.run_in_executor(self.executor, self.store.put, chunk, data, self.pinned)
        event(log, "cache.stored", chunk=chunk, bytes=len(data), source=where)

    async def _read(self, response: aiohttp.ClientResponse, length: int, what: str) -> bytes:
        if response.content_length is not None and response.content_length != length:
            raise UpstreamCorrupt(f"{what} announced {response.content_length} bytes for a {length}-byte chunk")
        body = bytearray()
        async for piece in response.content.iter_chunked(SLICE):
            if len(body) + len(piece) > length:
                raise UpstreamCorrupt(f"{what} sent more than the chunk's {length} bytes")
            await self._bucket.take(len(piece))
            body += piece
        return bytes(body)

    async def _get(self, url: str, headers: dict[str, str], length: int, what: str) -> bytes:
        http = await self._session()
        try:
            async with http.get(url, headers=headers) as response:
                if response.status not in (200, 206):
                    refusal = await answer_error(response, what)
                    if response.status in (404, 409):
                        raise NotFoundError(f"{what} does not have it (HTTP {response.status}): {refusal.message}")
                    raise TemporaryError(f"{what} answered HTTP {response.status}: {refusal.message}")
                return await self._read(response, length, what)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TemporaryError(f"{what} failed: {exc!r}") from None

    async def _from_upstream(self, version: str, blob: str, index: int, chunk: str, length: int) -> bytes:
        # a ticket for this one version, bound to the upstream cache it is sent to
        ticket = await self.tickets.ticket_for([version], await self._audiences.name_of(self.upstream))
        url = f"{self.upstream}/v1/chunks/{chunk}?version={version}&blob={blob}&index={index}"
        return await self._get(url, {"Authorization": f"Ticket {ticket}"}, length, f"upstream {self.upstream}")

    async def _origin_url(self, blob: str) -> BlobURL:
        url = self._urls.get(blob)
        if url is None or url.expires_at - _URL_MARGIN <= datetime.now(UTC):
            # One control-plane call per blob, not per chunk: on a busy control plane that call, not
            # the origin link, set the pace of a read-ahead.
            urls = await self.source.blob_urls([blob])
            if blob not in urls:
                raise NotFoundError(f"the control plane gave no URL for blob {blob}")
            url = self._urls[blob] = urls[blob]
        return url

    async def _from_origin(self, blob: str, start: int, length: int) -> bytes:
        url = await self._origin_url(blob)
        headers = {"Range": f"bytes={start}-{start + length - 1}"}
        try:
            return await self._get(url.url, headers, length, f"origin blob {blob}")
        except (TemporaryError, NotFoundError):
            self._urls.pop(blob, None)  # perhaps revoked or expired early: ask for a fresh one next time
            raise

    def metrics(self) -> str:
        """The cache's counters in Prometheus text format."""
        s = self.stats
        lines = [
            f"weightship_cache_hits_total {s.hits}",
            f"weightship_cache_misses_total {s.misses}",
            f"weightship_cache_waited_total {s.waited}",
            f"weightship_cache_chunks {len(self.store)}",
            f"weightship_cache_bytes {self.store.used}",
            f"weightship_cache_evicted_total {self.store.evicted}",
            f"weightship_cache_pinned_chunks {len(self.pinned)}",
        ]
        for where in ("upstream", "origin"):
            lines.append(f'weightship_cache_fetches_total{{source="{where}"}} {s.fetches[where]}')
            lines.append(f'weightship_cache_fetch_bytes_total{{source="{where}"}} {s.fetch_bytes[where]}')
            lines.append(f'weightship_cache_upstream_corrupt_total{{source="{where}"}} {s.corrupt.get(where, 0)}')
        return "\n".join(lines) + "\n"


def _count_done(done: set[asyncio.Future[None]]) -> int:
    """Fetches that succeeded; a failed one is logged here and left to the nodes to ask for again."""
    ok = 0
    for task in done:
        error = None if task.cancelled() else task.exception()
        if error is None:
            ok += 1
        else:
            event(log, "cache.read_ahead_failed", logging.WARNING, error=str(error))
    return ok
