"""Errors gpu_loader raises, each a subclass of the shared ``weightship.errors`` tree.

Split by what the caller should do: an ``IntegrityError`` means the bytes on disk are not the
version the manifest describes (re-fetch the version); a ``ValidationError`` means the request
does not fit the version (fix the module, the dtype or the shard layout).
"""

from __future__ import annotations

from weightship.errors import IntegrityError, TemporaryError, ValidationError

__all__ = [
    "AgentUnavailableError",
    "ChunkMismatchError",
    "FileMismatchError",
    "GoldenFileError",
    "NotVerifiedError",
    "ShardingError",
    "TensorMismatchError",
    "UnsupportedDtypeError",
]


class ChunkMismatchError(IntegrityError):
    """A chunk's bytes do not hash to the digest the manifest (or the checksum record) holds."""

    code = "chunk_mismatch"


class FileMismatchError(IntegrityError):
    """A file's size or safetensors header disagrees with the manifest (truncated, replaced)."""

    code = "file_mismatch"


class NotVerifiedError(IntegrityError):
    """``verify="trust"`` without a verification record from the agent that matches the version."""

    code = "not_verified"


class TensorMismatchError(ValidationError):
    """A tensor is missing, or its dtype or shape differs from what the module expects."""

    code = "tensor_mismatch"


class ShardingError(ValidationError):
    """A tensor-parallel split that does not fit a tensor (rank/size does not divide dim 0)."""

    code = "sharding"


class UnsupportedDtypeError(ValidationError):
    """A dtype that torch cannot hold, or a cast the loader refuses to make."""

    code = "unsupported_dtype"


class GoldenFileError(ValidationError):
    """The model's validation (golden) file is malformed."""

    code = "golden_file"


class AgentUnavailableError(TemporaryError):
    """The agent's local API did not answer; retry after ``delay`` seconds."""
