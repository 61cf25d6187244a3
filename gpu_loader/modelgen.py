"""Generate a small real Llama-style model in HF layout, with its golden validation file.

::

    python -m gpu_loader.modelgen DIR --size-mb 200 --seed 7 [--shards 3] [--variant 1]
                                      [--dtype bfloat16] [--corrupt nan|inf|noise]

writes ``config.json``, ``model.safetensors`` (or ``model-0000i-of-0000K.safetensors`` plus
``model.safetensors.index.json``) and ``weightship_validation.json`` (see ``golden``), then
prints one JSON line describing what it wrote.

Deterministic: every tensor is drawn from its own generator seeded by ``(seed, name)``, so the
same arguments give byte-identical files. ``--variant N`` (N > 0) makes "the next version" of
the same model: only the tensors in the *last* shard are drawn again (with ``(seed, variant,
name)``), so with ``--shards K`` the first K-1 shards and ``config.json`` are byte-identical to
variant 0's and a rollout moves only one shard. With one shard every tensor changes.

``--corrupt`` makes a genuinely bad version for tests and demos: the golden file is computed
from the clean weights, then one mid-stack layer is damaged (``nan``/``inf``: 1% of a weight's
elements; ``noise``: a weight replaced by noise 100x its scale). The files are internally
consistent (they publish and hash fine); only validation can tell.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu_loader.golden import GOLDEN_FILE, compute_golden
from gpu_loader.model import LlamaConfig, build_model

__all__ = ["CORRUPTIONS", "GeneratedModel", "config_for_size", "generate", "main"]

CORRUPTIONS = ("nan", "inf", "noise")
_MIB = 1024 * 1024
_PRESETS = (  # (min MiB, hidden, intermediate, heads, kv heads, vocab)
    (1024, 1024, 2816, 16, 8, 32000),
    (96, 512, 1408, 8, 4, 32000),
    (12, 256, 704, 4, 2, 8192),
    (0, 128, 352, 4, 2, 2048),
)


@dataclass(frozen=True)
class GeneratedModel:
    """What ``generate`` wrote."""

    directory: Path
    config: LlamaConfig
    files: list[str]
    weight_bytes: int
    seconds: float

    def to_json(self) -> dict[str, object]:
        """A JSON-ready summary."""
        return {
            "directory": str(self.directory),
            "files": self.files,
            "layers": self.config.num_hidden_layers,
            "hidden_size": self.config.hidden_size,
            "vocab_size": self.config.vocab_size,
            "dtype": self.config.torch_dtype,
            "weight_bytes": self.weight_bytes,
            "seconds": round(self.seconds, 3),
        }


def config_for_size(size_mb: float, dtype: str = "bfloat16") -> LlamaConfig:
    """A Llama configuration whose weights take about ``size_mb`` MiB in ``dtype``."""
    _min, hidden, inter, heads, kv_heads, vocab = next(p for p in _PRESETS if size_mb >= p[0])
    base = LlamaConfig(vocab, hidden, inter, 0, heads, kv_heads, torch_dtype=dtype)
    itemsize = base.dtype.itemsize
    per_layer = sum(
        math.prod(s)
        for n, s in LlamaConfig(vocab, hidden, inter, 1, heads, kv_heads).tensor_shapes().items()
        if ".layers." in n
    )
    fixed = (2 * vocab * hidden + hidden) * itemsize
    layers = max(1, round((size_mb * _MIB - fixed) / (per_layer * itemsize)))
    return LlamaConfig(vocab, hidden, inter, layers, heads, kv_heads, torch_dtype=dtype)


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _draw(name: str, shape: tuple[int, ...], key: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor in ``dtype``, and the same values in float32 (for computing the golden file)."""
    generator = torch.Generator().manual_seed(random.Random(key).getrandbits(63))
    out = torch.empty(shape, dtype=torch.float32)
    if _is_norm(name):
        out.uniform_(0.9, 1.1, generator=generator)
    else:
        # nn.Linear's default init scale (1/sqrt(fan_in)); embeddings like HF's 0.02 std.
        bound = 0.02 * math.sqrt(3) if "embed_tokens" in name else 1.0 / math.sqrt(shape[1])
        out.uniform_(-bound, bound, generator=generator)
    stored = out.to(dtype)
    out.copy_(stored)  # float32 holding exactly the stored values, without a second allocation
    return stored, out


