"""New versions of an existing checkpoint, for rollout rehearsals: a nudged copy and a NaN-poisoned one.

::

    python -m gpu_loader.variants SRC DEST --nudge      # one 1-D weight scaled by ~1.001: a good new version
    python -m gpu_loader.variants SRC DEST --nan        # NaN in one weight matrix: validation must refuse it

``modelgen`` makes versions of a generated model; this makes them of a real one (a directory as a
publisher would push it, e.g. a Hugging Face checkpoint). Only the weight file that holds the
chosen tensor is rewritten; every other file is copied byte for byte, so the new version shares
all other blobs with ``SRC`` and an agent fetches only the changed file. The tensor is chosen in
the last weight file (sorted names): the first 1-D floating tensor for ``--nudge`` (a norm scale:
outputs move a little, as after a fine-tune), the first floating matrix for ``--nan`` (1 in 7 of
its values become NaN), unless ``--tensor`` names one. The last line printed is JSON: what changed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["derive", "main"]


def _weight_files(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} holds no *.safetensors weight files")
    return files


def _pick(tensors: dict[str, torch.Tensor], matrix: bool) -> str:
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype.is_floating_point and (t.dim() >= 2 if matrix else t.dim() == 1):
            return name
    raise ValueError(f"no floating {'matrix' if matrix else '1-D tensor'} to change")


def derive(source: Path, dest: Path, *, how: str, tensor: str | None = None) -> dict[str, str]:
    """Copy ``source`` to ``dest`` with one tensor changed (``how``: ``nudge`` or ``nan``); what changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if how not in ("nudge", "nan"):
        raise ValueError(f"how must be 'nudge' or 'nan', not {how!r}")
    if dest.exists():
        raise ValueError(f"{dest} exists; pass a new directory")
    shutil.copytree(source, dest)
    files = _weight_files(dest)
    chosen: Path | None = None
    for path in files if tensor is not None else files[-1:]:
        with safe_open(str(path), "pt") as handle:
            if tensor is None or tensor in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                chosen = path
                break
    if chosen is None:
        raise ValueError(f"no weight file in {source} holds tensor {tensor!r}")
    with safe_open(str(chosen), "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    name = tensor or _pick(tensors, matrix=how == "nan")
    changed = tensors[name].clone()
    if how == "nudge":
        # At least 0.1 %, and enough to move a value in this dtype (bfloat16 steps by 0.8 %).
        changed.mul_(1 + max(1e-3, 2 * torch.finfo(changed.dtype).eps))
        if torch.equal(changed, tensors[name]):
            raise ValueError(f"scaling {name!r} changed none of its values; name another tensor with --tensor")
    else:
        changed.view(-1)[:: 7] = float("nan")
    tensors[name] = changed
    save_file(tensors, str(chosen), metadata=metadata or {"format": "pt"})
    return {"directory": str(dest), "file": chosen.name, "tensor": name, "change": how}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``python -m gpu_loader.variants SRC DEST --nudge|--nan``."""
    parser = argparse.ArgumentParser(prog="python -m gpu_loader.variants", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the checkpoint directory to start from")
    parser.add_argument("dest", type=Path, help="where to write the new version (must not exist)")
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--nudge", action="store_const", dest="how", const="nudge", help="scale one 1-D weight by ~1.001")
    kind.add_argument("--nan", action="store_const", dest="how", const="nan", help="write NaN into one weight matrix")
    parser.add_argument("--tensor", help="the tensor to change (default: chosen as the module docstring says)")
    args = parser.parse_args(argv)
    try:
        done = derive(args.source, args.dest, how=args.how, tensor=args.tensor)
    except ValueError as exc:
        print(f"variants: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(done, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
