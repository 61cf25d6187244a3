"""Chunk geometry and parallel chunk hashing.

A version has one chunk size (a power of two). Chunk ``i`` of a file is the byte range
``[i * chunk_size, min((i + 1) * chunk_size, size))``; the last chunk is shorter, and an empty
file has no chunks. Hashing reads each file once, in blocks of ``HASH_BLOCK`` bytes (never across
a chunk boundary) into reused buffers: a reader thread per file fills a block, feeds it to the
whole-file SHA-256 and then to its chunk's SHA-256, both reading the block while it is hot in
cache. With fewer multi-chunk files than cores, each such file's reader hands the block to the
file's helper thread for the chunk digest instead, while it goes on with the next block (two
threads per file; ``hashlib`` drops the GIL on large updates, so they use two cores).
A file of one chunk is hashed once (its chunk digest is its digest), and so is the first chunk of
every file: it is a prefix of the file, so its digest is the whole-file SHA-256's state at the
first chunk boundary, finalised on a copy (a file of ``n`` chunks costs ``2 - 1/n`` digests per
byte). All digests come from ``weightship.digests``.

Every buffer comes from one ``BufferPool`` for the whole job, so hashing holds at most
``memory`` bytes of buffers (``DEFAULT_HASH_MEMORY``; by default ``BLOCKS_PER_READER`` blocks
per reader, 8 MiB in all on 2 cores), however many cores, readers and files there are: a reader
waits for a buffer instead of allocating one.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from weightship.buffers import BufferPool, read_exact
from weightship.digests import sha256_stream

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
#: Bytes read and hashed at a time: small enough that a block is still in the core's L2 cache when
#: its second digest reads it (1 MiB: ~1.35 CPU-s/GB for both digests on this 2-core VM, against
#: ~1.5-1.85 with 4 MiB blocks and 2.2-2.6 with whole 64 MiB chunks), large enough that ``hashlib``
#: (which drops the GIL) dominates the per-block cost.
HASH_BLOCK = 1024 * 1024
#: Buffers per reader: one being read and hashed, the helper's, and slack between them.
BLOCKS_PER_READER = 4

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
    path: Path, chunk_size: int, block: int, split: bool, buffers: BufferPool, progress: Progress | None
) -> FileDigests:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size <= chunk_size:
            # One chunk: its digest is the file's, so each byte is hashed once, on this thread.
            digest = sha256_stream()
            for start, end in chunk_ranges(size, block):
                with buffers.buffer() as buf:
                    view = memoryview(buf)[: end - start]
                    read_exact(fd, view, start, str(path))
                    digest.update(view)
                if progress is not None:
                    progress(end - start)
            hexdigest = digest.hexdigest()
            return FileDigests(size=size, sha256=hexdigest, chunks=(hexdigest,) if size else ())
        if not split:
            return _hash_chunked_inline(fd, path, size, chunk_size, block, buffers, progress)
        return _hash_chunked(fd, path, size, chunk_size, block, buffers, progress)
    finally:
        os.close(fd)


def _hash_chunked_inline(
    fd: int, path: Path, size: int, chunk_size: int, block: int, buffers: BufferPool, progress: Progress | None
) -> FileDigests:
    """Both digests on this thread, the second reading the block while it is hot in this core's cache."""
    whole = sha256_stream()
    chunk = sha256_stream()
    chunks: list[str] = []
    for start, end in chunk_ranges(size, block):
        with buffers.buffer() as buf:
            view = memoryview(buf)[: end - start]
            read_exact(fd, view, start, str(path))
            whole.update(view)
            if start >= chunk_size:  # chunk 0's digest comes from ``whole`` (module docstring)
                chunk.update(view)
        if end == chunk_size:
            chunks.append(whole.copy().hexdigest())
        elif end % chunk_size == 0 or end == size:
            chunks.append(chunk.hexdigest())
            chunk = sha256_stream()
        if progress is not None:
            progress(end - start)
    return FileDigests(size=size, sha256=whole.hexdigest(), chunks=tuple(chunks))


def _hash_chunked(
    fd: int, path: Path, size: int, chunk_size: int, block: int, buffers: BufferPool, progress: Progress | None
) -> FileDigests:
    """Whole-file digest on this thread, chunk digests on a helper, one block apart over the same buffers.

    Chunk 0's digest is taken from the whole-file digest at the first boundary, so the helper
    starts at chunk 1.
    """
    whole = sha256_stream()
    blocks: queue.SimpleQueue[tuple[memoryview, bytearray, bool] | None] = queue.SimpleQueue()
    first = ""
    rest: list[str] = []
    helper = threading.Thread(target=_hash_chunks, args=(blocks, buffers, rest), name="ws-hash-chunks")
    helper.start()
    try:
        for start, end in chunk_ranges(size, block):
            buf = buffers.acquire()
            view = memoryview(buf)[: end - start]
            try:
                read_exact(fd, view, start, str(path))
                whole.update(view)
            except BaseException:
                buffers.release(buf)
                raise
            if start < chunk_size:
                view.release()
                buffers.release(buf)
                if end == chunk_size:
                    first = whole.copy().hexdigest()
            else:
                # The helper hashes this block into its chunk (and returns the buffer) while this
                # thread reads and hashes the next one.
                blocks.put((view, buf, end % chunk_size == 0 or end == size))
            if progress is not None:
                progress(end - start)
    finally:
        blocks.put(None)
        helper.join()
    return FileDigests(size=size, sha256=whole.hexdigest(), chunks=(first, *rest))


def _hash_chunks(
    blocks: queue.SimpleQueue[tuple[memoryview, bytearray, bool] | None], buffers: BufferPool, out: list[str]
) -> None:
    digest = sha256_stream()
    while (item := blocks.get()) is not None:
        view, buf, last = item
        try:
            digest.update(view)
        finally:
            view.release()
            buffers.release(buf)
        if last:
            out.append(digest.hexdigest())
            digest = sha256_stream()


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
    block): ``BLOCKS_PER_READER`` blocks for each of ``workers`` readers when memory allows.
    """
    workers = workers or os.cpu_count() or 1
    readers = max(1, min(len(paths), workers))
    block = min(chunk_size, HASH_BLOCK)
    # With a file of several chunks per core, each reader hashes both digests itself (fewest
    # threads, the second digest reads a block hot in this core's cache); with fewer such files
    # than cores, each one's chunk digests move to a helper thread so that every core works.
    split = sum(1 for p in paths if p.stat().st_size > chunk_size) < workers
    needed = max(1, min(block, max((p.stat().st_size for p in paths), default=0)))
    if buffers is None:
        buffers = BufferPool.within(memory, needed, BLOCKS_PER_READER * readers)
    elif buffers.size < needed:
        raise ValueError(f"hash buffers of {buffers.size} bytes cannot hold a {needed}-byte block")
    lock = threading.Lock()
    safe_progress: Progress | None = None
    if progress is not None:
        user_progress = progress

        def safe_progress(n: int) -> None:
            with lock:
                user_progress(n)

    with ThreadPoolExecutor(readers, thread_name_prefix="ws-read") as reader_pool:
        jobs = [reader_pool.submit(_hash_one, p, chunk_size, block, split, buffers, safe_progress) for p in paths]
        return [j.result() for j in jobs]
