"""Chunk geometry and parallel chunk hashing.

A version has one chunk size (a power of two). Chunk ``i`` of a file is the byte range
``[i * chunk_size, min((i + 1) * chunk_size, size))``; the last chunk is shorter, and an empty
file has no chunks. Hashing reads each file once: a reader thread per file fills a buffer with one
chunk, feeds the whole-file SHA-256 and hands the buffer to a pool that computes the chunk's
SHA-256 (``weightship.digests``). ``hashlib`` drops the GIL on large updates, so the threads use every core.

Every buffer comes from one ``BufferPool`` for the whole job, so hashing holds at most
``memory`` bytes of buffers (``DEFAULT_HASH_MEMORY``, or one chunk if a chunk is larger),
however many cores, readers and files there are: a reader waits for a buffer instead of
allocating one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from weightship.buffers import BufferPool, read_exact
from weightship.digests import sha256_hex, sha256_stream

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_HASH_MEMORY",
    "MAX_CHUNK_SIZE",
    "MIN_CHUNK_SIZE",
    "FileDigests",
    "chunk_count",
    "chunk_ranges",
    "hash_files",
    "is_valid_chunk_size",
]

DEFAULT_CHUNK_SIZE = 64 * 1024 * 1024
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 4 * 1024 * 1024 * 1024
#: Most bytes of buffers one hashing job holds (at least one chunk's worth).
DEFAULT_HASH_MEMORY = 1024 * 1024 * 1024

#: Called with the number of bytes just hashed; must be thread-safe.
Progress = Callable[[int], None]


def is_valid_chunk_size(chunk_size: int) -> bool:
    """Whether ``chunk_size`` is a power of two within the allowed range."""
    return MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE and chunk_size & (chunk_size - 1) == 0


def chunk_count(size: int, chunk_size: int) -> int:
    """Number of chunks a file of ``size`` bytes has."""
    return (size + chunk_size - 1) // chunk_size


def chunk_ranges(size: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` byte ranges of each chunk of a file of ``size`` bytes."""
    for start in range(0, size, chunk_size):
        yield start, min(start + chunk_size, size)


@dataclass(frozen=True, slots=True)
class FileDigests:
    """SHA-256 of a whole file and of each of its chunks (hex)."""

    size: int
    sha256: str
    chunks: tuple[str, ...]


def _hash_one(
    path: Path,
    chunk_size: int,
    pool: ThreadPoolExecutor,
    buffers: BufferPool,
    progress: Progress | None,
) -> FileDigests:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        whole = sha256_stream()
        futures: list[Future[str]] = []
        single = size <= chunk_size
        for start, end in chunk_ranges(size, chunk_size):
            buf = buffers.acquire()
            view = memoryview(buf)[: end - start]
            try:
                read_exact(fd, view, start, str(path))
            except BaseException:
                buffers.release(buf)
                raise
            if single:
                futures.append(pool.submit(sha256_hex, view))
            else:
                # Feed the whole-file hash before handing the buffer over: the pool returns it
                # to the free list as soon as the chunk hash is done.
                whole.update(view)
                futures.append(pool.submit(_hash_and_release, view, buf, buffers))
            if progress is not None:
                progress(end - start)
            if single:
                try:
                    digest = futures[0].result()
                finally:
                    buffers.release(buf)
                return FileDigests(size=size, sha256=digest, chunks=(digest,))
        chunks = tuple(f.result() for f in futures)
        return FileDigests(size=size, sha256=whole.hexdigest(), chunks=chunks)
    finally:
        os.close(fd)


def _hash_and_release(view: memoryview, buf: bytearray, buffers: BufferPool) -> str:
    try:
        return sha256_hex(view)
    finally:
        buffers.release(buf)


def hash_files(
    paths: Sequence[Path],
    chunk_size: int,
    workers: int | None = None,
    progress: Progress | None = None,
    *,
    memory: int = DEFAULT_HASH_MEMORY,
    buffers: BufferPool | None = None,
) -> list[FileDigests]:
    """Digests of each file in ``paths``, in order, reading every byte once.

    Buffers come from ``buffers``, or from a pool of at most ``memory`` bytes (at least one
    chunk): enough for every worker and reader to be busy when memory allows, fewer otherwise.
    """
    workers = workers or os.cpu_count() or 1
    readers = max(1, min(len(paths), workers))
    needed = max(1, min(chunk_size, max((p.stat().st_size for p in paths), default=0)))
    if buffers is None:
        buffers = BufferPool.within(memory, needed, 2 * workers + readers)
    elif buffers.size < needed:
        raise ValueError(f"hash buffers of {buffers.size} bytes cannot hold a {needed}-byte chunk")
    lock = threading.Lock()
    safe_progress: Progress | None = None
    if progress is not None:
        user_progress = progress

        def safe_progress(n: int) -> None:
            with lock:
                user_progress(n)

    with (
        ThreadPoolExecutor(workers, thread_name_prefix="ws-hash") as pool,
        ThreadPoolExecutor(readers, thread_name_prefix="ws-read") as reader_pool,
    ):
        jobs = [reader_pool.submit(_hash_one, p, chunk_size, pool, buffers, safe_progress) for p in paths]
        return [j.result() for j in jobs]
