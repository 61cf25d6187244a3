"""Manifest v1: the one module that builds, serialises, parses and validates a version's manifest.

A version *is* its manifest. The manifest is canonical JSON (sorted keys, no insignificant
whitespace, UTF-8) and the version id is ``sha256:`` of exactly those bytes, so identical
content always yields the same id and any re-serialisation would be detected. It holds content
only::

    {
      "schema": "weightship.manifest/v1",
      "model": "llama-tiny",
      "chunk_size": 67108864,
      "metadata": {"family": "llama"},
      "files": [                       # sorted by path
        {"path": "model-00001-of-00002.safetensors", "size": 123, "sha256": "<hex>",
         "media_type": "application/vnd.safetensors", "chunks": ["<hex>", ...],
         "safetensors": {"header_len": 456, "metadata": {...},
                         "tensors": {"name": {"dtype": "BF16", "shape": [..], "offsets": [b, e]}}}}
      ]
    }

Tensor offsets are relative to the file's data section (``8 + header_len``), as in safetensors.
Parsing refuses anything that is not canonical, so stored bytes and digest always agree.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

from weightship.chunks import (
    DEFAULT_CHUNK_SIZE,
    chunk_count,
    hash_files,
    is_valid_chunk_size,
)
from weightship.digests import format_digest, hex_of, is_hex, sha256_hex
from weightship.errors import IntegrityError, ManifestError
from weightship.safetensors_header import (
    SafetensorsHeader,
    TensorInfo,
    read_header,
    validate_header,
)

__all__ = [
    "MAX_FILES",
    "MAX_MANIFEST_BYTES",
    "PICKLE_SUFFIXES",
    "SCHEMA",
    "DirectoryListing",
    "FileEntry",
    "Manifest",
    "build_manifest",
    "canonical_json",
    "check_manifest_bytes",
    "check_model_name",
    "check_relative_path",
    "list_model_directory",
    "manifest_bytes_match",
    "parse_manifest",
]

SCHEMA = "weightship.manifest/v1"
#: the OpenSSF model-signing signature beside a model directory's files (``weightship.signing``)
SIGNATURE_FILE = "model.sig"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_FILES = 100_000
MAX_PATH_LENGTH = 1024
MAX_PATH_DEPTH = 16
SAFETENSORS_MEDIA_TYPE = "application/vnd.safetensors"
#: Formats that execute code when loaded; refused unless a publisher allows them for the model.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz"})
_MEDIA_TYPES = {
    ".safetensors": SAFETENSORS_MEDIA_TYPE,
    ".json": "application/json",
    ".txt": "text/plain",
    ".md": "text/markdown",
    ".py": "text/x-python",
    ".model": "application/octet-stream",
    ".tiktoken": "text/plain",
}
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,254}$")
_MODEL_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_METADATA_KEY = re.compile(r"^[A-Za-z0-9_.\-/]{1,128}$")


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no insignificant whitespace, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def check_model_name(name: str) -> str:
    """``name`` if it is a valid model (or deployment) name, else a clear error."""
    if not isinstance(name, str) or not _MODEL_NAME.match(name):
        raise ManifestError(
            f"invalid model name {name!r}: use 1-128 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_relative_path(path: str) -> str:
    """``path`` if it is a safe relative POSIX path under the name grammar, else a clear error.

    Refuses absolute paths, ``..`` and ``.`` segments, backslashes, empty segments, hidden names
    and anything outside ``[A-Za-z0-9_][A-Za-z0-9._+=@-]*`` per segment.
    """
    if not isinstance(path, str) or not path:
        raise ManifestError("file path is empty")
    if len(path) > MAX_PATH_LENGTH:
        raise ManifestError(f"file path {path[:64]!r}... is longer than {MAX_PATH_LENGTH} characters")
    if path.startswith("/"):
        raise ManifestError(f"file path {path!r} is absolute; paths must be relative to the model directory")
    if "\\" in path or "\x00" in path:
        raise ManifestError(f"file path {path!r} contains a backslash or NUL")
    segments = path.split("/")
    if len(segments) > MAX_PATH_DEPTH:
        raise ManifestError(f"file path {path!r} is nested deeper than {MAX_PATH_DEPTH} levels")
    for segment in segments:
        if segment in ("", ".", ".."):
            raise ManifestError(f"file path {path!r} has an empty, '.' or '..' segment (path traversal)")
        if not _SEGMENT.match(segment):
            raise ManifestError(
                f"file path {path!r}: segment {segment!r} breaks the name grammar "
                "(letters, digits and '._+=@-', not starting with '.' or '-')"
            )
    return path


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a version."""

    path: str
    size: int
    sha256: str
    media_type: str
    chunks: tuple[str, ...]
    safetensors: SafetensorsHeader | None = None

    def chunk_range(self, index: int, chunk_size: int) -> tuple[int, int]:
        """Absolute ``(start, end)`` byte range of chunk ``index`` of this file."""
        start = index * chunk_size
        return start, min(start + chunk_size, self.size)

    def to_json(self) -> dict[str, Any]:
        """The file's manifest entry as a JSON-ready dict."""
        entry: dict[str, Any] = {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "media_type": self.media_type,
            "chunks": list(self.chunks),
        }
        if self.safetensors is not None:
            entry["safetensors"] = {
                "header_len": self.safetensors.header_len,
                "metadata": self.safetensors.metadata,
                "tensors": {
                    t.name: {"dtype": t.dtype, "shape": list(t.shape), "offsets": [t.begin, t.end]}
                    for t in self.safetensors.tensors
                },
            }
        return entry


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest; ``raw`` are its canonical bytes, ``digest`` the version id."""

    model: str
    chunk_size: int
    files: tuple[FileEntry, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON-ready dict."""
        return {
            "schema": SCHEMA,
            "model": self.model,
            "chunk_size": self.chunk_size,
            "metadata": dict(self.metadata),
            "files": [f.to_json() for f in self.files],
        }

    @cached_property
    def raw(self) -> bytes:
        """Canonical bytes; what is stored and hashed."""
        return canonical_json(self.to_json())

    @cached_property
    def digest(self) -> str:
        """The version id, ``sha256:<hex>`` of the canonical bytes."""
        return format_digest(sha256_hex(self.raw))

    @property
    def total_size(self) -> int:
        """Sum of all file sizes."""
        return sum(f.size for f in self.files)

    def file(self, path: str) -> FileEntry:
        """The entry for ``path``; ``KeyError`` if absent."""
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(path)

    def blobs(self) -> list[FileEntry]:
        """One entry per distinct blob (file sha256), in manifest order; identical files share one."""
        distinct: dict[str, FileEntry] = {}
        for entry in self.files:
            distinct.setdefault(entry.sha256, entry)
        return list(distinct.values())

    def tensors(self) -> dict[str, tuple[FileEntry, TensorInfo]]:
        """Every tensor of every safetensors file, by name."""
        found: dict[str, tuple[FileEntry, TensorInfo]] = {}
        for entry in self.files:
            if entry.safetensors is not None:
                for tensor in entry.safetensors.tensors:
                    found[tensor.name] = (entry, tensor)
        return found


