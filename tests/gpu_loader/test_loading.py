"""Loading versions onto the CPU: what comes out, and what is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpu_loader.golden import GOLDEN_FILE, check_golden, parse_golden
from gpu_loader.loader import Loader, LoadOptions, LoadSession, VerifyMode, load_into_module, load_state_dict
from gpu_loader.model import LlamaConfig, build_model, column_parallel
from gpu_loader.sharding import ShardSpec
from tests.gpu_loader.conftest import Versions
from tests.gpu_loader.staged_versions import CHUNK, manifest_of
from tests.gpu_loader.tensors import assert_same


def reference(version: Path) -> dict[str, torch.Tensor]:
    """The weights as stock safetensors reads them."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(version.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("mapped", [False, True], ids=["owned", "mapped"])
@pytest.mark.parametrize("verify", ["full", "fast", "trust"])
def test_sharded_version_loads_bit_exact_in_every_mode(versions: Versions, verify: VerifyMode, mapped: bool) -> None:
    options = LoadOptions(block_size=64 * 1024, readers=3, cpu_mapped=mapped)
    with Loader(options) as loader:
        result = loader.load(versions.sharded, verify=verify)
    assert_same(result.tensors, reference(versions.sharded))
    assert result.stats.tensors == len(result.tensors)
    assert result.stats.files == 3


def test_full_verify_hashes_every_chunk_of_the_weights(versions: Versions) -> None:
    manifest = manifest_of(versions.sharded)
    weights = [f for f in manifest.files if f.path.endswith(".safetensors")]
    with Loader() as loader:
        stats = loader.load(versions.sharded, verify="full").stats
    assert stats.chunks_sha256 == sum(len(f.chunks) for f in weights)
    assert stats.bytes_read == sum(f.size for f in weights)


def test_trust_reads_only_tensor_bytes_and_hashes_nothing(versions: Versions) -> None:
    with Loader() as loader:
        stats = loader.load(versions.sharded, verify="trust").stats
    assert stats.chunks_sha256 == stats.chunks_crc32 == 0
    assert stats.bytes_read == stats.tensor_bytes


def test_fast_verify_hashes_once_then_checks_crc32_records(versions: Versions, tmp_path: Path) -> None:
    options = LoadOptions(checksum_dir=tmp_path / "crc")
    with Loader(options) as loader:
        first = loader.load(versions.sharded, verify="fast").stats
        second = loader.load(versions.sharded, verify="fast").stats
    assert first.chunks_sha256 > 0
    assert first.chunks_crc32 == 0
    assert second.chunks_sha256 == 0
    assert second.chunks_crc32 == first.chunks_sha256


def test_dtype_cast_applies_to_floating_weights(versions: Versions) -> None:
    tensors = load_state_dict(versions.single, dtype=torch.float32, verify="trust")
    ref = reference(versions.single)
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref[name].float()), name


