"""The CUDA path: pinned staging ring, per-reader copy streams, fences. Skipped without a GPU.

Run on a GPU host with ``bench/gpu_check.sh`` (or ``pytest -m cuda tests/gpu_loader/test_cuda.py``).
Imports nothing that needs pydantic or httpx, so it runs on a bare PyTorch image.

The race tests can fail: ``slow_copies`` queues a GPU sleep before every reader's copies on the
reader's own stream, with a ring of three 64 KiB buffers, so a buffer refilled before its copy
ran (a missing ring fence), or a tensor used before its copy landed (a missing consumer-stream
wait), shows up as wrong bytes, compared byte for byte in every verify mode. ``docs/loading.md``
("Checking on a GPU host") says how to see each of them fail with its fence removed.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_loader.errors import ChunkMismatchError
from gpu_loader.golden import GOLDEN_FILE, check_golden, parse_golden
from gpu_loader.loader import Loader, LoadOptions, VerifyMode
from gpu_loader.model import LlamaConfig, build_model, column_parallel
from gpu_loader.modelgen import generate
from gpu_loader.sharding import ShardSpec
from gpu_loader.targets import CudaTarget
from gpu_loader.validation import validate
from gpu_loader.version import open_version
from tests.gpu_loader.conftest import Versions
from tests.gpu_loader.staged_versions import manifest_of, odd_tensors, stage
from tests.gpu_loader.tensors import assert_same, same_bytes
from weightship.testing import eventually as poll_until

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]
MODES = ["full", "fast", "trust"]
BLOCK = 64 * 1024
#: Small blocks and three staging buffers, so the ring wraps many times in one load.
TIGHT = LoadOptions(readers=4, block_size=BLOCK, staging_buffers=3)
#: GPU clock cycles each reader's stream sleeps before its copies: about 2.5 ms at 2 GHz, against
#: tens of microseconds to read and hash a 64 KiB block from the page cache.
SLEEP_CYCLES = 5_000_000


def cpu_reference(version: Path, shard: ShardSpec | None = None) -> dict[str, torch.Tensor]:
    with Loader() as loader:
        return loader.load(version, verify="full", shard=shard).tensors


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reader's copies wait ``SLEEP_CYCLES`` on its own stream before they run."""
    original = CudaTarget.after_read

    def delayed(self: CudaTarget, reader: int, file: int, block, buf):  # type: ignore[no-untyped-def]
        with torch.cuda.device(self.device), torch.cuda.stream(self._streams[reader]):
            torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # torch leaves this private helper unannotated
        return original(self, reader, file, block, buf)

    monkeypatch.setattr(CudaTarget, "after_read", delayed)


@pytest.mark.parametrize("verify", MODES)
def test_staging_buffers_are_not_refilled_before_their_copy_ran(versions: Versions, slow_copies: None, verify: VerifyMode) -> None:
    ref = cpu_reference(versions.sharded)
    with Loader(TIGHT) as loader:
        result = loader.load(versions.sharded, device="cuda:0", verify=verify)
    assert all(t.device == torch.device("cuda", 0) for t in result.tensors.values())
    assert_same(result.tensors, ref)
    assert result.stats.device == "cuda:0"


@pytest.mark.parametrize("verify", MODES)
def test_tensors_used_on_a_non_default_stream_as_they_arrive_hold_their_bytes(versions: Versions, slow_copies: None, verify: VerifyMode) -> None:
    ref = cpu_reference(versions.sharded)
    consumer = torch.cuda.Stream(device="cuda:0")  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    got: dict[str, torch.Tensor] = {}
    with Loader(TIGHT) as loader, torch.cuda.stream(consumer):
        for name, tensor in loader.session(versions.sharded, device="cuda:0", verify=verify):
            got[name] = tensor.clone()  # queued on the consumer stream at once, before any sync
    consumer.synchronize()
    assert_same(got, ref)


@pytest.mark.parametrize("verify", MODES)
def test_tensor_parallel_rank_gets_exactly_its_rows(versions: Versions, slow_copies: None, verify: VerifyMode) -> None:
    shard = ShardSpec(1, 2, column_parallel)
    ref = cpu_reference(versions.sharded, shard)
    with Loader(TIGHT) as loader:
        part = loader.load(versions.sharded, device="cuda:0", verify=verify, shard=shard)
    assert_same(part.tensors, ref)
    whole = cpu_reference(versions.sharded)
    name = next(n for n in whole if column_parallel(n))
    assert same_bytes(part.tensors[name], whole[name].chunk(2)[1].contiguous())


@pytest.mark.parametrize("verify", MODES)
def test_cast_on_arrival_is_exact_and_peaks_near_the_output(tmp_path: Path, slow_copies: None, verify: VerifyMode) -> None:
    generate(tmp_path / "model", size_mb=16, seed=5, shards=2, dtype="float32")
    version = stage(tmp_path / "model", tmp_path / "data")
    ref = {n: t.to(torch.bfloat16) for n, t in cpu_reference(version).items()}
    with Loader(TIGHT) as loader:
        loader.load(version, device="cuda:0", verify=verify, names=["model.norm.weight"])  # warm up
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated(0)
        torch.cuda.reset_peak_memory_stats(0)
        result = loader.load(version, device="cuda:0", verify=verify, dtype=torch.bfloat16)
        peak = torch.cuda.max_memory_allocated(0) - baseline
    assert_same(result.tensors, ref)
    output = sum(t.numel() * t.element_size() for t in result.tensors.values())
    assert TIGHT.readers is not None
    landing = TIGHT.readers * BLOCK  # one block per reader where cast pieces land before their cast
    assert peak <= 1.2 * output + landing, (peak, output)


