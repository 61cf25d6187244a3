"""Bad input, each refused with an error that names what is wrong and where."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_loader.errors import (
    ChunkMismatchError,
    FileMismatchError,
    NotVerifiedError,
    ShardingError,
    TensorMismatchError,
    UnsupportedDtypeError,
)
from gpu_loader.loader import Loader, LoadOptions, LoadSession, VerifyMode, load_state_dict
from gpu_loader.model import LlamaConfig, build_model
from gpu_loader.sharding import ShardSpec
from tests.gpu_loader.conftest import Versions
from tests.gpu_loader.staged_versions import manifest_of
from weightship.errors import IntegrityError, ManifestError, NotFoundError
from weightship.layout import MANIFEST_FILE, META_DIR, VERIFIED_FILE
from weightship.manifest import Manifest, canonical_json, parse_manifest

SHARD = "model-00002-of-00003.safetensors"


def tensor_in(version: Path, path: str, pick: int = 0) -> tuple[str, int]:
    """A tensor of ``path`` (the ``pick``-th largest) and the absolute file offset of its middle byte."""
    entry = manifest_of(version).file(path)
    assert entry.safetensors is not None
    info = sorted(entry.safetensors.tensors, key=lambda t: -t.nbytes)[pick]
    return info.name, entry.safetensors.data_start + (info.begin + info.end) // 2


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("verify", ["full", "fast", "trust"])
def test_truncated_file_is_refused_before_reading(versions: Versions, fresh_copy: Callable[[Path], Path], verify: VerifyMode) -> None:
    version = fresh_copy(versions.sharded)
    shard = version / SHARD
    os.truncate(shard, shard.stat().st_size - 1000)
    with pytest.raises(FileMismatchError, match=rf"{SHARD}.*truncated"):
        load_state_dict(version, verify=verify)


def test_missing_weight_file_is_named(versions: Versions, fresh_copy: Callable[[Path], Path]) -> None:
    version = fresh_copy(versions.sharded)
    (version / SHARD).unlink()
    with pytest.raises(FileMismatchError, match=f"{SHARD}.*missing"):
        load_state_dict(version, verify="full")


def test_corrupted_chunk_is_refused_and_nothing_returned(versions: Versions, fresh_copy: Callable[[Path], Path]) -> None:
    version = fresh_copy(versions.sharded)
    name, offset = tensor_in(version, SHARD)
    flip_byte(version / SHARD, offset)
    with pytest.raises(ChunkMismatchError, match=rf"chunk \d+ .*{SHARD}.*SHA-256.*{name}"):
        load_state_dict(version, verify="full")


def test_streaming_never_hands_out_a_tensor_from_a_bad_chunk(versions: Versions, fresh_copy: Callable[[Path], Path]) -> None:
    version = fresh_copy(versions.sharded)
    name, offset = tensor_in(version, SHARD)
    flip_byte(version / SHARD, offset)
    seen: list[str] = []

    def consume(session: LoadSession) -> None:
        for tensor_name, _tensor in session:
            seen.append(tensor_name)

    with Loader(LoadOptions(readers=1)) as loader:
        session = loader.session(version, verify="full")
        with pytest.raises(ChunkMismatchError):
            consume(session)
    assert name not in seen


def test_fast_mode_catches_damage_after_its_record_was_made(versions: Versions, fresh_copy: Callable[[Path], Path], tmp_path: Path) -> None:
    version = fresh_copy(versions.sharded)
    options = LoadOptions(checksum_dir=tmp_path / "crc")
    with Loader(options) as loader:
        loader.load(version, verify="fast")  # verifies with SHA-256 and records CRC32
        name, offset = tensor_in(version, SHARD)
        before = (version / SHARD).stat()
        flip_byte(version / SHARD, offset)
        # Bit rot: same inode, size and mtime, so the CRC32 record still applies and must catch it.
        os.utime(version / SHARD, ns=(before.st_atime_ns, before.st_mtime_ns))
        with pytest.raises(ChunkMismatchError, match=rf"{SHARD}.*CRC32.*{name}"):
            loader.load(version, verify="fast")


def test_fast_mode_rehashes_a_file_modified_in_place(versions: Versions, fresh_copy: Callable[[Path], Path], tmp_path: Path) -> None:
    version = fresh_copy(versions.sharded)
    with Loader(LoadOptions(checksum_dir=tmp_path / "crc")) as loader:
        loader.load(version, verify="fast")
        name, offset = tensor_in(version, SHARD)
        flip_byte(version / SHARD, offset)  # a write moves mtime: the record no longer applies
        with pytest.raises(ChunkMismatchError, match=rf"{SHARD}.*SHA-256.*{name}"):
            loader.load(version, verify="fast")


def test_fast_mode_rehashes_a_replaced_file(versions: Versions, fresh_copy: Callable[[Path], Path], tmp_path: Path) -> None:
    version = fresh_copy(versions.sharded)
    options = LoadOptions(checksum_dir=tmp_path / "crc")
    with Loader(options) as loader:
        loader.load(version, verify="fast")
        name, offset = tensor_in(version, SHARD)
        replacement = version / "replacement.tmp"
        replacement.write_bytes((version / SHARD).read_bytes())
        flip_byte(replacement, offset)
        os.replace(replacement, version / SHARD)  # a new inode: its CRC32 record no longer applies
        with pytest.raises(ChunkMismatchError, match=rf"{SHARD}.*SHA-256.*{name}"):
            loader.load(version, verify="fast")


def _altered(version: Path, change: Callable[[dict[str, Any]], None]) -> Manifest:
    doc = json.loads((version / META_DIR / MANIFEST_FILE).read_bytes())
    change(doc)
    return parse_manifest(canonical_json(doc))


def test_manifest_header_disagreement_is_refused(versions: Versions) -> None:
    name, _ = tensor_in(versions.sharded, SHARD)

    def transpose(doc: dict[str, Any]) -> None:
        entry = next(f for f in doc["files"] if f["path"] == SHARD)
        shape = entry["safetensors"]["tensors"][name]["shape"]
        entry["safetensors"]["tensors"][name]["shape"] = shape[::-1]

    manifest = _altered(versions.sharded, transpose)
    # The chunk digests still match the file: only comparing headers finds the lie.
    with pytest.raises(FileMismatchError, match=rf"{name}.*{SHARD}.*header and manifest disagree"):
        load_state_dict(versions.sharded, manifest=manifest, verify="full")


def test_module_dtype_mismatch_is_named_before_reading(versions: Versions) -> None:
    config = LlamaConfig.from_json((versions.sharded / "config.json").read_bytes())
    model = build_model(config, dtype=torch.float16)
    with Loader() as loader, pytest.raises(TensorMismatchError, match=r"'model\..*' in 'model-0000\d-of-00003.safetensors' is BF16.*float16"):
        loader.load_into(model, versions.sharded, verify="full")


def test_module_shape_mismatch_is_named(versions: Versions) -> None:
    config = LlamaConfig.from_json((versions.sharded / "config.json").read_bytes())
    wrong = LlamaConfig(**{**config.__dict__, "intermediate_size": config.intermediate_size * 2})
    model = build_model(wrong)
    with Loader() as loader, pytest.raises(TensorMismatchError, match=r"mlp\.\w+_proj\.weight' in '.*' has shape"):
        loader.load_into(model, versions.sharded, verify="trust")


def test_module_missing_from_version_and_extra_in_version_are_named(versions: Versions) -> None:
    config = LlamaConfig.from_json((versions.sharded / "config.json").read_bytes())
    fewer = build_model(LlamaConfig(**{**config.__dict__, "num_hidden_layers": config.num_hidden_layers - 1}))
    more = build_model(LlamaConfig(**{**config.__dict__, "num_hidden_layers": config.num_hidden_layers + 1}))
    last = config.num_hidden_layers - 1
    with Loader() as loader:
        with pytest.raises(TensorMismatchError, match=rf"module does not have: 'model\.layers\.{last}\."):
            loader.load_into(fewer, versions.sharded)
        with pytest.raises(TensorMismatchError, match=rf"model\.layers\.{last + 1}\..*are not in version"):
            loader.load_into(more, versions.sharded)


@pytest.mark.parametrize("size", [3, 5])
def test_rank_count_that_does_not_divide_rows_is_refused(versions: Versions, size: int) -> None:
    with pytest.raises(ShardingError, match=rf"'model\..*' in '.*\.safetensors' has \d+ rows.*{size} tensor-parallel ranks"):
        load_state_dict(versions.sharded, shard=ShardSpec(0, size), verify="trust")


def test_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ShardingError, match="rank 2 of 2"):
        ShardSpec(2, 2)


def test_cast_to_a_non_float_dtype_is_refused(versions: Versions) -> None:
    with pytest.raises(UnsupportedDtypeError, match=r"torch\.int32"):
        load_state_dict(versions.single, dtype=torch.int32)


def test_unsupported_dtype_in_a_version_is_named(versions: Versions, tmp_path: Path) -> None:
    version = tmp_path / "c64"
    version.mkdir()
    name, _ = tensor_in(versions.single, "model.safetensors")
    doc = json.loads((versions.single / META_DIR / MANIFEST_FILE).read_bytes())
    entry = next(f for f in doc["files"] if f["path"] == "model.safetensors")
    entry["safetensors"]["tensors"][name]["dtype"] = "C64"  # complex64: in the safetensors spec, not loadable here
    (version / META_DIR).mkdir()
    (version / META_DIR / MANIFEST_FILE).write_bytes(canonical_json(doc))
    with pytest.raises(ManifestError, match=rf"{name}.*unknown dtype 'C64'"):
        load_state_dict(version)


def test_trust_without_agent_record_is_refused(versions: Versions, fresh_copy: Callable[[Path], Path]) -> None:
    version = fresh_copy(versions.sharded)
    (version / META_DIR / VERIFIED_FILE).unlink()
    with pytest.raises(NotVerifiedError, match="no agent has verified"):
        load_state_dict(version, verify="trust")


def test_trust_with_a_record_of_another_version_is_refused(versions: Versions, fresh_copy: Callable[[Path], Path]) -> None:
    version = fresh_copy(versions.sharded)
    (version / META_DIR / VERIFIED_FILE).write_bytes((versions.single / META_DIR / VERIFIED_FILE).read_bytes())
    with pytest.raises(NotVerifiedError, match="is for sha256:"):
        load_state_dict(version, verify="trust")


def test_unknown_tensor_name_is_named(versions: Versions) -> None:
    with pytest.raises(TensorMismatchError, match=r"'no\.such\.weight' are not in version"):
        load_state_dict(versions.sharded, names=["no.such.weight"])


def test_version_directory_whose_manifest_is_not_its_name_is_refused(versions: Versions, tmp_path: Path) -> None:
    impostor = tmp_path / versions.single.name
    (impostor / META_DIR).mkdir(parents=True)
    (impostor / META_DIR / MANIFEST_FILE).write_bytes((versions.sharded / META_DIR / MANIFEST_FILE).read_bytes())
    with pytest.raises(IntegrityError, match="hashes to"):
        load_state_dict(impostor)


def test_directory_without_manifest_says_how_to_proceed(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="pass its manifest explicitly"):
        load_state_dict(tmp_path)


def test_cuda_without_a_gpu_is_a_clear_error(versions: Versions) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(Exception, match="no CUDA device"):
        load_state_dict(versions.single, device="cuda:0")
