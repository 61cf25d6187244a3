"""Checking a chunk while it is read: SHA-256 against the manifest, or CRC32 against a record.

A chunk arrives as blocks, in order, from the one reader thread that reads it; each block may sit
in a staging buffer that must go back to the ring once hashed. ``ChunkCheck`` queues the blocks
and hashes them in order on a shared pool (``hashlib`` and ``zlib`` release the GIL on large
buffers, so hashing runs on every core while readers keep reading), releases each block as soon
as it is hashed, and reports a verdict when the last block is done.
"""

from __future__ import annotations

import threading
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from weightship.digests import sha256_stream

__all__ = ["ChunkCheck", "Expectation", "Verdict"]


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a chunk must hash to: a SHA-256 (hex) and/or a CRC32; ``want_crc`` computes CRC32 anyway."""

    sha256: str | None
    crc32: int | None
    want_crc: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of checking one chunk."""

    ok: bool
    sha256: str | None
    crc32: int | None
    error: BaseException | None = None


class ChunkCheck:
    """Hashes one chunk's blocks in arrival order on ``pool`` and calls ``on_done`` once."""

    def __init__(self, pool: Executor, expect: Expectation, on_done: Callable[[Verdict], None]) -> None:
        self._pool = pool
        self._expect = expect
        self._on_done = on_done
        self._sha = sha256_stream() if expect.sha256 is not None else None
        self._crc: int | None = 0 if (expect.crc32 is not None or expect.want_crc) else None
        self._lock = threading.Lock()
        self._queue: deque[tuple[Sequence[memoryview], Callable[[], None]]] = deque()
        self._running = False
        self._closed = False
        self._finished = False
        self._error: BaseException | None = None

    def feed(self, views: Sequence[memoryview], release: Callable[[], None]) -> None:
        """Queue the next block; ``release`` is called once its bytes have been hashed."""
        with self._lock:
            self._queue.append((views, release))
            if self._running:
                return
            self._running = True
        self._start()

    def close(self) -> None:
        """No more blocks: the verdict follows once the queued ones are hashed."""
        with self._lock:
            self._closed = True
            if self._running:
                return
            self._running = True
        self._start()

    def _start(self) -> None:
        try:
            self._pool.submit(self._drain)
        except RuntimeError:  # pool shut down: the load is being abandoned
            self._abandon()

    def _abandon(self) -> None:
        with self._lock:
            pending = list(self._queue)
            self._queue.clear()
            self._running = False
        for _views, release in pending:
            release()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    finish = self._closed and not self._finished
                    self._finished = self._finished or finish
                    break
                views, release = self._queue.popleft()
            try:
                for view in views:
                    if self._sha is not None:
                        self._sha.update(view)
                    if self._crc is not None:
                        self._crc = zlib.crc32(view, self._crc)
            except BaseException as exc:  # never leave the load waiting for a verdict
                self._error = self._error or exc
            finally:
                release()
        if finish:
            self._on_done(self._verdict())

    def _verdict(self) -> Verdict:
        sha = self._sha.hexdigest() if self._sha is not None else None
        ok = (self._expect.sha256 is None or sha == self._expect.sha256) and (
            self._expect.crc32 is None or self._crc == self._expect.crc32
        )
        return Verdict(ok=ok and self._error is None, sha256=sha, crc32=self._crc, error=self._error)