# ---------------------------------------------------------------------------------------------
# Parsing


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ManifestError(message)


def _int(value: Any, what: str) -> int:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"{what} must be a non-negative integer"
    )
    return int(value)


def _str_map(value: Any, what: str) -> dict[str, str]:
    _require(isinstance(value, dict), f"{what} must be an object of strings")
    for key, item in value.items():
        _require(isinstance(item, str) and len(item) <= 65536, f"{what}[{key!r}] must be a string of at most 64 KiB")
    return dict(value)


def _parse_file(doc: Any, chunk_size: int, index: int) -> FileEntry:
    _require(isinstance(doc, dict), f"files[{index}] must be an object")
    allowed = {"path", "size", "sha256", "media_type", "chunks", "safetensors"}
    extra = set(doc) - allowed
    _require(not extra, f"files[{index}] has unknown fields {sorted(extra)}")
    path = check_relative_path(doc.get("path"))
    size = _int(doc.get("size"), f"{path}: size")
    sha = doc.get("sha256")
    _require(isinstance(sha, str) and is_hex(sha), f"{path}: sha256 must be 64 lowercase hex characters")
    media_type = doc.get("media_type")
    _require(isinstance(media_type, str) and 0 < len(media_type) <= 255, f"{path}: media_type must be a string")
    chunks = doc.get("chunks")
    _require(
        isinstance(chunks, list) and all(isinstance(c, str) and is_hex(c) for c in chunks),
        f"{path}: chunks must be a list of sha256 hex values",
    )
    expected = chunk_count(size, chunk_size)
    _require(len(chunks) == expected, f"{path}: {len(chunks)} chunk digests for {size} bytes, expected {expected}")
    if size <= chunk_size and chunks:
        _require(chunks[0] == sha, f"{path}: a single-chunk file's chunk digest must equal its sha256")
    header: SafetensorsHeader | None = None
    if "safetensors" in doc:
        header = _parse_safetensors(doc["safetensors"], size, path)
    return FileEntry(path=path, size=size, sha256=sha, media_type=media_type, chunks=tuple(chunks), safetensors=header)


