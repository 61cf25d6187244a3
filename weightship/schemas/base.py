"""The building blocks of every schema: field types (digests, names, counts), the base model, roles, the error body."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "INT64_MAX",
    "Count",
    "Digest",
    "ErrorBody",
    "ErrorDetail",
    "HexDigest",
    "Label",
    "Measure",
    "Name",
    "Role",
    "Schema",
    "Share",
]

Digest = Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
HexDigest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Name = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,127}$")]
Label = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
Share = Annotated[float, Field(ge=0.0, le=1.0)]
#: the largest integer any field takes: what a signed 64-bit database column (BigInteger) holds
INT64_MAX = 2**63 - 1
#: a count, size, offset or epoch: never negative, never beyond a 64-bit column
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
#: a finite, non-negative measurement (seconds, GB/s)
Measure = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class Schema(BaseModel):
    """The base of every schema: unknown fields are refused, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Role(StrEnum):
    """What a token may do; ``admin`` may do everything."""

    publisher = "publisher"
    operator = "operator"
    agent = "agent"
    admin = "admin"
    read = "read"  # reads every GET route (and the status page at /ui/), writes nothing


class ErrorDetail(Schema):
    """What went wrong, for people (message) and programs (code)."""

    code: str
    message: str


class ErrorBody(Schema):
    """Body of every non-2xx response."""

    error: ErrorDetail