def test_odd_file_aligned_fp8_kept_zero_size_tensors_loaded(odd_version: Path) -> None:
    with Loader(TIGHT) as loader:
        tensors = loader.load(odd_version, device="cuda:0", verify="full", dtype=torch.float16).tensors
    for name, (_, want) in odd_tensors().items():
        got = tensors[name]
        if want.dtype in (torch.float64, torch.float32, torch.bfloat16):
            want = want.to(torch.float16)
        assert same_bytes(got, want), name
        if got.numel():
            assert got.data_ptr() % 256 == 0, (name, got.data_ptr() % 256)
    assert tensors["model.fp8.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.empty.weight"].shape == (0, 16)


def test_a_copy_that_raises_still_fences_its_staging_buffer(versions: Versions, monkeypatch: pytest.MonkeyPatch) -> None:
    fences: list[object] = []
    original = CudaTarget.after_read

    def failing(self: CudaTarget, reader: int, file: int, block, buf):  # type: ignore[no-untyped-def]
        if block.start >= self.plan.files[file].entry.size // 2 and not fences:
            # A destination too short for the last piece: the copies before it are already queued.
            self.arenas[file] = self.arenas[file][: block.pieces[-1].arena_offset or 0]
        try:
            return original(self, reader, file, block, buf)
        except RuntimeError:
            fences.append(buf.staging.event)  # read before the pipeline hands the buffer back
            raise

    monkeypatch.setattr(CudaTarget, "after_read", failing)
    with Loader(TIGHT) as loader:
        with pytest.raises(RuntimeError):
            loader.load(versions.single, device="cuda:0", verify="trust")
        assert fences, "no copy failed"
        assert fences[0] is not None, "the failed copy's buffer went back to the ring without a fence"
        ring = loader._ring
        assert ring is not None
        assert ring.free_count() == ring.count


def test_bad_chunk_is_refused_and_the_ring_survives(versions: Versions, fresh_copy: Callable[[Path], Path]) -> None:
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
        ring = loader._ring
        assert ring is not None
        assert ring.free_count() == ring.count
        good = loader.load(versions.sharded, device="cuda:0", verify="full")
    assert_same(good.tensors, cpu_reference(versions.sharded))


class Boom(Exception):
    pass


@pytest.mark.parametrize("how", ["break", "raise"])
def test_stopping_early_leaves_no_threads_a_full_ring_and_memory_at_baseline(versions: Versions, slow_copies: None, how: str) -> None:
    threads = threading.active_count()
    with Loader(TIGHT) as loader:
        loader.load(versions.sharded, device="cuda:0", verify="trust", names=["model.norm.weight"])  # builds the ring
        torch.cuda.synchronize()
        gc.collect()
        baseline = torch.cuda.memory_allocated(0)
        session = loader.session(versions.sharded, device="cuda:0", verify="full")
        try:
            for _name, _tensor in session:
                if how == "raise":
                    raise Boom
                break
        except Boom:
            pass
        del session, _tensor
        gc.collect()
        poll_until(lambda: threading.active_count() == threads, 10, "the load's threads to end")
        ring = loader._ring
        assert ring is not None
        assert ring.free_count() == ring.count
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated(0) == baseline


def test_pinned_ring_is_exact_capped_shared_and_given_back(versions: Versions) -> None:
    stats = torch.cuda.host_memory_stats
    before = stats().get("allocated_bytes.current", 0)
    options = LoadOptions(readers=4, block_size=BLOCK, staging_buffers=10, pinned_limit=3 * BLOCK)
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0"]
    ref = cpu_reference(versions.single)
    with Loader(options) as loader:
        for device in devices:
            result = loader.load(versions.single, device=device, verify="full")
            assert_same(result.tensors, ref)
            assert result.stats.pinned_bytes == 3 * BLOCK  # capped, exact, one ring for every device
        del result
        assert stats().get("allocated_bytes.current", 0) - before == 3 * BLOCK
    assert stats().get("allocated_bytes.current", 0) == before


CONTEXT_SCRIPT = r"""
import sys
import torch
from gpu_loader.loader import Loader, LoadOptions
with Loader(LoadOptions(readers=4, block_size=64 * 1024, staging_buffers=3)) as loader:
    loader.load(sys.argv[1], device="cuda:1", verify="full")
print("context-on-gpu0", torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_load_onto_cuda1_creates_no_context_on_gpu0(versions: Versions) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", CONTEXT_SCRIPT, str(versions.single)],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "context-on-gpu0 False True" in out.stdout, out.stdout


def test_model_passes_validation_in_bfloat16(versions: Versions) -> None:
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
