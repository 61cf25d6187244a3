"""Streaming a version from the agent: follow its chunk feed and load while it is still fetched.

``stream_load`` long-polls ``GET /local/v1/versions/{digest}/chunks`` (``agent.chunkfeed``) and
reports each listed chunk to a ``StreamingPipeline`` (``gpu_loader.streaming``), which reads a
tensor's bytes only once every chunk they lie in was listed. Side files (``config.json``, a shard
index) are read whole when the load is planned, so planning waits until every chunk of them is
listed. The feed's answers also say where the fetch stands: a failed fetch (``state="failed"``)
does not fail the load; the agent retries by itself and the load waits for its chunks, while
``on_state`` tells the server what to show in its status. Once the version is installed
(``complete``), every chunk is ready in the version directory and the feed is no longer asked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_loader.agent_api import LocalAgent
from gpu_loader.loader import Loader, LoadStats, VerifyMode
from gpu_loader.streaming import StreamingSession, StreamProgress, streaming_session
from gpu_loader.version import Version
from weightship.backoff import DelaySequence
from weightship.chunkfeed import LocalChunkPage
from weightship.errors import WeightshipError
from weightship.layout import read_version_manifest
from weightship.logs import event

__all__ = ["StreamedLoad", "stream_load"]

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


class _Follower:
    """The feed's cursor and what it listed so far."""

    def __init__(self, agent: LocalAgent, digest: str, deployment: str, poll: float, on_state: OnState) -> None:
        self.agent = agent
        self.digest = digest
        self.deployment = deployment
        self.poll = poll
        self.on_state = on_state
        self.feed = ""
        self.after = 0
        self.state = ""
        self.reason = ""
        self.backoff = DelaySequence(initial=0.2, maximum=5.0)

    async def next(self) -> LocalChunkPage:
        """The next answer with news (retrying while the agent is unreachable)."""
        while True:
            try:
                page = await self.agent.chunks(
                    self.digest, self.deployment, after=self.after, feed=self.feed, state=self.state, seconds=self.poll
                )
            except WeightshipError as exc:
                delay = self.backoff.next_delay()
                self.on_state("agent_unavailable", exc.message)
                event(_log, "stream.agent_unavailable", logging.WARNING, error=exc.message, retry_in=f"{delay:.2f}")
                await asyncio.sleep(delay)
                continue
            self.backoff.reset()
            if page.feed != self.feed:
                event(_log, "stream.feed", digest=self.digest, feed=page.feed or "-", state=page.state.value)
            self.feed, self.after = page.feed, page.next
            if (page.state.value, page.reason) != (self.state, self.reason):
                self.state, self.reason = page.state.value, page.reason
                self.on_state(self.state, self.reason)
            return page


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
    on_state: OnState = lambda _s, _r: None,
    on_session: Callable[[StreamingSession], None] = lambda _s: None,
) -> StreamedLoad | None:
    """Load ``digest`` while the agent fetches it; ``None`` if it is already installed (load it as usual)."""
    follow = _Follower(agent, digest, deployment, poll_seconds, on_state)
    listed: list[tuple[str, int, str]] = []
    staging: Path | None = None
    while True:
        page = await follow.next()
        if page.complete:
            return None
        for chunk in page.chunks:
            listed.append((chunk.file, chunk.chunk, chunk.path))
            staging = Path(chunk.path[: -len(chunk.file)].rstrip("/"))
        if staging is None:
            continue
        version = Version(directory=staging, manifest=read_version_manifest(staging, digest))
        have = {(f, c) for f, c, _p in listed}
        side = [e for e in version.manifest.files if e.safetensors is None]
        if all((e.path, c) in have for e in side for c in range(len(e.chunks))):
            break
    session = streaming_session(loader, version, device=device, dtype=dtype, verify=verify, names=names)
    on_session(session)
    stream = session.stream
    for file, index, path in listed:
        stream.chunk_ready(file, index, path)

    async def feed() -> None:
        while True:
            page = await follow.next()
            if page.complete:
                assert page.path is not None
                stream.complete(page.path)
                return
            for item in page.chunks:
                stream.chunk_ready(item.file, item.chunk, item.path)

    feeder = asyncio.create_task(feed())
    loop = asyncio.get_running_loop()
    try:
        tensors = await loop.run_in_executor(None, dict, session)
    except BaseException:
        stream.fail(RuntimeError("the streaming load was stopped"))
        raise
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
    assert session.stats is not None
    return StreamedLoad(tensors, session.stats, version, session.progress)
