"""The chunk feed: the verified chunks of a version still being fetched, in arrival order.

A model server that cold-starts on a version this node does not hold yet need not wait for the
whole fetch: it reads each chunk as soon as the agent has verified it (``gpu_loader.streaming``).
The safety rule is the staging area's own: ``Staging.place`` writes a chunk's bytes to the file
being assembled only after their SHA-256 matched the manifest, and marks the chunk done only after
the write, so every chunk listed here holds verified bytes at the listed range of the listed file.
Nothing else of a staging file (sparse holes, chunks in flight) is ever listed.

"Written" here means in the file (the page cache), which every reader on this host sees; a crash
of the host takes the reader with it, and the agent re-hashes every journaled chunk when it resumes.

Each assembly of a version (one ``Staging``) is one *feed*, named by a random token: the order is
kept per feed, so a cursor counts in one feed only. A retried fetch or a restarted agent starts a
new feed, and a reader that asks with an old token gets the new feed from its start (every chunk
verified so far, those it already read included; it skips those).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.staging import Staging
from agent.store import VersionStore
from weightship.chunkfeed import LocalChunk, LocalChunkPage
from weightship.schemas import LocalVersion, LocalVersionState

__all__ = ["MAX_PAGE", "STREAMING_SECONDS", "ChunkFeeds"]

#: most chunks listed in one answer (the reader asks again at once for the rest)
MAX_PAGE = 4096
#: a version counts as streamed this long after a reader last asked for its chunks
STREAMING_SECONDS = 60.0


@dataclass
class _Feed:
    staging: Staging
    token: str = field(default_factory=lambda: secrets.token_hex(8))
    order: list[tuple[int, int]] = field(default_factory=list)
    seen: set[tuple[int, int]] = field(default_factory=set)

    def refresh(self) -> None:
        """Append the chunks verified since the last look, in (file, chunk) order within one look."""
        staging = self.staging
        # Copies of sets the placing threads update: one C-level copy each, atomic under the GIL.
        done = set(staging.done)
        for f in frozenset(staging.linked):
            done.update((f, c) for c in range(len(staging.manifest.files[f].chunks)))
        fresh = sorted(done - self.seen)
        self.order.extend(fresh)
        self.seen.update(fresh)


class ChunkFeeds:
    """One feed per version being assembled; used on the event loop only."""

    def __init__(self, stagings: Mapping[str, Staging], store: VersionStore) -> None:
        #: the assembler's stagings by digest (fetching, or left by a failed fetch)
        self.stagings = stagings
        self.store = store
        self._feeds: dict[str, _Feed] = {}
        self._asked: dict[str, float] = {}

    def streaming(self, digest: str) -> bool:
        """Whether a local reader follows ``digest``'s feed (the fetcher then fetches in file order)."""
        asked = self._asked.get(digest)
        return asked is not None and time.monotonic() - asked < STREAMING_SECONDS

    def page(self, digest: str, after: int, token: str, described: LocalVersion) -> LocalChunkPage:
        """What a reader at cursor ``after`` of feed ``token`` may read now (possibly nothing new)."""
        now = time.monotonic()
        if len(self._asked) > 64:  # digests asked for once and never again
            self._asked = {d: t for d, t in self._asked.items() if now - t < STREAMING_SECONDS}
        self._asked[digest] = now
        manifest = self.store.ready().get(digest)
        if manifest is not None:
            self._feeds.pop(digest, None)
            self._asked.pop(digest, None)
            total = sum(len(f.chunks) for f in manifest.files)
            return LocalChunkPage(
                digest=digest, state=LocalVersionState.ready, complete=True, chunks_total=total,
                path=str(self.store.path(digest)), feed=token, next=after,
            )  # fmt: skip
        staging = self.stagings.get(digest)
        if staging is None:
            self._feeds.pop(digest, None)
            return LocalChunkPage(digest=digest, state=described.state, reason=described.reason, feed=token, next=after)
        feed = self._feeds.get(digest)
        if feed is None or feed.staging is not staging:
            feed = self._feeds[digest] = _Feed(staging)
        feed.refresh()
        start = after if token == feed.token else 0
        start = min(max(start, 0), len(feed.order))
        end = min(len(feed.order), start + MAX_PAGE)
        files = staging.manifest.files
        size = staging.manifest.chunk_size
        chunks: list[LocalChunk] = []
        for f, c in feed.order[start:end]:
            entry = files[f]
            begin, stop = entry.chunk_range(c, size)
            chunks.append(
                LocalChunk(file=entry.path, chunk=c, offset=begin, length=stop - begin, path=str(staging.dir / entry.path))
            )
        return LocalChunkPage(
            digest=digest,
            state=described.state,
            reason=described.reason,
            feed=feed.token,
            next=end,
            chunks=chunks,
            chunks_total=sum(len(f.chunks) for f in files),
        )

    def news(self, page: LocalChunkPage, asked_feed: str, known_state: str) -> bool:
        """Whether ``page`` is worth answering at once: chunks, a new feed, readiness or a changed state."""
        return bool(page.chunks) or page.complete or page.feed != asked_feed or page.state.value != known_state
