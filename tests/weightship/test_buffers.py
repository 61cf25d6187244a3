"""Hashing memory is a fixed buffer pool, and every exact read goes through ``read_exact``."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from weightship.buffers import BufferPool, read_exact
from weightship.chunks import HASH_BLOCK, chunk_ranges, hash_files
from weightship.errors import IntegrityError

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 * 1024


def _files(root: Path, count: int) -> list[Path]:
    """``count`` files of 0 to ~4.5 chunks, distinct content."""
    paths = []
    for i in range(count):
        path = root / f"f{i:03d}.bin"
        size = (i * 37 * 1024) % (CHUNK * 4 + CHUNK // 2)
        path.write_bytes(os.urandom(size))
        paths.append(path)
    return paths


def test_hashing_many_files_with_many_workers_never_holds_more_buffers_than_the_pool(tmp_path: Path) -> None:
    paths = _files(tmp_path, 60)
    pool = BufferPool(3, CHUNK)
    digests = hash_files(paths, CHUNK, workers=32, buffers=pool)
    assert pool.allocated <= 3
    assert pool.peak <= 3
    assert pool.in_use == 0  # every buffer came back
    for path, got in zip(paths, digests, strict=True):
        data = path.read_bytes()
        assert got.sha256 == hashlib.sha256(data).hexdigest()
        assert got.chunks == tuple(hashlib.sha256(data[a:b]).hexdigest() for a, b in chunk_ranges(len(data), CHUNK))


def test_a_one_buffer_pool_still_hashes_everything(tmp_path: Path) -> None:
    paths = _files(tmp_path, 12)
    pool = BufferPool(1, CHUNK)
    digests = hash_files(paths, CHUNK, workers=8, buffers=pool)
    assert [d.sha256 for d in digests] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert pool.peak == 1


@pytest.mark.parametrize(
    ("memory", "size", "wanted", "count"),
    [
        (1 << 30, 64 << 20, 2 * 64 + 64, 16),  # 64 cores cannot take 12 GiB of 64 MiB buffers
        (1 << 30, 64 << 20, 5, 5),  # few cores: what they can use
        (1 << 30, 4 << 30, 10, 1),  # a chunk larger than the budget: one at a time
        (256 << 10, 64 << 10, 1000, 4),
    ],
)
def test_the_pool_size_follows_the_memory_budget_not_the_core_count(
    memory: int, size: int, wanted: int, count: int
) -> None:
    assert BufferPool.within(memory, size, wanted).count == count


def test_a_pool_makes_threads_wait_rather_than_allocate() -> None:
    pool = BufferPool(2, 16)
    first, second = pool.acquire(), pool.acquire()
    got: list[bytearray] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # blocked: both buffers are out
    assert not got
    pool.release(first)
    waiter.join(timeout=10)
    assert len(got) == 1
    assert got[0] is first
    pool.release(second)
    pool.release(got[0])
    assert (pool.allocated, pool.peak, pool.in_use) == (2, 2, 0)


def test_a_file_shorter_than_promised_is_an_integrity_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(IntegrityError, match=r"short\.bin ended at byte 100, 28 bytes short"):
            read_exact(fd, memoryview(bytearray(128)), 0, str(path))
    finally:
        os.close(fd)


def test_read_exact_fills_the_whole_view_from_the_offset(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    data = os.urandom(300_000)
    path.write_bytes(data)
    view = memoryview(bytearray(200_000))
    fd = os.open(path, os.O_RDONLY)
    try:
        read_exact(fd, view, 50_000)
    finally:
        os.close(fd)
    assert bytes(view) == data[50_000:250_000]


@pytest.mark.parametrize("workers", [1, 4], ids=["both-digests-on-the-reader", "chunk-digests-on-a-helper"])
def test_chunks_larger_than_a_read_block_hash_to_the_same_digests(tmp_path: Path, workers: int) -> None:
    chunk = 2 * HASH_BLOCK
    path = tmp_path / "big.bin"
    data = os.urandom(2 * chunk + HASH_BLOCK + 3)  # blocks end mid-chunk, the last chunk is short
    path.write_bytes(data)
    (got,) = hash_files([path], chunk, workers=workers)
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert got.chunks == tuple(hashlib.sha256(data[a:b]).hexdigest() for a, b in chunk_ranges(len(data), chunk))
