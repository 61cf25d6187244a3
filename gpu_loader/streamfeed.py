"""Streaming a version from the agent: follow its chunk feed and load while it is still fetched.

``ChunkStream`` long-polls ``GET /local/v1/versions/{digest}/chunks`` (``agent.chunkfeed``) and
reports each listed chunk to every attached ``StreamingSession`` (``gpu_loader.streaming``), which
reads a tensor's bytes only once every chunk they lie in was listed. ``start`` returns once the
staging area exists and every side file (``config.json``, a shard index, the golden file) is listed
whole: those are read whole when the model is built and the load planned. ``run`` then follows the
feed until the version is installed (``complete``: every chunk is in the version directory).

The feed's answers also say where the fetch stands: a failed fetch (``state="failed"``) does not
fail the load, since the agent retries by itself and the load waits for its chunks, and an agent
that cannot be reached is asked again with backoff; ``on_state`` tells the server what to show.
``stream_load`` is the one-call form.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_loader.agent_api import LocalAgent
from gpu_loader.loader import Loader, LoadStats, VerifyMode
from gpu_loader.streaming import StreamingLoader, StreamingSession, StreamProgress
from gpu_loader.version import Version
from weightship.backoff import DelaySequence
from weightship.chunkfeed import LocalChunkPage
from weightship.errors import WeightshipError
from weightship.layout import read_version_manifest
from weightship.logs import event

__all__ = ["ChunkStream", "StreamedLoad", "stream_load"]

_log = logging.getLogger(__name__)

#: called with (state, reason) whenever the feed's view of the fetch changes
OnState = Callable[[str, str], None]


@dataclass
class StreamedLoad:
    """A finished streaming load."""

    tensors: dict[str, torch.Tensor]
    stats: LoadStats
    version: Version
    progress: StreamProgress


class ChunkStream:
    """One version's chunk feed, reported to the sessions attached to it."""

    def __init__(
        self, agent: LocalAgent, digest: str, deployment: str, *, poll: float = 10.0, on_state: OnState | None = None
    ) -> None:
        self.agent = agent
        self.digest = digest
        self.deployment = deployment
        self.poll = poll
        self.on_state: OnState = on_state or (lambda _s, _r: None)
        self.feed = ""
        self.after = 0
        self.state = ""
        self.reason = ""
        self.version: Version | None = None
        #: the ready version directory, once installed
        self.installed: str | None = None
        self.sessions: list[StreamingSession] = []
        self._listed: list[tuple[str, int, str]] = []
        self._lock = threading.Lock()  # ``attach`` runs in the loading thread
        self._backoff = DelaySequence(initial=0.2, maximum=5.0)

    async def _next(self) -> LocalChunkPage:
        """The next answer with news (asking again, with backoff, while the agent cannot be reached)."""
        while True:
            try:
                page = await self.agent.chunks(
                    self.digest, self.deployment, after=self.after, feed=self.feed, state=self.state, seconds=self.poll
                )
            except WeightshipError as exc:
                delay = self._backoff.next_delay()
                self._state("agent_unavailable", exc.message)
                event(_log, "stream.agent_unavailable", logging.WARNING, error=exc.message, retry_in=f"{delay:.2f}")
                await asyncio.sleep(delay)
                continue
            self._backoff.reset()
            if page.feed != self.feed:
                event(_log, "stream.feed", digest=self.digest, feed=page.feed or "-", state=page.state.value)
            self.feed, self.after = page.feed, page.next
            self._state(page.state.value, page.reason)
            return page

    def _state(self, state: str, reason: str) -> None:
        if (state, reason) != (self.state, self.reason):
            self.state, self.reason = state, reason
            self.on_state(state, reason)

    def _take(self, page: LocalChunkPage) -> None:
        with self._lock:
            if page.complete:
                assert page.path is not None
                self.installed = page.path
                for session in self.sessions:
                    session.stream.complete(page.path)
                return
            for chunk in page.chunks:
                self._listed.append((chunk.file, chunk.chunk, chunk.path))
                for session in self.sessions:
                    session.stream.chunk_ready(chunk.file, chunk.chunk, chunk.path)

    async def start(self) -> Version | None:
        """The version being assembled, once its side files are listed whole; ``None`` if it is installed."""
        while True:
            page = await self._next()
            self._take(page)
            if page.complete:
                return None
            if not self._listed:
                continue
            file, _chunk, path = self._listed[0]
            staging = Path(path[: -len(file)].rstrip("/"))
            if self.version is None:
                self.version = Version(directory=staging, manifest=read_version_manifest(staging, self.digest))
            have = {(f, c) for f, c, _p in self._listed}
            side = [e for e in self.version.manifest.files if e.safetensors is None]
            if all((e.path, c) in have for e in side for c in range(len(e.chunks))):
                return self.version

    async def run(self) -> None:
        """Follow the feed until the version is installed."""
        while self.installed is None:
            self._take(await self._next())

    def attach(self, session: StreamingSession) -> None:
        """Report every chunk listed so far, and every later one, to ``session`` (from any thread)."""
        with self._lock:
            self.sessions.append(session)
            for file, chunk, path in self._listed:
                session.stream.chunk_ready(file, chunk, path)
            if self.installed is not None:
                session.stream.complete(self.installed)

    def loader(self, base: Loader) -> StreamingLoader:
        """A loader whose loads stream from this feed (sharing ``base``'s staging memory)."""
        return StreamingLoader(base, self.attach)


async def stream_load(
    agent: LocalAgent,
    digest: str,
    deployment: str,
    loader: Loader,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    verify: VerifyMode = "full",
    names: Iterable[str] | None = None,
    poll_seconds: float = 10.0,
    on_state: OnState | None = None,
    on_session: Callable[[StreamingSession], None] = lambda _s: None,
) -> StreamedLoad | None:
    """Load ``digest``'s tensors while the agent fetches it; ``None`` if it is already installed."""
    stream = ChunkStream(agent, digest, deployment, poll=poll_seconds, on_state=on_state)
    version = await stream.start()
    if version is None:
        return None
    streaming = stream.loader(loader)
    follower = asyncio.create_task(stream.run())
    sessions: list[StreamingSession] = []

    def load() -> StreamedLoad:
        session = streaming.session(version.directory, manifest=version.manifest, device=device, dtype=dtype,
                                    verify=verify, names=names)  # fmt: skip
        assert isinstance(session, StreamingSession)
        sessions.append(session)
        on_session(session)
        tensors = dict(session)
        assert session.stats is not None
        return StreamedLoad(tensors, session.stats, version, session.progress)

    try:
        return await asyncio.get_running_loop().run_in_executor(None, load)
    except BaseException:
        for session in sessions:
            session.stream.fail(RuntimeError("the streaming load was stopped"))
        raise
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
