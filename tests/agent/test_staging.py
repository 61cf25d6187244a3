"""Staging: verify before write, a journal that survives a crash (torn lines too), ENOSPC mapped."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.staging import Staging
from agent.store import VersionStore
from tests.agent.local_versions import fill, install, manifest_of, small_tmpfs
from weightship.errors import DiskFullError, IntegrityError
from weightship.layout import read_verification


def test_bytes_that_do_not_match_are_never_written(tmp_path: Path, make_model: Callable[..., Path]) -> None:
    manifest = manifest_of(make_model("a"))
    staging = Staging(tmp_path, manifest)
    staging.open()
    job = next(j for j in staging.jobs() if j.length > 100)
    with pytest.raises(IntegrityError, match="hash to"):
        staging.place(job, memoryview(b"\x01" * job.length))
    entry = manifest.files[job.placements[0].file]
    with open(staging.dir / entry.path, "rb") as handle:
        handle.seek(job.blob_offset)
        assert handle.read(job.length) == bytes(job.length)
    assert not staging.done
    assert staging.journal_path.read_text() == ""


def test_journal_resumes_after_a_crash_and_ignores_a_torn_last_line(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    source = make_model("a", tensors_mb=0.5)
    manifest = manifest_of(source)
    first = Staging(tmp_path, manifest)
    first.open()
    jobs = first.jobs()
    for job in jobs[:3]:
        entry = manifest.files[job.placements[0].file]
        with open(source / entry.path, "rb") as handle:
            handle.seek(job.blob_offset)
            first.place(job, memoryview(handle.read(job.length)))
    with open(first.journal_path, "a") as journal:
        journal.write("c 1 ")  # a kill -9 in the middle of appending a line
    # no close(): the process died
    second = Staging(tmp_path, manifest)
    second.open()
    assert second.reverify() == 0
    assert len(second.done) == 3
    assert len(second.jobs()) == len(jobs) - 3
    fill(second, source)
    second.finish()
    record = read_verification(second.dir)
    assert record is not None
    assert record.digest == manifest.digest


def test_resume_rehashes_journaled_chunks_and_forgets_damaged_ones(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    source = make_model("a", tensors_mb=0.5)
    manifest = manifest_of(source)
    staging = Staging(tmp_path, manifest)
    staging.open()
    fill(staging, source)
    staging.close()
    weights = next(f for f in manifest.files if f.path.endswith(".safetensors"))
    with open(staging.dir / weights.path, "r+b") as handle:  # e.g. a power loss that kept the journal line only
        handle.seek(5)
        handle.write(b"\xff\xff\xff")
    again = Staging(tmp_path, manifest)
    again.open()
    assert again.reverify() == 1
    assert [(p.file, p.chunk) for j in again.jobs() for p in j.placements] == [(manifest.files.index(weights), 0)]


def test_identical_files_are_hard_linked_from_a_ready_version(tmp_path: Path, make_model: Callable[..., Path]) -> None:
    store = VersionStore(tmp_path / "data")
    v1 = install(store, make_model("a", seed=1))
    v2 = manifest_of(make_model("b", seed=2))  # same config.json, different weights
    staging = Staging(store.staging_dir, v2)
    staging.open()
    linked = staging.link_identical(store.local_files())
    shared = [f for f in v2.files if f.sha256 in {g.sha256 for g in v1.files}]
    assert linked == sum(f.size for f in shared) > 0
    for entry in shared:
        assert (staging.dir / entry.path).stat().st_ino == (store.path(v1.digest) / entry.path).stat().st_ino
    assert all(p.file not in {v2.files.index(f) for f in shared} for j in staging.jobs() for p in j.placements)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs (needs permission to mount; skipped otherwise)."""
    with small_tmpfs(tmp_path / "tiny", "512k") as mount:
        yield mount


def test_a_real_enospc_while_writing_a_chunk_is_a_disk_full_error(
    tiny_disk: Path, make_model: Callable[..., Path]
) -> None:
    source = make_model("a", tensors_mb=0.5)
    manifest = manifest_of(source)
    staging = Staging(tiny_disk, manifest)
    staging.open()  # files are sparse: nothing allocated yet
    stat = os.statvfs(tiny_disk)
    (tiny_disk / "filler").write_bytes(bytes(stat.f_bavail * stat.f_frsize - 8192))
    with pytest.raises(DiskFullError, match="disk full while writing"):
        fill(staging, source)
