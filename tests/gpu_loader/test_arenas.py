"""Where loaded tensors live on CPU: aligned arenas, casts without a memory peak, odd tensors, devices.

The file ``odd_version`` (conftest) writes by hand has its data section at 8 modulo 16 (as half of the
files stock safetensors writes do), a 6-byte tensor that shifts the next ones off their natural
alignment, FP8, integer and zero-size tensors: the cases a loader gets wrong first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from gpu_loader.loader import Loader, LoadOptions, VerifyMode, resolve_device
from gpu_loader.modelgen import generate
from gpu_loader.sharding import ShardSpec
from gpu_loader.staging import StagingRing
from tests.gpu_loader.conftest import Versions
from tests.gpu_loader.staged_versions import odd_tensors, stage
from tests.gpu_loader.tensors import same_bytes
from weightship.errors import ValidationError

REPO = Path(__file__).resolve().parents[2]
MODES = ["full", "fast", "trust"]
SMALL = LoadOptions(readers=3, block_size=16 * 1024)


def split(name: str) -> bool:
    return name.endswith(".weight")


def expected(name: str, tensor: torch.Tensor, shard: ShardSpec | None, dtype: torch.dtype | None) -> torch.Tensor:
    if shard is not None and shard.splits(name, tuple(tensor.shape)):
        tensor = tensor.chunk(shard.size)[shard.rank] if tensor.shape[0] else tensor
    if dtype is not None and tensor.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        tensor = tensor.to(dtype)
    return tensor.contiguous()


@pytest.mark.parametrize("shard", [None, ShardSpec(1, 2, split)], ids=["whole", "tp"])
@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["stored", "cast"])
@pytest.mark.parametrize("verify", MODES)
def test_owned_tensors_are_64_byte_aligned_when_the_data_section_is_not(odd_version: Path, verify: VerifyMode, dtype: torch.dtype | None, shard: ShardSpec | None) -> None:
    with Loader(SMALL) as loader:
        result = loader.load(odd_version, verify=verify, dtype=dtype, shard=shard)
    for name, (_, tensor) in odd_tensors().items():
        got = result.tensors[name]
        assert same_bytes(got, expected(name, tensor, shard, dtype)), name
        if got.numel():
            assert got.data_ptr() % 64 == 0, (name, got.data_ptr() % 64)


@pytest.mark.parametrize("mapped", [False, True], ids=["owned", "mapped"])
@pytest.mark.parametrize("verify", MODES)
def test_fp8_integer_and_zero_size_tensors_keep_their_dtype_and_shape_under_a_cast(odd_version: Path, verify: VerifyMode, mapped: bool) -> None:
    options = LoadOptions(readers=2, block_size=16 * 1024, cpu_mapped=mapped)
    with Loader(options) as loader:
        tensors = loader.load(odd_version, verify=verify, dtype=torch.float32).tensors
    assert tensors["model.fp8.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.ids"].dtype == torch.int64
    assert tensors["model.empty.weight"].shape == (0, 16)
    assert tensors["model.empty.weight"].dtype == torch.float32
    assert tensors["model.nothing"].shape == (0,)
    for name, (_, tensor) in odd_tensors().items():
        assert same_bytes(tensors[name], expected(name, tensor, None, torch.float32)), name


@pytest.mark.parametrize("shard", [None, ShardSpec(0, 2, split)], ids=["whole", "tp"])
@pytest.mark.parametrize("mapped", [False, True], ids=["owned", "mapped"])
@pytest.mark.parametrize("verify", MODES)
def test_casting_on_arrival_is_exact_in_every_mode(versions: Versions, verify: VerifyMode, mapped: bool, shard: ShardSpec | None) -> None:
    options = LoadOptions(readers=3, block_size=24 * 1024, cpu_mapped=mapped)
    with Loader() as plain:
        stored = plain.load(versions.sharded, verify="trust", shard=shard).tensors
    with Loader(options) as loader:
        cast = loader.load(versions.sharded, verify=verify, dtype=torch.float32, shard=shard).tensors
    assert set(cast) == set(stored)
    for name, tensor in stored.items():
        assert same_bytes(cast[name], tensor.float()), name


def test_one_scratch_buffer_is_enough_for_a_rank_that_hashes_other_ranks_rows(versions: Versions) -> None:
    options = LoadOptions(readers=3, block_size=16 * 1024, staging_buffers=1)
    with Loader(options) as loader:
        result = loader.load(versions.sharded, verify="full", dtype=torch.float32, shard=ShardSpec(1, 2, split))
    assert result.stats.tensors == len(result.tensors)
    assert result.stats.pinned_bytes == 0



def test_cpu_scratch_is_reused_last_in_first_out_so_untouched_buffers_stay_unfaulted() -> None:
    ring = StagingRing(4, 4096, pinned=False)
    never = threading.Event()
    first = ring.acquire(never)
    second = ring.acquire(never)
    assert first is not None
    assert second is not None
    ring.release(first)
    ring.release(second)
    taken = [ring.acquire(never) for _ in range(2)]
    assert taken == [second, first]  # the two already touched, not the two never used


PEAK_SCRIPT = r"""
import json, sys
import torch
from gpu_loader.loader import Loader, LoadOptions

def status(key):
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

version, verify = sys.argv[1], sys.argv[2]
with Loader(LoadOptions(readers=2, hash_workers=2, block_size=256 * 1024)) as loader:
    # Warm up first (imports, thread pools, allocator), so only the load itself is measured.
    loader.load(version, verify=verify, dtype=torch.bfloat16, names=["model.norm.weight"])
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM, the peak resident set, to the current one
    tensors = loader.load(version, verify=verify, dtype=torch.bfloat16).tensors
    peak = status("VmHWM")
output = sum(t.numel() * t.element_size() for t in tensors.values())
assert all(t.dtype == torch.bfloat16 for t in tensors.values())
print(json.dumps({"before": before, "peak": peak, "output": output}))
"""


@pytest.fixture(scope="module")
def f32_version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("f32")
    generate(root / "model", size_mb=48, seed=5, shards=2, dtype="float32")
    return stage(root / "model", root / "data")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("verify", MODES)
def test_loading_f32_as_bf16_peaks_near_the_output_size(f32_version: Path, verify: VerifyMode) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(f32_version), verify],
        capture_output=True, text=True, timeout=100, env=env, cwd=REPO, check=False,
    )
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    grown = figures["peak"] - figures["before"]
    # Before casting on arrival, the stored F32 arenas (2x the output) lived beside the copies: 3x.
    assert grown <= 1.2 * figures["output"], figures


@pytest.mark.parametrize(
    ("device", "count", "message"),
    [
        ("cuda:3", 2, "sees 2 CUDA device(s), cuda:0 to cuda:1"),
        ("cuda:2", 2, "pass an index below the count"),
        ("cuda:0", 0, "torch sees no CUDA device here"),
        ("mps", 1, "use 'cpu' or 'cuda:N'"),
    ],
)
def test_a_device_this_host_does_not_have_is_refused_clearly(device: str, count: int, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_device(device, device_count=count)


def test_a_device_index_the_host_has_is_kept() -> None:
    assert resolve_device("cuda:1", device_count=2) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_loading_onto_a_missing_gpu_fails_before_reading(versions: Versions) -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with Loader() as loader, pytest.raises(ValidationError, match="no CUDA device"):
        loader.session(versions.single, device="cuda:0")
