"""The CUDA path: pinned staging ring, per-reader copy streams, events. Skipped without a GPU.

Run on a GPU host with ``bench/gpu_check.sh`` (or ``pytest -m cuda tests/gpu_loader``). Imports
nothing that needs pydantic, so it runs on a bare PyTorch image.
"""

from __future__ import annotations

import pytest
import torch

from gpu_loader.errors import ChunkMismatchError
from gpu_loader.golden import GOLDEN_FILE, check_golden, parse_golden
from gpu_loader.loader import Loader, LoadOptions
from gpu_loader.model import LlamaConfig, build_model, column_parallel
from gpu_loader.sharding import ShardSpec
from gpu_loader.validation import validate
from gpu_loader.version import open_version
from tests.gpu_loader.staged_versions import manifest_of

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

#: Small blocks and few staging buffers, so the ring wraps many times in one load.
TIGHT = LoadOptions(readers=4, block_size=64 * 1024, staging_buffers=5)


def cpu_reference(version) -> dict[str, torch.Tensor]:
    with Loader() as loader:
        return loader.load(version, verify="full").tensors


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("verify", ["full", "fast", "trust"])
def test_cuda_load_is_bit_exact_with_cpu(versions, verify) -> None:
    ref = cpu_reference(versions.sharded)
    with Loader(TIGHT) as loader:
        result = loader.load(versions.sharded, device="cuda:0", verify=verify)
    assert set(result.tensors) == set(ref)
    for name, tensor in result.tensors.items():
        assert tensor.device == torch.device("cuda", 0)
        assert same_bytes(tensor, ref[name]), name
    assert result.stats.device == "cuda:0"


def test_cuda_tensors_are_usable_on_the_current_stream_as_they_arrive(versions) -> None:
    ref = cpu_reference(versions.sharded)
    sums = {}
    with Loader(TIGHT) as loader:
        for name, tensor in loader.session(versions.sharded, device="cuda:0", verify="full"):
            sums[name] = tensor.float().sum().item()  # queued on the current stream, right away
    for name, value in sums.items():
        assert value == pytest.approx(ref[name].float().sum().item(), rel=1e-5, abs=1e-3), name


def test_cuda_cast_happens_on_the_device(versions) -> None:
    ref = cpu_reference(versions.single)
    with Loader(TIGHT) as loader:
        result = loader.load(versions.single, device="cuda:0", dtype=torch.float16, verify="trust")
    for name, tensor in result.tensors.items():
        assert tensor.dtype == torch.float16
        assert torch.equal(tensor.cpu(), ref[name].to(torch.float16)), name


def test_cuda_tensor_parallel_rank(versions) -> None:
    ref = cpu_reference(versions.sharded)
    with Loader(TIGHT) as loader:
        part = loader.load(versions.sharded, device="cuda:0", verify="trust", shard=ShardSpec(1, 2, column_parallel))
    for name, tensor in part.tensors.items():
        want = ref[name].chunk(2)[1] if column_parallel(name) else ref[name]
        assert same_bytes(tensor, want.contiguous()), name


def test_cuda_bad_chunk_is_refused_and_the_ring_survives(versions, fresh_copy) -> None:
    version = fresh_copy(versions.sharded)
    entry = manifest_of(version).file("model-00002-of-00003.safetensors")
    with open(version / entry.path, "r+b") as handle:
        handle.seek(entry.size // 2)
        byte = handle.read(1)
        handle.seek(entry.size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with Loader(TIGHT) as loader:
        with pytest.raises(ChunkMismatchError):
            loader.load(version, device="cuda:0", verify="full")
        # Every staging buffer came back: the same loader loads a good version afterwards.
        good = loader.load(versions.sharded, device="cuda:0", verify="full")
    assert len(good.tensors) == len(cpu_reference(versions.sharded))


def test_cuda_model_passes_validation_in_bfloat16(versions) -> None:
    version = open_version(versions.sharded)
    config = LlamaConfig.from_json(version.read_file("config.json"))
    model = build_model(config)
    with Loader() as loader:
        loader.load_into(model, versions.sharded, device="cuda:0", verify="fast")
    assert next(model.parameters()).device.type == "cuda"
    outcome = validate(model, version)
    assert outcome.passed, outcome.checks
    result = check_golden(model, parse_golden(version.read_file(GOLDEN_FILE)))
    assert result.passed, result.detail
