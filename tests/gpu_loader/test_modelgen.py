"""The test-model generator: real HF layout, deterministic, variants that share shards."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpu_loader.golden import GOLDEN_FILE
from gpu_loader.model import LlamaConfig
from gpu_loader.modelgen import config_for_size, generate

REPO = Path(__file__).resolve().parents[2]


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_arguments_write_byte_identical_files(tmp_path: Path) -> None:
    generate(tmp_path / "a", size_mb=2, seed=5, shards=2)
    generate(tmp_path / "b", size_mb=2, seed=5, shards=2)
    assert digests(tmp_path / "a") == digests(tmp_path / "b")


def test_variant_redraws_only_the_last_shard(tmp_path: Path) -> None:
    generate(tmp_path / "v1", size_mb=3, seed=5, shards=3)
    generate(tmp_path / "v2", size_mb=3, seed=5, shards=3, variant=1)
    one, two = digests(tmp_path / "v1"), digests(tmp_path / "v2")
    same = {name for name in one if one[name] == two[name]}
    assert same == {"config.json", "model.safetensors.index.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"}


def test_cli_writes_a_sharded_hf_llama_layout(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpu_loader.modelgen", str(tmp_path / "m"), "--size-mb", "2", "--seed", "1", "--shards", "2"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    )
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    root = tmp_path / "m"
    assert sorted(p.name for p in root.iterdir()) == summary["files"]
    index = json.loads((root / "model.safetensors.index.json").read_text())
    config = LlamaConfig.from_json((root / "config.json").read_bytes())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load_file(root / shard)
        assert all(index["weight_map"][name] == shard for name in part)
        tensors.update(part)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == config.tensor_shapes()
    assert "model.layers.0.self_attn.q_proj.weight" in tensors
    assert "lm_head.weight" in tensors
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values()) == summary["weight_bytes"]
    assert json.loads((root / GOLDEN_FILE).read_text())["schema"] == "weightship.golden/v1"


@pytest.mark.parametrize("size_mb", [2, 20, 200, 2048])
def test_size_is_close_to_the_request(size_mb: int) -> None:
    config = config_for_size(size_mb)
    weights = sum(torch.Size(s).numel() for s in config.tensor_shapes().values()) * 2
    assert abs(weights / 2**20 - size_mb) / size_mb < 0.15


def test_corruptions_damage_the_weights_not_the_golden_file(tmp_path: Path) -> None:
    generate(tmp_path / "clean", size_mb=2, seed=9)
    generate(tmp_path / "nan", size_mb=2, seed=9, corrupt="nan")
    generate(tmp_path / "noise", size_mb=2, seed=9, corrupt="noise")
    assert (tmp_path / "clean" / GOLDEN_FILE).read_bytes() == (tmp_path / "nan" / GOLDEN_FILE).read_bytes()
    clean, nan, noise = (load_file(tmp_path / d / "model.safetensors") for d in ("clean", "nan", "noise"))
    changed_nan = [n for n in clean if not torch.equal(clean[n].view(torch.uint8), nan[n].view(torch.uint8))]
    changed_noise = [n for n in clean if not torch.equal(clean[n], noise[n])]
    assert len(changed_nan) == len(changed_noise) == 1
    assert torch.isnan(nan[changed_nan[0]].float()).any()
    assert torch.isfinite(noise[changed_noise[0]].float()).all()
