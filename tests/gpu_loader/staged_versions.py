"""Helpers for gpu_loader tests: agent-style version directories, and polling with a deadline."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

from weightship.digests import hex_of
from weightship.layout import MANIFEST_FILE, META_DIR, read_version_manifest, write_verification
from weightship.manifest import Manifest, build_manifest

#: torch-free byte sizes of the safetensors dtypes the hand-written files use.
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F16": 2, "BF16": 2, "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}

#: Small chunks, so that tensors span several chunks and chunks hold several tensors.
CHUNK = 256 * 1024


def stage(model_dir: Path, data_dir: Path, *, model: str = "tiny", chunk_size: int = CHUNK, verified: bool = True) -> Path:
    """Lay ``model_dir`` out as the agent does: ``versions/<hex>/`` with manifest and verification record."""
    manifest = build_manifest(model_dir, model, chunk_size=chunk_size)
    target = data_dir / "versions" / hex_of(manifest.digest)
    if not target.exists():
        shutil.copytree(model_dir, target)
        (target / META_DIR).mkdir(exist_ok=True)
        (target / META_DIR / MANIFEST_FILE).write_bytes(manifest.raw)
        if verified:
            write_verification(target, manifest)
    return target


def manifest_of(version: Path) -> Manifest:
    """The manifest stored in a staged version."""
    return read_version_manifest(version)


def write_safetensors(
    path: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]], *, data_start_mod16: int = 8
) -> int:
    """Write a safetensors file by hand, tensors back to back in the given order, with no padding
    between them, and the data section starting at ``data_start_mod16`` modulo 16 (stock writers
    pad the header to 8 bytes only, so 8 is what half of real files get). Returns the data start.
    """
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape, raw in tensors:
        count = 1
        for dim in shape:
            count *= dim
        assert len(raw) == count * ITEMSIZE[dtype], name
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((data_start_mod16 - 8 - len(text)) % 16)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(raw for *_, raw in tensors))
    return 8 + len(text)


def odd_tensors() -> dict[str, tuple[str, torch.Tensor]]:
    """Name -> (safetensors dtype, tensor), in file order: F32 after a 6-byte tensor (so at 2 mod 4
    in the file), FP8, integers and zero-size tensors."""
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed.weight": ("F32", torch.randn(512, 64, generator=g)),
        "model.odd_bias": ("BF16", torch.randn(3, generator=g).bfloat16()),  # 6 bytes: shifts what follows
        "model.unaligned.weight": ("F32", torch.randn(100, 10, generator=g)),  # at 2 mod 4 in the file
        "model.pad": ("BF16", torch.randn(1, generator=g).bfloat16()),  # back to 0 mod 8
        "model.fp8.weight": ("F8_E4M3", torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn)),
        "model.empty.weight": ("BF16", torch.empty(0, 16, dtype=torch.bfloat16)),
        "model.ids": ("I64", torch.arange(33, dtype=torch.int64)),
        "model.nothing": ("F64", torch.empty(0, dtype=torch.float64)),
        "model.proj.weight": ("BF16", torch.randn(256, 128, generator=g).bfloat16()),
        "model.big.weight": ("F32", torch.randn(256, 256, generator=g)),
    }


def stage_odd(root: Path) -> Path:
    """Write ``odd_tensors`` as one file whose data section starts at 8 mod 16, and stage it (64 KiB chunks)."""
    model = root / "model"
    model.mkdir()
    tensors = [
        (name, dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
        for name, (dtype, t) in odd_tensors().items()
    ]
    start = write_safetensors(model / "model.safetensors", tensors, data_start_mod16=8)
    assert start % 16 == 8
    return stage(model, root / "data", model="odd", chunk_size=64 * 1024)