@pytest.mark.parametrize("verify", ["full", "trust"])
def test_tensor_parallel_ranks_get_their_rows_and_reassemble(versions: Versions, verify: VerifyMode) -> None:
    ref = reference(versions.sharded)
    size = 2
    parts = []
    with Loader(LoadOptions(block_size=64 * 1024)) as loader:
        for rank in range(size):
            parts.append(loader.load(versions.sharded, verify=verify, shard=ShardSpec(rank, size, column_parallel)))
    for name, tensor in ref.items():
        if column_parallel(name):
            assert parts[0].tensors[name].shape[0] == tensor.shape[0] // size
            assert torch.equal(torch.cat([p.tensors[name] for p in parts]).view(torch.uint8), tensor.view(torch.uint8)), name
        else:
            assert torch.equal(parts[1].tensors[name].view(torch.uint8), tensor.view(torch.uint8)), name
    manifest = manifest_of(versions.sharded)
    needed = 0
    chunks: set[tuple[str, int]] = set()
    for entry in manifest.files:
        if entry.safetensors is None:
            continue
        for info in entry.safetensors.tensors:
            begin, end = info.begin, info.end
            if column_parallel(info.name):
                end = begin + info.nbytes // size  # rank 0's rows
            needed += end - begin
            start = entry.safetensors.data_start
            chunks.update((entry.path, c) for c in range((start + begin) // CHUNK, (start + end - 1) // CHUNK + 1))
    if verify == "trust":
        assert parts[0].stats.bytes_read == needed  # only this rank's rows
    else:
        # Chunks are verified whole, so a rank reads every chunk its rows touch, and only those.
        sizes = {e.path: e.size for e in manifest.files}
        assert parts[0].stats.bytes_read == sum(min(CHUNK, sizes[p] - c * CHUNK) for p, c in chunks)


def test_names_selects_a_subset(versions: Versions) -> None:
    wanted = ["lm_head.weight", "model.norm.weight"]
    tensors = load_state_dict(versions.sharded, names=wanted, verify="full")
    assert sorted(tensors) == wanted


def test_session_hands_out_each_tensor_once(versions: Versions) -> None:
    with Loader(LoadOptions(block_size=64 * 1024)) as loader:
        session = loader.session(versions.sharded, verify="full")
        names = [name for name, _ in session]
    assert len(names) == len(set(names)) == len(session.plan.slots)
    assert session.stats is not None
    assert session.stats.tensors == len(names)


def test_model_loaded_from_meta_reproduces_its_golden_outputs(versions: Versions) -> None:
    config = LlamaConfig.from_json((versions.sharded / "config.json").read_bytes())
    model = build_model(config, dtype=torch.float32)
    stats = load_into_module(model, versions.sharded, dtype=torch.float32, verify="full")
    assert stats.tensors == len(model.state_dict())
    assert all(p.device.type == "cpu" for p in model.parameters())
    result = check_golden(model, parse_golden((versions.sharded / GOLDEN_FILE).read_bytes()))
    assert result.passed, result.detail
    assert result.error == 0.0


def test_one_loader_serves_many_loads(versions: Versions) -> None:
    with Loader() as loader:
        for version in (versions.sharded, versions.variant, versions.sharded):
            result = loader.load(version, verify="fast")
            assert result.version.digest == manifest_of(version).digest


def test_manifest_can_be_passed_for_a_plain_directory(versions: Versions, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    for path in versions.single.iterdir():
        if path.is_file():
            (plain / path.name).write_bytes(path.read_bytes())
    manifest = manifest_of(versions.single)
    tensors = load_state_dict(plain, manifest=manifest, verify="full")
    assert_same(tensors, reference(versions.single))
    assert json.loads((plain / "config.json").read_bytes())["model_type"] == "llama"


def test_package_exports_its_public_api() -> None:
    import subprocess
    import sys

    code = "import gpu_loader; print(sorted(gpu_loader.__all__)); [getattr(gpu_loader, n) for n in gpu_loader.__all__]"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, check=True)
    assert "'Loader'" in out.stdout
    assert "'load_state_dict'" in out.stdout


def test_stopping_a_session_early_stops_its_threads(versions: Versions) -> None:
    import threading

    before = threading.active_count()
    with Loader(LoadOptions(block_size=64 * 1024, readers=3)) as loader:
        session = loader.session(versions.sharded, verify="full")
        for _name, _tensor in session:
            break
    assert threading.active_count() == before


def test_non_strict_module_load_ignores_extra_tensors(versions: Versions) -> None:
    config = LlamaConfig.from_json((versions.sharded / "config.json").read_bytes())
    smaller = build_model(LlamaConfig(**{**config.__dict__, "num_hidden_layers": config.num_hidden_layers - 1}))
    with Loader() as loader:
        result = loader.load_into(smaller, versions.sharded, strict=False, verify="trust")
    assert set(result.tensors) == set(smaller.state_dict())
    assert all(p.device.type == "cpu" for p in smaller.parameters())


def test_a_consumer_error_stops_the_session_threads(versions: Versions) -> None:
    import threading

    def consume(session: LoadSession) -> None:
        for name, _tensor in session:
            raise KeyError(name)

    before = threading.active_count()
    with Loader(LoadOptions(block_size=64 * 1024, readers=3)) as loader, pytest.raises(KeyError):
        consume(loader.session(versions.sharded, verify="full"))
    assert threading.active_count() == before
