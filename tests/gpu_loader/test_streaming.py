"""Streaming loads: tensors come out as chunks are reported ready, in any order, bit-identical.

A "staging area" is built the way the agent builds one: every file sparse at its final size; a
chunk's bytes are written, then the chunk is reported ready. A chunk not reported yet holds junk
here (not zeros), so a load that read it before it was ready could not come out bit-identical.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_loader.errors import ChunkMismatchError
from gpu_loader.loader import Loader, LoadOptions, VerifyMode, load_state_dict
from gpu_loader.streaming import StreamingSession, streaming_session
from gpu_loader.version import open_version
from tests.gpu_loader.conftest import Versions
from tests.gpu_loader.staged_versions import manifest_of
from weightship.manifest import Manifest

pytestmark = pytest.mark.timeout(60)

Chunk = tuple[str, int]


def _staging(version: Path, target: Path) -> Manifest:
    """Files of ``version`` at their final size under ``target``: side files whole, weight files junk.

    Side files (config, the shard index) are read whole before a load is planned; a server waits
    for them first (``gpu_loader.streamfeed``).
    """
    manifest = manifest_of(version)
    for entry in manifest.files:
        path = target / entry.path
        path.parent.mkdir(parents=True, exist_ok=True)
        if entry.safetensors is None:
            path.write_bytes((version / entry.path).read_bytes())
        else:
            path.write_bytes(b"\xa5" * entry.size)
    return manifest


def _place(version: Path, target: Path, manifest: Manifest, chunk: Chunk, data: bytes | None = None) -> None:
    path, index = chunk
    start, end = manifest.file(path).chunk_range(index, manifest.chunk_size)
    with (version / path).open("rb") as src:
        src.seek(start)
        raw = src.read(end - start) if data is None else data
    fd = os.open(target / path, os.O_WRONLY)
    try:
        os.pwrite(fd, raw, start)
    finally:
        os.close(fd)


def _chunks(manifest: Manifest) -> list[Chunk]:
    return [(e.path, c) for e in manifest.files if e.safetensors is not None for c in range(len(e.chunks))]


def _stream(
    session: StreamingSession, feed: Callable[[], None]
) -> dict[str, torch.Tensor]:
    """Iterate ``session`` while ``feed`` reports chunks from another thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            feed()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        return dict(session)
    finally:
        thread.join(30)
        assert not errors, errors


@pytest.mark.parametrize("verify", ["full", "fast", "trust"])
def test_a_streamed_load_in_random_chunk_order_is_bit_identical_to_a_sequential_one(
    versions: Versions, tmp_path: Path, verify: VerifyMode
) -> None:
    expected = load_state_dict(versions.sharded)
    manifest = _staging(versions.sharded, tmp_path / "staging")
    order = _chunks(manifest)
    random.Random(7).shuffle(order)
    with Loader(LoadOptions(readers=2)) as loader:
        session = streaming_session(loader, open_version(tmp_path / "staging", manifest), verify=verify)

        def feed() -> None:
            for chunk in order:
                _place(versions.sharded, tmp_path / "staging", manifest, chunk)
                session.stream.chunk_ready(chunk[0], chunk[1], tmp_path / "staging" / chunk[0])

        got = _stream(session, feed)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert session.progress.tensors_loaded == len(expected)


def test_a_tensor_is_handed_out_only_once_every_chunk_it_spans_is_ready(versions: Versions, tmp_path: Path) -> None:
    manifest = _staging(versions.single, tmp_path / "staging")
    order = _chunks(manifest)
    with Loader(LoadOptions(readers=2)) as loader:
        session = streaming_session(loader, open_version(tmp_path / "staging", manifest))
        held = order[-1]
        for chunk in order[:-1]:
            _place(versions.single, tmp_path / "staging", manifest, chunk)
            session.stream.chunk_ready(chunk[0], chunk[1], tmp_path / "staging" / chunk[0])
        entry = manifest.file(held[0])
        start, _end = entry.chunk_range(held[1], manifest.chunk_size)
        assert entry.safetensors is not None
        waiting = {t.name for t in entry.safetensors.tensors if t.end + entry.safetensors.data_start > start}
        got: dict[str, torch.Tensor] = {}
        released = False
        for name, tensor in session:
            if not released:
                assert name not in waiting  # nothing of the missing chunk comes out before it is ready
            got[name] = tensor
            if not released and len(got) == session.progress.tensors_total - len(waiting):
                _place(versions.single, tmp_path / "staging", manifest, held)
                session.stream.chunk_ready(held[0], held[1], tmp_path / "staging" / held[0])
                released = True
    assert torch.equal(got[sorted(waiting)[0]], load_state_dict(versions.single)[sorted(waiting)[0]])


def test_bytes_that_do_not_match_their_chunk_fail_the_streamed_load_with_nothing_handed_out_for_them(
    versions: Versions, tmp_path: Path
) -> None:
    manifest = _staging(versions.single, tmp_path / "staging")
    order = _chunks(manifest)
    with Loader(LoadOptions(readers=2)) as loader:
        session = streaming_session(loader, open_version(tmp_path / "staging", manifest), verify="full")

        def feed() -> None:
            for chunk in order:
                # A bug upstream that reported junk as ready: the loader's own hashing catches it.
                if chunk != order[-1]:
                    _place(versions.single, tmp_path / "staging", manifest, chunk)
                session.stream.chunk_ready(chunk[0], chunk[1], tmp_path / "staging" / chunk[0])

        with pytest.raises(ChunkMismatchError):
            _stream(session, feed)


def test_a_failed_feed_stops_the_streamed_load_with_its_error(versions: Versions, tmp_path: Path) -> None:
    manifest = _staging(versions.single, tmp_path / "staging")
    with Loader(LoadOptions(readers=2)) as loader:
        session = streaming_session(loader, open_version(tmp_path / "staging", manifest))
        with pytest.raises(RuntimeError, match="fetch died"):
            _stream(session, lambda: session.stream.fail(RuntimeError("fetch died")))
