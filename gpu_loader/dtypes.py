"""Safetensors dtype names to torch dtypes, and which casts the loader makes.

Only floating-point weights are cast when a target dtype is asked for: integer and boolean
tensors (token ids, masks, quantisation tables) keep their dtype, and FP8 tensors are never
cast because their meaning depends on scales stored beside them.
"""

from __future__ import annotations

import torch

from gpu_loader.errors import UnsupportedDtypeError

__all__ = ["CAST_TARGETS", "cast_itemsize", "cast_target", "check_cast_target", "torch_dtype"]

_TORCH: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
}

#: Floating dtypes that may be cast, and that a load may be asked to cast to.
CAST_TARGETS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def torch_dtype(name: str, tensor: str, path: str) -> torch.dtype:
    """The torch dtype of safetensors dtype ``name``; a clear error naming tensor and file if none."""
    try:
        return _TORCH[name]
    except KeyError:
        raise UnsupportedDtypeError(
            f"tensor {tensor!r} in {path!r} has dtype {name!r}, which gpu_loader cannot hold in torch; "
            f"supported: {', '.join(sorted(_TORCH))}"
        ) from None


def check_cast_target(dtype: torch.dtype | None) -> None:
    """Refuse a requested cast target that is not a plain floating dtype."""
    if dtype is not None and dtype not in CAST_TARGETS:
        names = ", ".join(sorted(str(d) for d in CAST_TARGETS))
        raise UnsupportedDtypeError(f"cannot cast weights to {dtype}: choose one of {names}, or no dtype")


def cast_target(source: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor stored as ``source`` ends up in when ``requested`` is asked for."""
    if requested is None or source not in CAST_TARGETS:
        return source
    return requested


def cast_itemsize(name: str, requested: torch.dtype | None) -> int | None:
    """The item size of safetensors dtype ``name`` when a load asking for ``requested`` casts it, else ``None``."""
    source = _TORCH.get(name)
    if source is None or cast_target(source, requested) == source:
        return None
    return source.itemsize
