"""Chunk checks (ordered hashing on a pool) and the fast-mode CRC32 record store."""

from __future__ import annotations

import hashlib
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpu_loader.checksums import ChecksumRecord, ChecksumStore
from gpu_loader.verifying import ChunkCheck, Expectation, Verdict

DIGEST = "sha256:" + "ab" * 32
DATA = bytes(range(256)) * 4096  # 1 MiB


def run_check(expect: Expectation, pieces: list[bytes]) -> tuple[Verdict, int]:
    verdicts: list[Verdict] = []
    released = []
    done = threading.Event()

    def on_done(v: Verdict) -> None:
        verdicts.append(v)
        done.set()

    with ThreadPoolExecutor(4) as pool:
        check = ChunkCheck(pool, expect, on_done)
        for piece in pieces:
            check.feed([memoryview(piece)], lambda: released.append(1))
        check.close()
        assert done.wait(10)
    return verdicts[0], len(released)


def split(data: bytes, n: int) -> list[bytes]:
    step = len(data) // n
    return [data[i : i + step] for i in range(0, len(data), step)]


def test_blocks_are_hashed_in_order_and_all_released() -> None:
    verdict, released = run_check(Expectation(sha256=hashlib.sha256(DATA).hexdigest(), crc32=None, want_crc=True), split(DATA, 64))
    assert verdict.ok
    assert verdict.crc32 == zlib.crc32(DATA)
    assert released == 64


def test_wrong_bytes_give_a_failed_verdict() -> None:
    damaged = DATA[:1000] + b"\x00" + DATA[1001:]
    verdict, released = run_check(Expectation(sha256=hashlib.sha256(DATA).hexdigest(), crc32=None), split(damaged, 8))
    assert not verdict.ok
    assert verdict.sha256 == hashlib.sha256(damaged).hexdigest()
    assert released == 8


def test_crc_only_check() -> None:
    assert run_check(Expectation(sha256=None, crc32=zlib.crc32(DATA)), split(DATA, 4))[0].ok
    assert not run_check(Expectation(sha256=None, crc32=zlib.crc32(DATA) ^ 1), split(DATA, 4))[0].ok


def test_record_round_trips_and_is_tied_to_file_identity(tmp_path: Path) -> None:
    store = ChecksumStore(tmp_path)
    record = ChecksumRecord(DIGEST)
    record.add("model.safetensors", (1, 2, 3, 4), 0, 123)
    assert store.write(record)
    again = store.read(DIGEST)
    assert again.expected("model.safetensors", (1, 2, 3, 4), 0) == 123
    assert again.expected("model.safetensors", (1, 2, 3, 5), 0) is None  # file changed: no trust
    assert again.expected("model.safetensors", (1, 2, 3, 4), 1) is None


def test_unreadable_record_is_empty_and_unwritable_store_is_not_an_error(tmp_path: Path) -> None:
    store = ChecksumStore(tmp_path)
    (tmp_path / f"{'ab' * 32}.json").write_text("{not json")
    assert store.read(DIGEST).files == {}
    blocked = tmp_path / "file"
    blocked.write_text("x")
    record = ChecksumRecord(DIGEST)
    record.add("a", (1, 1, 1, 1), 0, 1)
    assert ChecksumStore(blocked / "sub").write(record) is False


@pytest.mark.parametrize("doc", ['{"schema": "other"}', '{"schema": "weightship.gpu_loader.crc32/v1", "digest": "sha256:' + "cd" * 32 + '"}'])
def test_record_of_another_schema_or_version_is_ignored(tmp_path: Path, doc: str) -> None:
    (tmp_path / f"{'ab' * 32}.json").write_text(doc)
    assert ChecksumStore(tmp_path).read(DIGEST).files == {}
