"""Manifest-build throughput versus ``openssl dgst -sha256`` over the same files, in one run.

Both read the same files from a warm page cache. openssl hashes them one after another on one
core (SHA-NI when the CPU has it): the single-stream SHA-256 limit. Ours computes, in one read of
each file, the whole-file SHA-256 *and* every chunk's SHA-256 (the manifest needs both), spread
over all cores. Each byte is hashed twice, so the ceiling is ``cores / 2`` times openssl, except
for files of one chunk, whose chunk digest is the file digest and is computed once.

Usage: python bench/publish.py [--size-mb 1024] [--files 4] [--chunk-mb 64] [--repeat 3]
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from weightship.manifest import build_manifest


def _write_files(root: Path, total: int, files: int) -> list[Path]:
    per = total // files
    block = os.urandom(16 * 1024 * 1024)
    paths = []
    for i in range(files):
        path = root / f"shard-{i:03d}.bin.data"
        with open(path, "wb") as handle:
            left = per
            while left > 0:
                n = min(left, len(block))
                handle.write(block[:n])
                left -= n
        paths.append(path)
    return paths


def _best(fn: object, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--chunk-mb", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    total = args.size_mb * 1024 * 1024
    with tempfile.TemporaryDirectory(prefix="ws-bench-publish-") as tmp:
        root = Path(tmp)
        paths = _write_files(root, total, args.files)
        size = sum(p.stat().st_size for p in paths)
        for p in paths:  # warm the page cache for both contestants
            p.read_bytes()

        def openssl() -> None:
            subprocess.run(["openssl", "dgst", "-sha256", *map(str, paths)], check=True, capture_output=True)

        def ours() -> None:
            build_manifest(root, "bench", chunk_size=args.chunk_mb * 1024 * 1024)

        t_openssl = _best(openssl, args.repeat)
        t_ours = _best(ours, args.repeat)
    gbps_openssl = size / t_openssl / 1e9
    gbps_ours = size / t_ours / 1e9
    ratio = gbps_ours / gbps_openssl
    openssl_version = subprocess.run(["openssl", "version"], capture_output=True, text=True).stdout.strip()
    print(
        f"conditions: {size / 2**20:.0f} MiB in {args.files} files, chunk {args.chunk_mb} MiB, page cache warm, "
        f"{cores} cores, {platform.processor() or platform.machine()}, {openssl_version}, best of {args.repeat}"
    )
    print(f"openssl dgst -sha256 (1 core, whole files only): {gbps_openssl:.2f} GB/s")
    print(f"weightship build_manifest (file + chunk digests, {cores} cores): {gbps_ours:.2f} GB/s")
    print(
        f"ratio ours/openssl: {ratio:.2f} (ceiling with two digests per byte: {cores / 2:.1f}; issue aim 0.8 x cores = {0.8 * cores:.1f})"
    )
    print(
        json.dumps(
            {
                "bench": "publish",
                "bytes": size,
                "files": args.files,
                "chunk_size": args.chunk_mb * 2**20,
                "cores": cores,
                "openssl_gbps": round(gbps_openssl, 3),
                "ours_gbps": round(gbps_ours, 3),
                "ratio_vs_openssl": round(ratio, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
