"""Manifest v1: building, canonical form, digests, and every kind of bad input."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from weightship.chunks import chunk_count
from weightship.digests import sha256_hex
from weightship.errors import ManifestError
from weightship.manifest import (
    MAX_MANIFEST_BYTES,
    SCHEMA,
    build_manifest,
    canonical_json,
    check_relative_path,
    parse_manifest,
)
from weightship.safetensors_header import MAX_HEADER_BYTES

CHUNK = 64 * 1024


def _raw_safetensors(path: Path, header: dict[str, Any], data: bytes, header_len: int | None = None) -> None:
    body = json.dumps(header).encode()
    length = len(body) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + body + data)


def test_manifest_records_files_chunks_and_tensors(make_model: Any) -> None:
    root = make_model(tensors_mb=1.0, shards=2)
    manifest = build_manifest(root, "tiny", chunk_size=CHUNK)
    paths = [f.path for f in manifest.files]
    assert paths == sorted(paths)
    assert "model.safetensors.index.json" in paths
    for entry in manifest.files:
        data = (root / entry.path).read_bytes()
        assert entry.size == len(data)
        assert entry.sha256 == sha256_hex(data)
        assert len(entry.chunks) == chunk_count(len(data), CHUNK)
        for i, digest in enumerate(entry.chunks):
            start, end = entry.chunk_range(i, CHUNK)
            assert digest == sha256_hex(data[start:end])
    tensors = manifest.tensors()
    assert "model.layers.1.mlp.up_proj.weight" in tensors
    entry, info = tensors["model.layers.1.mlp.up_proj.weight"]
    assert entry.safetensors is not None
    start = entry.safetensors.data_start + info.begin
    raw = (root / entry.path).read_bytes()[start : start + info.nbytes]
    assert len(raw) == info.nbytes


def test_identical_content_gives_identical_version_id(make_model: Any, tmp_path: Path) -> None:
    a = make_model("a", seed=3)
    b = make_model("b", seed=3)
    assert build_manifest(a, "m", chunk_size=CHUNK).digest == build_manifest(b, "m", chunk_size=CHUNK).digest
    c = make_model("c", seed=4)
    assert build_manifest(c, "m", chunk_size=CHUNK).digest != build_manifest(a, "m", chunk_size=CHUNK).digest


def test_manifest_bytes_are_canonical_and_digest_is_their_sha256(make_model: Any) -> None:
    manifest = build_manifest(make_model(), "tiny", chunk_size=CHUNK)
    doc = json.loads(manifest.raw)
    assert doc["schema"] == SCHEMA
    assert manifest.raw == canonical_json(doc)
    assert manifest.digest == "sha256:" + sha256_hex(manifest.raw)


def test_non_canonical_bytes_are_refused(make_model: Any) -> None:
    manifest = build_manifest(make_model(), "tiny", chunk_size=CHUNK)
    pretty = json.dumps(json.loads(manifest.raw), indent=2).encode()
    with pytest.raises(ManifestError, match="not canonical"):
        parse_manifest(pretty)


def test_empty_file_has_no_chunks(make_model: Any) -> None:
    root = make_model(extra_files={"empty.txt": b""})
    entry = build_manifest(root, "tiny", chunk_size=CHUNK).file("empty.txt")
    assert entry.size == 0
    assert entry.chunks == ()
    assert entry.sha256 == sha256_hex(b"")


def test_hidden_files_are_not_part_of_a_version(make_model: Any) -> None:
    root = make_model(extra_files={".cache/huggingface/x.lock": b"x", ".gitattributes": b"*"})
    paths = [f.path for f in build_manifest(root, "tiny", chunk_size=CHUNK).files]
    assert not any(p.startswith(".") for p in paths)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../etc/passwd", "traversal"),
        ("a/../../b", "traversal"),
        ("/abs/path", "absolute"),
        ("a//b", "empty"),
        ("./a", "traversal"),
        ("a\\b", "backslash"),
        (".hidden", "grammar"),
        ("a/-dash", "grammar"),
        ("sp ace", "grammar"),
        ("x" * 2000, "longer"),
        ("/".join(["d"] * 20), "deeper"),
    ],
)
def test_unsafe_paths_are_refused(path: str, why: str) -> None:
    with pytest.raises(ManifestError, match=why):
        check_relative_path(path)


def _tamper(raw: bytes, edit: Any) -> bytes:
    doc = json.loads(raw)
    edit(doc)
    return canonical_json(doc)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["files"][0].__setitem__("path", "../../evil"), "traversal"),
        (lambda d: d["files"][0].__setitem__("path", "/etc/passwd"), "absolute"),
        (lambda d: d["files"].append(dict(d["files"][0])), "duplicate file path"),
        (lambda d: d["files"][0].__setitem__("size", d["files"][0]["size"] + 10**9), "chunk digests"),
        (lambda d: d["files"][0].__setitem__("sha256", "zz"), "sha256"),
        (lambda d: d.__setitem__("chunk_size", 1000), "power of two"),
        (lambda d: d.__setitem__("schema", "other/v9"), "schema"),
        (lambda d: d.__setitem__("extra", 1), "unknown fields"),
        (lambda d: d.__setitem__("model", "Bad Name"), "invalid model name"),
        (lambda d: d.__setitem__("files", []), "files must be a list"),
    ],
)
def test_malformed_manifests_are_refused(make_model: Any, edit: Any, message: str) -> None:
    manifest = build_manifest(make_model(), "tiny", chunk_size=CHUNK)
    with pytest.raises(ManifestError, match=message):
        parse_manifest(_tamper(manifest.raw, edit))


def test_overlapping_tensors_in_a_manifest_are_refused(make_model: Any) -> None:
    manifest = build_manifest(make_model(), "tiny", chunk_size=CHUNK)

    def overlap(doc: dict[str, Any]) -> None:
        entry = next(f for f in doc["files"] if "safetensors" in f)
        tensors = entry["safetensors"]["tensors"]
        names = sorted(tensors, key=lambda n: tensors[n]["offsets"][0])
        tensors[names[1]]["offsets"] = tensors[names[0]]["offsets"]

    with pytest.raises(ManifestError, match=r"overlaps|hole|bytes"):
        parse_manifest(_tamper(manifest.raw, overlap))


def test_oversized_manifest_is_refused_before_parsing() -> None:
    with pytest.raises(ManifestError, match="exceeds"):
        parse_manifest(b" " * (MAX_MANIFEST_BYTES + 1))


def test_symlinks_in_a_model_directory_are_refused(make_model: Any) -> None:
    root = make_model()
    os.symlink("/etc/passwd", root / "passwd")
    with pytest.raises(ManifestError, match="symlink"):
        build_manifest(root, "tiny", chunk_size=CHUNK)


def test_symlinked_directory_is_refused(make_model: Any, tmp_path: Path) -> None:
    root = make_model()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "sub")
    with pytest.raises(ManifestError, match="symlink"):
        build_manifest(root, "tiny", chunk_size=CHUNK)


def test_case_colliding_paths_are_refused(make_model: Any) -> None:
    root = make_model(extra_files={"Tokenizer.json": b"{}", "tokenizer.json": b"{}"})
    with pytest.raises(ManifestError, match="duplicate"):
        build_manifest(root, "tiny", chunk_size=CHUNK)


def test_pickle_files_need_explicit_permission(make_model: Any) -> None:
    root = make_model(extra_files={"pytorch_model.bin": b"\x80\x04pickle"})
    with pytest.raises(ManifestError, match="pickle"):
        build_manifest(root, "tiny", chunk_size=CHUNK)
    manifest = build_manifest(root, "tiny", chunk_size=CHUNK, allow_pickle=True)
    assert manifest.file("pytorch_model.bin").size == 8


def test_truncated_safetensors_is_refused(make_model: Any) -> None:
    root = make_model()
    path = root / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ManifestError, match="truncated"):
        build_manifest(root, "tiny", chunk_size=CHUNK)


def test_header_over_100mb_is_refused_without_reading_it(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    _raw_safetensors(root / "model.safetensors", {}, b"", header_len=MAX_HEADER_BYTES + 1)
    with pytest.raises(ManifestError, match="exceeds"):
        build_manifest(root, "tiny", chunk_size=CHUNK)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlaps",
        ),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "hole"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "after the last tensor"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "need"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, b"\0" * 8, "malformed shape"),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
    ],
)
def test_invalid_safetensors_headers_are_refused(
    tmp_path: Path, header: dict[str, Any], data: bytes, message: str
) -> None:
    root = tmp_path / "m"
    root.mkdir()
    _raw_safetensors(root / "model.safetensors", header, data)
    with pytest.raises(ManifestError, match=message):
        build_manifest(root, "tiny", chunk_size=CHUNK)


def test_index_weight_map_must_match_the_shards(make_model: Any) -> None:
    root = make_model(shards=2)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ManifestError, match="lacks"):
        build_manifest(root, "tiny", chunk_size=CHUNK)


def test_tensor_missing_from_index_is_refused(make_model: Any) -> None:
    root = make_model(shards=2)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ManifestError, match="missing from weight_map"):
        build_manifest(root, "tiny", chunk_size=CHUNK)


def test_same_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    t = {"w": np.zeros(4, dtype=np.float32)}
    save_file(t, str(root / "a.safetensors"))
    save_file(t, str(root / "b.safetensors"))
    with pytest.raises(ManifestError, match="appears in both"):
        build_manifest(root, "tiny", chunk_size=CHUNK)


def test_multi_chunk_files_hash_in_parallel_and_match_serial(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    rng = np.random.default_rng(1)
    for i in range(3):
        (root / f"blob{i}.dat").write_bytes(rng.bytes(CHUNK * 5 + 123))
    parallel = build_manifest(root, "tiny", chunk_size=CHUNK, workers=4)
    serial = build_manifest(root, "tiny", chunk_size=CHUNK, workers=1)
    assert parallel.raw == serial.raw
    seen: list[int] = []
    build_manifest(root, "tiny", chunk_size=CHUNK, progress=seen.append)
    assert sum(seen) == sum(f.size for f in parallel.files)


def test_files_sharing_a_sha256_must_agree_on_size_and_chunks(make_model: Any) -> None:
    root = make_model(extra_files={"a.txt": b"same", "b.txt": b"same"})
    manifest = build_manifest(root, "tiny", chunk_size=CHUNK)
    assert len(manifest.blobs()) == len(manifest.files) - 1

    def contradict(doc: dict[str, Any]) -> None:
        entry = next(f for f in doc["files"] if f["path"] == "b.txt")
        entry["size"] = 3

    with pytest.raises(ManifestError, match="same sha256"):
        parse_manifest(_tamper(manifest.raw, contradict))