def _shard_of(shapes: dict[str, tuple[int, ...]], shards: int) -> dict[str, int]:
    total = sum(math.prod(s) for s in shapes.values())
    placed: dict[str, int] = {}
    cursor = 0
    for name, shape in shapes.items():
        placed[name] = min(shards - 1, cursor * shards // total)
        cursor += math.prod(shape)
    used = set(placed.values())
    if len(used) != shards:
        raise ValueError(f"cannot spread {len(shapes)} tensors over {shards} shards; use fewer shards")
    return placed


def _corrupt(tensors: dict[str, torch.Tensor], config: LlamaConfig, how: str, seed: int) -> str:
    layer = config.num_hidden_layers // 2
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    target = tensors[name]
    generator = torch.Generator().manual_seed(seed)
    if how == "noise":
        bound = 100.0 / math.sqrt(target.shape[1])
        tensors[name] = torch.empty(target.shape).uniform_(-bound, bound, generator=generator).to(target.dtype)
    else:
        flat = target.clone().view(-1)
        picks = torch.randperm(flat.numel(), generator=generator)[: max(1, flat.numel() // 100)]
        flat[picks] = float("nan") if how == "nan" else float("inf")
        tensors[name] = flat.view(target.shape)
    return name


def generate(
    directory: str | Path,
    *,
    size_mb: float = 200.0,
    seed: int = 0,
    shards: int = 1,
    dtype: str = "bfloat16",
    variant: int = 0,
    corrupt: str | None = None,
    prompts: int = 2,
    prompt_len: int = 16,
) -> GeneratedModel:
    """Write a model directory (see the module docstring); returns what was written."""
    started = time.perf_counter()
    if corrupt is not None and corrupt not in CORRUPTIONS:
        raise ValueError(f"corrupt must be one of {CORRUPTIONS}, not {corrupt!r}")
    if shards < 1:
        raise ValueError("shards must be at least 1")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    config = config_for_size(size_mb, dtype)
    shapes = config.tensor_shapes()
    shard_of = _shard_of(shapes, shards)

    def key(name: str) -> str:
        redraw = variant and shard_of[name] == shards - 1
        return f"{seed}:{variant}:{name}" if redraw else f"{seed}:{name}"

    with ThreadPoolExecutor(max(1, min(4, torch.get_num_threads()))) as pool:
        drawn = dict(zip(shapes, pool.map(lambda n: _draw(n, shapes[n], key(n), config.dtype), shapes), strict=True))
    tensors = {n: pair[0] for n, pair in drawn.items()}

    model = build_model(config, dtype=torch.float32)
    model.load_state_dict({n: pair[1] for n, pair in drawn.items()}, assign=True)
    inputs = torch.randint(0, config.vocab_size, (prompts, prompt_len), generator=torch.Generator().manual_seed(seed))
    golden = compute_golden(model, inputs.tolist())
    del model, drawn
    if corrupt is not None:
        _corrupt(tensors, config, corrupt, seed)

    files = ["config.json", GOLDEN_FILE]
    (root / "config.json").write_text(json.dumps(config.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (root / GOLDEN_FILE).write_text(json.dumps(golden.to_json(), sort_keys=True) + "\n", encoding="utf-8")
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        files.append("model.safetensors")
    else:
        weight_map: dict[str, str] = {}
        for index in range(shards):
            shard_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: t for n, t in tensors.items() if shard_of[n] == index}
            save_file(part, str(root / shard_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, shard_name))
            files.append(shard_name)
        index_doc = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (root / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n", encoding="utf-8")
        files.append("model.safetensors.index.json")
    weight_bytes = sum(t.nbytes for t in tensors.values())
    return GeneratedModel(root, config, sorted(files), weight_bytes, time.perf_counter() - started)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``python -m gpu_loader.modelgen DIR ...``."""
    parser = argparse.ArgumentParser(prog="python -m gpu_loader.modelgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write the model (created if missing)")
    parser.add_argument("--size-mb", type=float, default=200.0, help="approximate weight size in MiB (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed; same arguments give byte-identical files")
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors shards (HF sharded layout if > 1)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--variant", type=int, default=0, help="N > 0: a new version re-drawing only the last shard")
    parser.add_argument("--corrupt", choices=CORRUPTIONS, help="damage a layer after computing the golden file")
    args = parser.parse_args(argv)
    try:
        made = generate(
            args.directory,
            size_mb=args.size_mb,
            seed=args.seed,
            shards=args.shards,
            dtype=args.dtype,
            variant=args.variant,
            corrupt=args.corrupt,
        )
    except ValueError as exc:
        print(f"modelgen: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(made.to_json(), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
