"""Staging: verify before write, a journal that survives a crash (torn lines too), ENOSPC mapped."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.durability import is_unsynced, make_durable
from agent.staging import Staging
from agent.store import VersionStore
from tests.agent.local_versions import CHUNK, fill, install, manifest_of, small_tmpfs
from weightship.errors import DiskFullError, IntegrityError
from weightship.layout import read_verification
from weightship.manifest import build_manifest, canonical_json, parse_manifest


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


def test_a_file_that_only_claims_a_held_sha256_is_hashed_and_not_linked(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    store = VersionStore(tmp_path / "data")
    v1 = install(store, make_model("a", seed=1))
    held = next(f for f in v1.files if f.path.endswith(".safetensors"))
    # v2's weights claim v1's sha256 but their chunk digests describe other bytes (a forged manifest).
    doc = manifest_of(make_model("b", seed=2)).to_json()
    for entry in doc["files"]:
        if entry["path"] == held.path:
            entry["sha256"] = held.sha256
    v2 = parse_manifest(canonical_json(doc))
    staging = Staging(store.staging_dir, v2)
    staging.open()
    linked = staging.link_identical(store.local_files())
    index = next(i for i, f in enumerate(v2.files) if f.path == held.path)
    assert index not in staging.linked
    assert linked == sum(f.size for f in v2.files if f.path != held.path)  # config.json: same geometry
    assert {p.file for j in staging.jobs() for p in j.placements} == {index}
    assert not list(staging.dir.glob(".*.link")), "no temporary link is left behind"


def test_a_held_file_under_another_chunk_size_is_linked_once_hashed_under_this_one(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    store = VersionStore(tmp_path / "data")
    source = make_model("a", seed=1)
    v1 = install(store, source)
    v2 = build_manifest(source, "m", chunk_size=2 * CHUNK)
    staging = Staging(store.staging_dir, v2)
    staging.open()
    assert staging.link_identical(store.local_files()) == v2.total_size
    assert staging.jobs() == []
    weights = next(f for f in v2.files if f.path.endswith(".safetensors"))
    assert (staging.dir / weights.path).stat().st_ino == (store.path(v1.digest) / weights.path).stat().st_ino


def test_resume_hashes_a_linked_file_again_and_refetches_it_if_the_link_was_lost(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    source = make_model("a", tensors_mb=0.5)
    manifest = manifest_of(source)
    weights = next(i for i, f in enumerate(manifest.files) if f.path.endswith(".safetensors"))
    staging = Staging(tmp_path, manifest)
    staging.open()
    # A power loss kept the journal line of a link, but not the rename: the sparse file is there.
    with open(staging.journal_path, "a") as journal:
        journal.write(f"f {weights}\n")
    staging.close()
    again = Staging(tmp_path, manifest)
    again.open()
    assert weights in again.linked
    assert again.reverify() == 1
    assert weights not in again.linked
    assert {p.file for j in again.jobs() for p in j.placements} == set(range(len(manifest.files)))
    fill(again, source)
    again.finish()
    assert (again.dir / manifest.files[weights].path).read_bytes() == (source / manifest.files[weights].path).read_bytes()


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


def test_finish_without_sync_leaves_the_unsynced_marker_for_the_flusher(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    """A version is ready before it is flushed; its marker says so until ``make_durable`` ran."""
    source = make_model("a", tensors_mb=0.5)
    manifest = manifest_of(source)
    staging = Staging(tmp_path, manifest)
    staging.open()
    assert is_unsynced(staging.dir)  # marked before the first chunk is written
    fill(staging, source)
    staging.finish(sync=False)
    assert is_unsynced(staging.dir)
    record = read_verification(staging.dir)
    assert record is not None
    assert record.digest == manifest.digest
    make_durable(staging.dir)
    assert not is_unsynced(staging.dir)


def test_finish_with_sync_flushes_every_file_and_drops_the_marker(tmp_path: Path, make_model: Callable[..., Path]) -> None:
    """``finish()`` (``sync`` by default) flushes everything before the version can be installed."""
    source = make_model("a", tensors_mb=0.5)
    manifest = manifest_of(source)
    staging = Staging(tmp_path, manifest)
    staging.open()
    fill(staging, source)
    staging.finish()
    assert not is_unsynced(staging.dir)
    for entry in manifest.files:
        assert (staging.dir / entry.path).read_bytes() == (source / entry.path).read_bytes()
