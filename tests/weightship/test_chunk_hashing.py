"""``hash_files`` gives the same digests as hashing each file and each chunk on its own, in every mode."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from weightship.chunks import HASH_BLOCK, MIN_CHUNK_SIZE, hash_files

pytestmark = pytest.mark.timeout(60)

SIZES = (0, 1, MIN_CHUNK_SIZE, MIN_CHUNK_SIZE + 1, 3 * MIN_CHUNK_SIZE + 17)


@pytest.mark.parametrize(
    ("chunk_size", "workers"),
    [
        (MIN_CHUNK_SIZE, 1),  # one block per chunk, both digests on each reader
        (MIN_CHUNK_SIZE, 64),  # fewer multi-chunk files than workers: chunk digests on helper threads
        (2 * HASH_BLOCK, 1),  # several blocks per chunk
        (2 * HASH_BLOCK, 64),
    ],
)
def test_file_and_chunk_digests_match_hashlib_whatever_the_mode(tmp_path: Path, chunk_size: int, workers: int) -> None:
    sizes = (*SIZES, 2 * chunk_size, 2 * chunk_size + 5, 3 * chunk_size - 1)
    paths = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"f{i}"
        path.write_bytes(os.urandom(size))
        paths.append(path)
    for path, got in zip(paths, hash_files(paths, chunk_size, workers=workers), strict=True):
        data = path.read_bytes()
        assert got.size == len(data)
        assert got.sha256 == hashlib.sha256(data).hexdigest()
        expected = tuple(hashlib.sha256(data[i : i + chunk_size]).hexdigest() for i in range(0, len(data), chunk_size))
        assert got.chunks == expected, (path.name, len(data))
