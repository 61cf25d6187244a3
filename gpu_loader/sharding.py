"""Tensor-parallel row (dim 0) splits, planned as byte ranges.

A C-order tensor's rows are contiguous, so rank ``r`` of ``n`` needs exactly one byte range:
rows ``[r * rows / n, (r + 1) * rows / n)``. Only that range is read when verification does not
need whole chunks. Column (dim > 0) splits are strided and are not offered: read the whole tensor
and ``narrow`` it on the device, or publish a pre-sharded version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpu_loader.errors import ShardingError
from weightship.safetensors_header import TensorInfo

__all__ = ["ShardSpec", "TensorRange", "tensor_range"]


@dataclass(frozen=True)
class ShardSpec:
    """Rank ``rank`` of ``size`` tensor-parallel ranks; ``split`` picks the tensors cut on dim 0.

    ``split=None`` cuts every tensor of rank >= 1; pass a predicate on the tensor name to cut only
    the column-parallel weights (for example ``gpu_loader.model.column_parallel``).
    """

    rank: int
    size: int
    split: Callable[[str], bool] | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ShardingError(f"tensor-parallel rank {self.rank} of {self.size} is not valid: need 0 <= rank < size")

    def splits(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether tensor ``name`` of ``shape`` is cut on dim 0."""
        if self.size == 1 or not shape:
            return False
        return self.split(name) if self.split is not None else True


@dataclass(frozen=True, slots=True)
class TensorRange:
    """The bytes of a tensor that one rank needs, relative to the file's data section."""

    begin: int
    end: int
    shape: tuple[int, ...]


def tensor_range(info: TensorInfo, shard: ShardSpec | None, path: str) -> TensorRange:
    """The byte range and shape of ``info`` that ``shard`` needs (the whole tensor without one)."""
    if shard is None or not shard.splits(info.name, info.shape):
        return TensorRange(info.begin, info.end, info.shape)
    rows = info.shape[0]
    if rows % shard.size:
        raise ShardingError(
            f"tensor {info.name!r} in {path!r} has {rows} rows (shape {list(info.shape)}), which {shard.size} "
            "tensor-parallel ranks cannot split evenly on dim 0; use a rank count that divides it, or leave the "
            "tensor unsplit"
        )
    per_rank = rows // shard.size
    row_bytes = info.nbytes // rows if rows else 0
    begin = info.begin + shard.rank * per_rank * row_bytes
    shape = (per_rank, *info.shape[1:])
    return TensorRange(begin, begin + per_rank * row_bytes, shape)
