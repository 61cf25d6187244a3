"""Fetching a version's missing chunks: local copies first, then HTTP range requests on blob URLs.

Sources, nearest first: chunks already held by a ready version (or verified earlier in this
staging area) are read locally; the rest come from the origin by ``Range`` requests on the
short-lived blob URLs the control plane issues (presigned S3 or control-plane-signed), so the
node holds no storage credentials. Each distinct chunk is fetched once however often it occurs.

Concurrency is bounded twice: at most ``concurrency`` requests in flight, and at most
``memory_bytes`` of chunk buffers (a buffer is reused, never reallocated per chunk). A chunk is
hashed in a worker thread (``hashlib`` drops the GIL) while the event loop keeps receiving
others, and written only if it matches. A mismatch counts in ``chunks_rejected`` and the chunk
is fetched again with backoff; a chunk that fails ``attempts`` times fails the fetch with its
last error once every other chunk has been tried (so they are kept, verified, for the next
attempt). A chunk whose last attempt still brought bytes that did not match fails it with
``CorruptChunkError``, naming the blob and chunk: the origin's copy is bad, and fetching it again
soon would only burn bandwidth (the reconciler waits minutes before it tries again). A full disk
stops the fetch at once. Responses longer than the chunk are cut off and rejected, so a
misbehaving origin cannot stream endless data.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
import os
import random
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from datetime import UTC, datetime, timedelta
from typing import Protocol

from agent.chunkorder import chunk_order, obtainable, rank_chunks
from agent.counters import Counters
from agent.rangeclient import RangeClient, UrlRejected
from agent.sources import Deferred, Sources, Want, is_busy, reason_of
from agent.staging import ChunkJob, Staging
from agent.store import LocalChunk
from weightship.backoff import Backoff, DelaySequence
from weightship.errors import DiskFullError, IntegrityError, StoreError, TemporaryError, WeightshipError
from weightship.logs import event
from weightship.manifest import Manifest
from weightship.schemas import BlobURL

__all__ = ["BlobURLSource", "CorruptChunkError", "Fetcher"]

log = logging.getLogger("agent.fetcher")


def _chunk_retryable(error: WeightshipError) -> bool:
    """A chunk is fetched again after bad bytes, a lapsed URL, a store error or a temporary failure."""
    return isinstance(error, (IntegrityError, TemporaryError, StoreError))

#: refresh a blob URL this long before it expires
URL_MARGIN = timedelta(seconds=30)
#: first and longest pause before asking busy peers and caches again (seconds)
_BUSY_PAUSE = 0.2
_BUSY_PAUSE_MAX = 2.0


class BlobURLSource(Protocol):
    """Whatever hands out blob URLs (the control-plane client)."""

    async def blob_urls(self, blobs: Sequence[str]) -> dict[str, BlobURL]:
        """Short-lived read URLs for ``blobs`` (file sha256 hex)."""
        ...


class CorruptChunkError(IntegrityError):
    """Every fetch of one chunk brought bytes that do not hash to its digest: the origin copy is bad."""

    def __init__(
        self, message: str, *, blob: str, file: str, chunk_index: int, chunk_digest: str, rejected: int
    ) -> None:
        super().__init__(message)
        self.blob = blob
        self.file = file
        self.chunk_index = chunk_index
        self.chunk_digest = chunk_digest
        self.rejected = rejected


#: called with the error of each chunk attempt that will be retried
Trouble = Callable[[WeightshipError], None]


class Fetcher:
    """Fills a ``Staging`` with verified chunks."""

    def __init__(
        self,
        client: RangeClient,
        urls: BlobURLSource,
        counters: Counters,
        executor: Executor,
        *,
        concurrency: int = 8,
        memory_bytes: int = 512 * 1024 * 1024,
        attempts: int = 5,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        sources: Sources | None = None,
    ) -> None:
        self.client = client
        self.sources = sources
        self.urls = urls
        self.counters = counters
        self.executor = executor
        self.concurrency = concurrency
        self.memory_bytes = memory_bytes
        self.attempts = attempts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._url_cache: dict[str, BlobURL] = {}
        #: whether a local model server is loading this version while it is fetched (``agent.chunkfeed``):
        #: then the chunks it needs first come first, as far as the swarm allows (``_Pool``)
        self.streamed: Callable[[str], bool] = lambda _digest: False

    async def fetch(
        self,
        staging: Staging,
        local: dict[str, LocalChunk],
        progress: Callable[[int], None] | None = None,
        trouble: Trouble | None = None,
    ) -> None:
        """Place every missing chunk of ``staging``; raises the last error of a chunk that kept failing.

        ``trouble`` hears every failed chunk attempt that is retried, so a fetch that keeps
        failing shows as such while it still runs.
        """
        jobs = staging.jobs()
        if not jobs:
            return
        if self.sources is not None:
            # Each node its own order: nodes that all start at chunk 0 leave peers nothing to trade
            # (bench/simulate.py --order sequential vs random: about 2.0 vs 1.6 times ideal). The
            # tracker's availability re-ranks the rest as the fetch goes (``_Pool``).
            random.Random(self.sources.node).shuffle(jobs)
        else:
            jobs.sort(key=functools.partial(_file_order, staging.manifest))
        largest = max(job.length for job in jobs)
        limit = self.concurrency
        if self.sources is not None and self.sources.tracker:
            # Pulling from peers, fewer flows are faster: a node with as many chunks in flight as a parent
            # serves children keeps both ends of each flow busy (bench/fanout.py: 4 in flight, 1.52 x ideal;
            # 8, 1.75 x; 2, 1.86 x).
            limit = min(limit, self.sources.concurrency)
        slots = max(1, min(limit, len(jobs), self.memory_bytes // max(1, largest)))
        buffers = _Buffers(largest, slots)
        remote = [job for job in jobs if job.digest not in local]
        if remote:
            await self._refresh_urls({job.blob for job in remote})
        report = progress or (lambda _n: None)
        warn = trouble or (lambda _e: None)
        event(
            log,
            "fetch.start",
            digest=staging.manifest.digest,
            chunks=len(jobs),
            local=len(jobs) - len(remote),
            remote=len(remote),
            slots=slots,
        )
        failures: list[WeightshipError] = []
        pool = _Pool(
            jobs,
            self._ranker(staging),
            self.sources.wait_limit if self.sources is not None else 0.0,
            self.sources.availability_ttl if self.sources is not None else 0.25,
            in_order=functools.partial(self.streamed, staging.manifest.digest),
            window=max(4, 2 * slots),
            order=functools.partial(_file_order, staging.manifest),
        )
        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    buf = await buffers.get()
                    job = await pool.take()
                    if job is None:
                        buffers.put(buf)
                        break
                    group.create_task(
                        self._one(staging, job, local.get(job.digest), buf, buffers, report, warn, failures, pool)
                    )
        except BaseExceptionGroup as group_error:
            # A disk-full error stops everything at once; surface it, not the group.
            ours = group_error.subgroup(WeightshipError)
            if ours is None:
                raise
            raise _first(ours) from None
        if failures:
            # The other chunks were still fetched and kept: a later attempt needs only the failed ones.
            raise failures[0]

    async def _one(
        self,
        staging: Staging,
        job: ChunkJob,
        source: LocalChunk | None,
        buf: mmap.mmap,
        buffers: _Buffers,
        report: Callable[[int], None],
        warn: Trouble,
        failures: list[WeightshipError],
        pool: _Pool,
    ) -> None:
        deferred = False
        try:
            deferred = await self._fill(staging, job, source, buf, report, warn, failures, pool)
        finally:
            buffers.put(buf)
            if not deferred:
                pool.done()

    async def _fill(
        self,
        staging: Staging,
        job: ChunkJob,
        source: LocalChunk | None,
        buf: mmap.mmap,
        report: Callable[[int], None],
        warn: Trouble,
        failures: list[WeightshipError],
        pool: _Pool,
    ) -> bool:
        """Place ``job`` through ``buf``: from a local copy when there is one, else downloaded.

        True when the job was deferred (put back in ``pool`` to be taken again later).
        """
        loop = asyncio.get_running_loop()
        view = memoryview(buf)[: job.length]
        if source is not None:
            try:
                await loop.run_in_executor(self.executor, _read_local, source, view)
                await loop.run_in_executor(self.executor, staging.place, job, view)
                self.counters.add(bytes_copied_locally=job.bytes_placed)
                self.counters.sources.delivered("local", job.length)
                if self.sources is not None:
                    self.sources.verified(staging.manifest, [job.digest])
                report(job.bytes_placed)
                return False
            except (OSError, IntegrityError) as exc:
                event(log, "fetch.local_copy_failed", logging.WARNING, chunk=job.digest, error=str(exc))
        try:
            await self._download(staging, job, view, warn, pool.may_defer(job))
        except Deferred as wait:
            pool.defer(job, wait.delay)
            return True
        except DiskFullError:
            raise
        except WeightshipError as exc:
            failures.append(exc)
            return False
        self.counters.add(bytes_copied_locally=job.bytes_placed - job.length)
        report(job.bytes_placed)
        return False

    def _ranker(self, staging: Staging) -> Ranker | None:
        """Re-orders pending jobs by the tracker's availability (``rank_chunks``); None without a tracker.

        Returns whether the first one is ``obtainable`` now (always True without an answer).
        """
        sources = self.sources
        if sources is None or not sources.tracker:
            return None
        order = {digest: i for i, digest in enumerate(chunk_order(staging.manifest))}

        async def rank(pending: list[ChunkJob]) -> bool:
            seen = await sources.availability(staging.manifest.digest)
            if seen is None:
                return True
            position = {i: k for k, i in enumerate(rank_chunks([order[j.digest] for j in pending], seen, sources.node))}
            pending.sort(key=lambda j: position[order[j.digest]])
            return obtainable(order[pending[0].digest], seen)

        return rank

    async def _from_sources(self, staging: Staging, job: ChunkJob, view: memoryview, defer: bool) -> bool:
        """Try peers and caches (``agent.sources``); True once the chunk is verified and placed.

        A round that failed only because sources were busy is repeated after a short, growing
        pause, until the sources' ``busy_limit``; any other failure goes on to the origin at once.
        """
        assert self.sources is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.sources.busy_limit
        pauses = DelaySequence(_BUSY_PAUSE, _BUSY_PAUSE_MAX, jitter=0.25)
        while True:
            placed, busy = await self._source_round(staging, job, view, defer)
            if placed:
                return True
            pause = pauses.next_delay()
            if not busy or loop.time() + pause > deadline:
                return False
            await asyncio.sleep(pause)

    async def _source_round(self, staging: Staging, job: ChunkJob, view: memoryview, defer: bool) -> tuple[bool, bool]:
        """One pass over the tiers: (placed, whether some source refused only for load)."""
        assert self.sources is not None
        loop = asyncio.get_running_loop()
        tally = self.counters.sources
        want = Want(staging.manifest.digest, job.digest, job.blob, job.placements[0].chunk, job.length)
        busy = False
        async with contextlib.aclosing(self.sources.attempts(want, defer)) as attempts:
            async for attempt in attempts:
                try:
                    await self.sources.read(attempt, want, view)
                    await loop.run_in_executor(self.executor, staging.place, job, view)
                except DiskFullError:
                    raise
                except WeightshipError as exc:
                    tally.failed(attempt.source)
                    busy = busy or is_busy(exc)
                    if isinstance(exc, IntegrityError):
                        self.counters.add(chunks_rejected=1)
                    event(log, "fetch.source_failed", logging.WARNING, source=attempt.source, parent=attempt.parent,
                          chunk=job.digest, error=exc.message)  # fmt: skip
                    if attempt.parent:
                        await attempt.bad(reason_of(exc))
                    continue
                tally.delivered(attempt.source, job.length)
                if attempt.source == "peer":
                    self.counters.add(bytes_from_peers=job.length)
                self.sources.verified(staging.manifest, [job.digest])
                return True, busy
        return False, busy

    async def _download(
        self, staging: Staging, job: ChunkJob, view: memoryview, warn: Trouble, defer: bool = False
    ) -> None:
        loop = asyncio.get_running_loop()
        if self.sources is not None and await self._from_sources(staging, job, view, defer):
            return
        rejected = 0

        async def once() -> None:
            nonlocal rejected
            try:
                url = await self._url(job.blob)
                await self._get_range(url, job.blob_offset, view)
                await loop.run_in_executor(self.executor, staging.place, job, view)
            except IntegrityError:
                self.counters.sources.failed("origin")
                self.counters.add(chunks_rejected=1)
                rejected += 1
                raise
            except UrlRejected:
                self._url_cache.pop(job.blob, None)
                raise

        def retrying(attempt: int, delay: float, error: WeightshipError) -> None:
            event(log, "fetch.chunk_retry", logging.WARNING, chunk=job.digest, attempt=attempt,
                  retry_in=f"{delay:.2f}", error=error.message)  # fmt: skip
            warn(error)

        backoff = Backoff(attempts=self.attempts, base=self.backoff_initial, cap=self.backoff_max, jitter_floor=0.8)
        try:
            await backoff.run_async(once, retryable=_chunk_retryable, on_retry=retrying)
        except (IntegrityError, TemporaryError, StoreError) as exc:
            last: WeightshipError = exc
        else:
            self.counters.sources.delivered("origin", job.length)
            if self.sources is not None:
                self.sources.verified(staging.manifest, [job.digest])
            return
        first = job.placements[0]
        entry = staging.manifest.files[first.file]
        message = (
            f"chunk {first.chunk} of {entry.path} in {staging.manifest.digest} failed "
            f"{self.attempts} times; last error: {last.message}"
        )
        if isinstance(last, IntegrityError):
            event(
                log,
                "fetch.corrupt_origin",
                logging.ERROR,
                blob=job.blob,
                file=entry.path,
                chunk_index=first.chunk,
                chunk=job.digest,
                rejected=rejected,
            )
            raise CorruptChunkError(
                f"{message}. The origin's copy of blob {job.blob} is corrupt at chunk {first.chunk} "
                f"(bytes {job.blob_offset}-{job.blob_offset + job.length - 1}); re-publish the version "
                "or restore the blob, then re-point the deployment to retry at once",
                blob=job.blob,
                file=entry.path,
                chunk_index=first.chunk,
                chunk_digest=job.digest,
                rejected=rejected,
            )
        raise type(last)(message)

    async def _get_range(self, url: str, start: int, view: memoryview) -> None:
        def count(n: int) -> None:
            self.counters.add(bytes_downloaded=n)

        await self.client.get_range(url, start, view, count)

    async def _url(self, blob: str) -> str:
        cached = self._url_cache.get(blob)
        if cached is None or cached.expires_at - URL_MARGIN <= datetime.now(UTC):
            await self._refresh_urls({blob})
            cached = self._url_cache[blob]
        return cached.url

    async def _refresh_urls(self, blobs: set[str]) -> None:
        now = datetime.now(UTC)
        stale = sorted(
            b for b in blobs if b not in self._url_cache or self._url_cache[b].expires_at - URL_MARGIN <= now
        )
        if not stale:
            return
        fresh = await self.urls.blob_urls(stale)
        missing = [b for b in stale if b not in fresh]
        if missing:
            raise StoreError(
                f"the control plane issued no URL for blobs {missing[:3]}: they are missing from the origin"
            )
        self._url_cache.update(fresh)


def _first(group: BaseExceptionGroup[WeightshipError]) -> WeightshipError:
    item: BaseException = group
    while isinstance(item, BaseExceptionGroup):
        item = item.exceptions[0]
    assert isinstance(item, WeightshipError)
    return item


#: re-orders pending jobs in place; True when the first can be had now
Ranker = Callable[[list[ChunkJob]], Awaitable[bool]]


class _Pool:
    """The chunks of one fetch not yet taken: ranked as they are taken, put back when deferred.

    ``take`` hands out the best pending job (after ``rank`` re-orders them, when there is a
    tracker), waits while every pending job is deferred, and returns ``None`` once every job was
    taken and none can come back (no job in flight). A job deferred for ``wait_limit`` seconds in
    all may not be deferred again: it goes up the tiers.

    While ``in_order()`` (a local server streams the version), the next job comes from the first
    ``window`` pending jobs in file order, rarest first among them: the loader gets the first layers
    first, and the swarm still spreads rare chunks. Without a streaming reader the order is
    untouched, so fleet fan-out (``bench/fanout.py``) keeps its rarest-first order.
    """

    def __init__(
        self,
        jobs: list[ChunkJob],
        rank: Ranker | None,
        wait_limit: float,
        recheck: float = 0.25,
        *,
        in_order: Callable[[], bool] = lambda: False,
        window: int = 8,
        order: Callable[[ChunkJob], tuple[int, int, int]] | None = None,
    ) -> None:
        self.pending = list(jobs)
        self.rank = rank
        self.in_order = in_order
        self.window = window
        self.order = order or (lambda job: (0, job.placements[0].file, job.placements[0].chunk))
        self.wait_limit = wait_limit
        self.recheck = recheck
        self._later: list[tuple[float, ChunkJob]] = []
        self._first_deferred: dict[str, float] = {}
        self._inflight = 0
        self._changed = asyncio.Event()

    async def take(self) -> ChunkJob | None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            due = [job for at, job in self._later if at <= now]
            if due:
                self._later = [(at, job) for at, job in self._later if at > now]
                self.pending.extend(due)
            wake = min((at for at, _job in self._later), default=now + 60.0)
            if self.pending:
                if await self._rank():
                    self._inflight += 1
                    return self.pending.pop(0)
                # Nothing we lack is anywhere to be had yet (the caches' grants are all taken): ask
                # again once the availability answer is renewed, not the tracker chunk by chunk.
                wake = min(wake, now + self.recheck)
            elif not self._later and self._inflight == 0:
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.0, wake - now))

    async def _rank(self) -> bool:
        """Put the best pending job first; whether it can be had now."""
        if not self.in_order():
            return self.rank is None or await self.rank(self.pending)
        self.pending.sort(key=self.order)
        head = self.pending[: self.window]
        ready = self.rank is None or await self.rank(head)
        self.pending[: len(head)] = head
        return ready

    def may_defer(self, job: ChunkJob) -> bool:
        """Whether ``job`` may still be put back (it has not waited ``wait_limit`` in all)."""
        first = self._first_deferred.get(job.digest)
        return self.wait_limit > 0 and (first is None or asyncio.get_running_loop().time() - first < self.wait_limit)

    def defer(self, job: ChunkJob, delay: float) -> None:
        """Put ``job`` back, to be taken no sooner than ``delay`` seconds from now."""
        now = asyncio.get_running_loop().time()
        self._first_deferred.setdefault(job.digest, now)
        self._later.append((now + delay, job))
        self._inflight -= 1
        self._changed.set()

    def done(self) -> None:
        """A taken job finished (placed or failed for good)."""
        self._inflight -= 1
        self._changed.set()


def _file_order(manifest: Manifest, job: ChunkJob) -> tuple[int, int, int]:
    """Side files (configs, indexes: read whole before a load can be planned) first, then file order."""
    first = job.placements[0]
    return int(manifest.files[first.file].safetensors is not None), first.file, first.chunk


_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


class _Buffers:
    """Chunk buffers, made on first use and reused for the rest of one fetch.

    Anonymous maps rather than ``bytearray``: nothing is zeroed up front, pages fault in as the
    bytes land, so the first request starts at once instead of after the whole pool is touched.
    """

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self._free: list[mmap.mmap] = []
        self._slots = asyncio.Semaphore(count)

    async def get(self) -> mmap.mmap:
        await self._slots.acquire()
        # Private, not shared (``mmap(-1, n)``'s default): plain anonymous memory is cheaper to fault in
        # and to free than the shmem pages a shared anonymous map is made of.
        return self._free.pop() if self._free else mmap.mmap(-1, self.size, flags=_PRIVATE)

    def put(self, buf: mmap.mmap) -> None:
        self._free.append(buf)
        self._slots.release()


def _read_local(source: LocalChunk, view: memoryview) -> None:
    path, offset, length = source
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            n = os.preadv(fd, [view[done:length]], offset + done)
            if n == 0:
                raise OSError(f"{path} is shorter than expected")
            done += n
    finally:
        os.close(fd)