def _parse_safetensors(doc: Any, size: int, path: str) -> SafetensorsHeader:
    _require(
        isinstance(doc, dict) and set(doc) == {"header_len", "metadata", "tensors"},
        f"{path}: safetensors entry must have exactly header_len, metadata and tensors",
    )
    header_len = _int(doc["header_len"], f"{path}: header_len")
    tensors = doc["tensors"]
    _require(isinstance(tensors, dict), f"{path}: tensors must be an object")
    # Re-validate through the one safetensors checker by rebuilding an equivalent header document.
    rebuilt: dict[str, Any] = {}
    for name, t in tensors.items():
        _require(
            isinstance(t, dict) and set(t) == {"dtype", "shape", "offsets"},
            f"{path}: tensor {name!r} must have exactly dtype, shape and offsets",
        )
        rebuilt[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": t["offsets"]}
    rebuilt["__metadata__"] = _str_map(doc["metadata"], f"{path}: metadata")
    return validate_header(rebuilt, header_len, size, path)


def parse_manifest(raw: bytes) -> Manifest:
    """Parse and validate manifest bytes; they must be canonical. Raises ``ManifestError``."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(raw)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"manifest is not UTF-8 JSON: {exc}") from None
    _require(isinstance(doc, dict), "manifest must be a JSON object")
    _require(doc.get("schema") == SCHEMA, f"manifest schema must be {SCHEMA!r}, got {doc.get('schema')!r}")
    extra = set(doc) - {"schema", "model", "chunk_size", "metadata", "files"}
    _require(not extra, f"manifest has unknown fields {sorted(extra)}")
    model = check_model_name(doc.get("model"))
    chunk_size = _int(doc.get("chunk_size"), "chunk_size")
    _require(
        is_valid_chunk_size(chunk_size), f"chunk_size {chunk_size} must be a power of two between 64 KiB and 4 GiB"
    )
    metadata = _str_map(doc.get("metadata", {}), "metadata")
    files_doc = doc.get("files")
    _require(
        isinstance(files_doc, list) and 0 < len(files_doc) <= MAX_FILES,
        f"files must be a list of 1 to {MAX_FILES} entries",
    )
    files = tuple(_parse_file(f, chunk_size, i) for i, f in enumerate(files_doc))
    _check_unique_paths(f.path for f in files)
    _require([f.path for f in files] == sorted(f.path for f in files), "files must be sorted by path")
    manifest = Manifest(model=model, chunk_size=chunk_size, files=files, metadata=metadata)
    _require(manifest.raw == raw, "manifest bytes are not canonical JSON (sorted keys, no whitespace, UTF-8)")
    _check_tensor_names(manifest)
    _check_blob_agreement(manifest.files)
    manifest.__dict__["raw"] = raw
    return manifest


def manifest_bytes_match(raw: bytes, digest: str) -> bool:
    """Whether manifest bytes ``raw`` are version ``digest`` (``sha256:<hex>`` or bare hex)."""
    return sha256_hex(raw) == hex_of(digest)


def check_manifest_bytes(raw: bytes, digest: str, what: str, advice: str = "they were refused") -> None:
    """Raise ``IntegrityError`` unless ``raw`` hashes to ``digest``: the one manifest-bytes check.

    A version *is* its manifest bytes, so every party that receives them (the CLI, the agent, a
    model server) checks them against the digest it asked for before parsing or trusting them.
    ``what`` names the bytes (``"the manifest the control plane sent"``), ``advice`` says what to do.
    """
    if not manifest_bytes_match(raw, digest):
        expected = format_digest(hex_of(digest))
        raise IntegrityError(f"{what} hashes to {format_digest(sha256_hex(raw))}, not {expected}: {advice}")


def _check_unique_paths(paths: Iterable[str]) -> None:
    seen: dict[str, str] = {}
    for path in paths:
        folded = path.casefold()
        if folded in seen:
            raise ManifestError(f"duplicate file path {path!r} (collides with {seen[folded]!r})")
        seen[folded] = path
    for path in seen.values():
        parent = str(PurePosixPath(path).parent)
        while parent != ".":
            if parent.casefold() in seen:
                raise ManifestError(f"file path {path!r} is nested under file {parent!r}")
            parent = str(PurePosixPath(parent).parent)


def _check_blob_agreement(files: Iterable[FileEntry]) -> None:
    """Files that share a sha256 must agree on size and chunks, or the manifest contradicts itself."""
    first_of: dict[str, FileEntry] = {}
    for entry in files:
        first = first_of.setdefault(entry.sha256, entry)
        if (first.size, first.chunks) != (entry.size, entry.chunks):
            raise ManifestError(
                f"{first.path!r} and {entry.path!r} claim the same sha256 {entry.sha256} but differ in size or "
                "chunks; rebuild the manifest from the files"
            )


def _check_tensor_names(manifest: Manifest) -> None:
    owners: dict[str, str] = {}
    for entry in manifest.files:
        if entry.safetensors is None:
            continue
        for tensor in entry.safetensors.tensors:
            if tensor.name in owners:
                raise ManifestError(
                    f"tensor {tensor.name!r} appears in both {owners[tensor.name]!r} and {entry.path!r}"
                )
            owners[tensor.name] = entry.path


# ---------------------------------------------------------------------------------------------
# Building from a model directory


def _media_type(path: str) -> str:
    return _MEDIA_TYPES.get(PurePosixPath(path).suffix.lower(), "application/octet-stream")


@dataclass(frozen=True)
class DirectoryListing:
    """What a version of a model directory holds, and what the naming rules leave out of it."""

    #: relative POSIX paths of the files a version holds, sorted
    paths: tuple[str, ...]
    #: hidden names (starting with '.') that are not part of a version, e.g. ``.gitattributes``;
    #: a hidden directory is listed once, not file by file
    skipped: tuple[str, ...]


def list_model_directory(root: Path) -> DirectoryListing:
    """The files of ``root`` a version would hold, reading no file; the same rules as ``build_manifest``."""
    root = Path(root)
    if root.is_symlink() or not root.is_dir():
        raise ManifestError(f"{str(root)!r} is not a directory")
    found: list[str] = []
    skipped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        for name in sorted(dirnames):
            if name.startswith("."):
                skipped.append((rel_dir / name).as_posix())
                dirnames.remove(name)
            elif (Path(dirpath) / name).is_symlink():
                raise ManifestError(
                    f"{(rel_dir / name).as_posix()!r} is a symlink; symlinks are not allowed in a model directory"
                )
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if name.startswith(".") or rel == SIGNATURE_FILE:  # a signature is provenance, not content
                skipped.append(rel)
                continue
            mode = os.lstat(Path(dirpath) / name).st_mode
            if stat.S_ISLNK(mode):
                raise ManifestError(f"{rel!r} is a symlink; symlinks are not allowed in a model directory")
            if not stat.S_ISREG(mode):
                raise ManifestError(f"{rel!r} is not a regular file")
            found.append(check_relative_path(rel))
    return DirectoryListing(paths=tuple(sorted(found)), skipped=tuple(sorted(skipped)))


def _check_hf_index(root: Path, paths: list[str], headers: dict[str, SafetensorsHeader]) -> None:
    for path in paths:
        if not path.endswith(".safetensors.index.json"):
            continue
        try:
            doc = json.loads((root / path).read_text(encoding="utf-8"))
            weight_map = doc["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, AssertionError):
            raise ManifestError(f"{path}: not a sharded-safetensors index (needs a 'weight_map' object)") from None
        base = PurePosixPath(path).parent
        mapped: dict[str, set[str]] = {}
        for tensor, shard in weight_map.items():
            shard_path = (base / shard).as_posix() if str(base) != "." else shard
            if shard_path not in headers:
                raise ManifestError(
                    f"{path}: weight_map sends tensor {tensor!r} to {shard!r}, which is not a safetensors file here"
                )
            mapped.setdefault(shard_path, set()).add(tensor)
        for shard_path in mapped:
            actual = {t.name for t in headers[shard_path].tensors}
            missing = mapped[shard_path] - actual
            unlisted = actual - mapped[shard_path]
            if missing:
                raise ManifestError(f"{path}: weight_map names tensors {sorted(missing)[:5]} that {shard_path!r} lacks")
            if unlisted:
                raise ManifestError(
                    f"{path}: {shard_path!r} holds tensors {sorted(unlisted)[:5]} missing from weight_map"
                )


def build_manifest(
    root: Path,
    model: str,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    allow_pickle: bool = False,
    metadata: Mapping[str, str] | None = None,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Build the manifest of the model directory ``root``, reading each file once.

    Hidden files and directories (names starting with '.') and the top-level ``model.sig`` are
    not part of a version (``list_model_directory`` names them).
    """
    check_model_name(model)
    if not is_valid_chunk_size(chunk_size):
        raise ManifestError(f"chunk_size {chunk_size} must be a power of two between 64 KiB and 4 GiB")
    for key in metadata or {}:
        if not _METADATA_KEY.match(key):
            raise ManifestError(f"metadata key {key!r} breaks the grammar [A-Za-z0-9_.-/]{{1,128}}")
    root = Path(root)
    paths = list(list_model_directory(root).paths)
    if not paths:
        raise ManifestError(f"{str(root)!r} holds no files to publish")
    if len(paths) > MAX_FILES:
        raise ManifestError(f"{str(root)!r} holds {len(paths)} files, more than {MAX_FILES}")
    _check_unique_paths(paths)
    pickled = [p for p in paths if PurePosixPath(p).suffix.lower() in PICKLE_SUFFIXES]
    if pickled and not allow_pickle:
        raise ManifestError(
            f"pickle-format files {pickled[:5]} can run code when loaded; convert them to safetensors "
            "or publish with pickle explicitly allowed for this model"
        )
    headers: dict[str, SafetensorsHeader] = {}
    for path in paths:
        if path.endswith(".safetensors"):
            with open(root / path, "rb") as handle:
                headers[path] = read_header(handle, path)
    _check_hf_index(root, paths, headers)
    digests = hash_files([root / p for p in paths], chunk_size, workers=workers, progress=progress)
    files = tuple(
        FileEntry(
            path=path,
            size=d.size,
            sha256=d.sha256,
            media_type=_media_type(path),
            chunks=d.chunks,
            safetensors=headers.get(path),
        )
        for path, d in zip(paths, digests, strict=True)
    )
    # Round-trip through the parser so a built manifest obeys exactly the rules a stored one does.
    return parse_manifest(Manifest(model=model, chunk_size=chunk_size, files=files, metadata=dict(metadata or {})).raw)
