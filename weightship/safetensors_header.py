"""Parsing and validating the safetensors header.

A safetensors file is ``u64 little-endian header length`` + ``JSON header`` + ``data``. The
header maps tensor names to ``{dtype, shape, data_offsets: [begin, end]}`` (offsets relative to
the start of the data section) plus an optional ``__metadata__`` map of strings. We accept a file
only if the tensors tile the data section exactly: no overlaps, no holes, and the last tensor
ends at the end of the file. That rules out smuggled trailing bytes and aliasing tricks.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from weightship.errors import ManifestError

__all__ = [
    "DTYPE_SIZES",
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorInfo",
    "parse_header",
    "read_header",
    "validate_header",
]

#: The safetensors spec caps the header at 100 MB; larger is refused before it is read.
MAX_HEADER_BYTES = 100_000_000

#: Bytes per element for every dtype the safetensors format defines (sub-byte types excluded).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a safetensors file; offsets are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A validated safetensors header."""

    header_len: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data section."""
        return 8 + self.header_len


def _fail(where: str, why: str) -> ManifestError:
    return ManifestError(f"{where}: invalid safetensors file: {why}")


def parse_header(raw: bytes, header_len: int, file_size: int, where: str) -> SafetensorsHeader:
    """Validate the JSON header bytes of a file of ``file_size`` bytes."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(where, f"header is not UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _fail(where, "header is not a JSON object")
    return validate_header(doc, header_len, file_size, where)


def validate_header(doc: dict[str, Any], header_len: int, file_size: int, where: str) -> SafetensorsHeader:
    """Validate a decoded header document (tensor entries plus optional ``__metadata__``)."""
    doc = dict(doc)
    metadata_raw: Any = doc.pop("__metadata__", {})
    if not isinstance(metadata_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
    ):
        raise _fail(where, "__metadata__ must map strings to strings")
    tensors: list[TensorInfo] = []
    for name, entry in doc.items():
        tensors.append(_tensor(name, entry, where))
    data_len = file_size - 8 - header_len
    tensors.sort(key=lambda t: (t.begin, t.end))
    cursor = 0
    for tensor in tensors:
        if tensor.begin < cursor:
            raise _fail(where, f"tensor {tensor.name!r} overlaps the tensor before it")
        if tensor.begin > cursor:
            raise _fail(where, f"hole of {tensor.begin - cursor} bytes before tensor {tensor.name!r}")
        cursor = tensor.end
    if cursor != data_len:
        if cursor > data_len:
            raise _fail(
                where,
                f"tensors need {cursor} data bytes but the file holds {data_len}: truncated file",
            )
        raise _fail(where, f"{data_len - cursor} bytes after the last tensor: data must end at end of file")
    return SafetensorsHeader(header_len=header_len, tensors=tuple(tensors), metadata=dict(metadata_raw))


def _tensor(name: str, entry: Any, where: str) -> TensorInfo:
    if not name or len(name) > 1024:
        raise _fail(where, f"tensor name of length {len(name)} is not allowed")
    if not isinstance(entry, dict):
        raise _fail(where, f"tensor {name!r} entry is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise _fail(where, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _fail(where, f"tensor {name!r} has a malformed shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _fail(where, f"tensor {name!r} has malformed data_offsets {offsets!r}")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise _fail(
            where,
            f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes but dtype {dtype} and shape "
            f"{shape} need {expected}",
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])


def read_header(handle: BinaryIO, where: str) -> SafetensorsHeader:
    """Read and validate the header of an open safetensors file."""
    file_size = os.fstat(handle.fileno()).st_size
    handle.seek(0)
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise _fail(where, f"file is {file_size} bytes, shorter than the 8-byte length prefix")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise _fail(where, f"header of {header_len} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + header_len > file_size:
        raise _fail(where, f"header claims {header_len} bytes but the file is {file_size}: truncated file")
    raw = handle.read(header_len)
    return parse_header(raw, header_len, file_size, where)
