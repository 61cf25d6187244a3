"""Load throughput of gpu_loader against stock safetensors and a raw read of the same files, in one run.

Every method reads the same generated model (``gpu_loader.modelgen``, sharded HF layout, staged as
an agent-style version directory). Warm figures alternate the methods round by round (best of
``--repeat``; the median is printed too), so a noisy shared machine hurts them alike. Cold
figures drop the page cache before each method (needs root; skipped with a note otherwise).

Baselines, measured in this run:

* ``raw_stream``: one thread reads each file start to end into one reused 16 MiB buffer -- what
  the page cache or disk delivers (the strict "raw sequential read").
* ``raw_fresh``: one thread reads each file into a freshly allocated buffer of its size, all held
  until the end -- the least a loader that owns its memory must do (it pays the first touch of
  every page, for as much memory as the model).
* ``sha256 x cores``: SHA-256 of in-memory data, one thread's rate times the core count.
* ``safetensors``: ``safetensors.torch.load_file`` per file (on CPU it maps the file lazily, so
  the timing includes touching one byte per page of every tensor, making the bytes resident).
* ``pinned H2D`` (CUDA): ``copy_`` of a 256 MiB pinned buffer to the device.

gpu_loader runs with its defaults (``owned``: tensors in memory it allocates) and, on CPU, also
with ``cpu_mapped=True`` (tensors are copy-on-write views of the page cache).

Usage: python bench/load.py [--size-mb 768] [--shards 4] [--device cpu|cuda:0] [--repeat 3]
                            [--dir PATH] [--no-cold]
Last line: one JSON object; keys ``trust_vs_raw``, ``full_vs_limit``, ``trust_vs_safetensors``
(default loader vs ``raw_stream``, ``min(raw_stream, sha256 x cores)`` and safetensors; best
round against best round), ``trust_vs_raw_median`` and ``full_vs_limit_median`` (median against
median), on CUDA ``cuda_vs_h2d``, plus the same for the mapped CPU mode and against ``raw_fresh``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_loader.loader import Loader, LoadOptions
from gpu_loader.modelgen import generate
from weightship.digests import hex_of
from weightship.layout import MANIFEST_FILE, META_DIR, write_verification
from weightship.manifest import build_manifest

BLOCK = 16 * 1024 * 1024


def stage(model_dir: Path, data_dir: Path) -> Path:
    """Lay a model directory out as the agent does (manifest + verification record)."""
    manifest = build_manifest(model_dir, "bench")
    target = data_dir / "versions" / hex_of(manifest.digest)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(model_dir, target)
        (target / META_DIR).mkdir(exist_ok=True)
        (target / META_DIR / MANIFEST_FILE).write_bytes(manifest.raw)
        write_verification(target, manifest)
    return target


def raw_stream(files: list[Path]) -> None:
    buf = memoryview(bytearray(BLOCK))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while n := os.preadv(fd, [buf], offset):
                offset += n
        finally:
            os.close(fd)


def raw_fresh(files: list[Path]) -> None:
    held = []  # every file's memory stays alive to the end, as a loaded model's does
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            view = np.empty(size, dtype=np.uint8).data.cast("B")
            held.append(view)
            offset = 0
            while offset < size:
                offset += os.preadv(fd, [view[offset : offset + BLOCK]], offset)
        finally:
            os.close(fd)


def stock_safetensors(files: list[Path], device: str) -> None:
    for path in files:
        tensors = load_file(path, device=device)
        if device == "cpu":
            for tensor in tensors.values():
                if tensor.numel():
                    tensor.reshape(-1).view(torch.uint8)[::4096].sum()
        del tensors
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def sha_rate(threads: int) -> float:
    data = np.random.default_rng(0).integers(0, 256, 256 * 1024 * 1024, dtype=np.uint8).data.cast("B")
    started = time.perf_counter()

    def work(i: int) -> None:
        for offset in range(i * BLOCK, len(data), threads * BLOCK):
            hashlib.sha256(data[offset : offset + BLOCK]).digest()

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return len(data) / (time.perf_counter() - started) / 1e9


def first_touch_rate() -> float:
    started = time.perf_counter()
    torch.empty(512 * 1024 * 1024, dtype=torch.uint8).fill_(1)
    return 512 * 1024 * 1024 / (time.perf_counter() - started) / 1e9


def h2d_rate(device: str) -> float:
    size = 256 * 1024 * 1024
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    best = 0.0
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(8):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = max(best, 8 * size / (time.perf_counter() - started) / 1e9)
    return best


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (other work on a shared machine skews the figures)."""
    try:
        with open("/proc/loadavg") as handle:
            return " ".join(handle.read().split()[:3])
    except OSError:
        return "n/a"


def cpu_seconds() -> float:
    """CPU time used by this process so far (user + system, every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def drop_caches() -> str | None:
    """Drop the page cache; the reason when it cannot be done."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=768.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed afterwards)")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache figures")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    cores = os.cpu_count() or 1
    work = args.dir or Path(tempfile.mkdtemp(prefix="ws-bench-load-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        made = generate(work / "model", size_mb=args.size_mb, seed=1, shards=args.shards)
        version = stage(work / "model", work / "data")
        files = sorted(p for p in version.iterdir() if p.suffix == ".safetensors")
        total = sum(p.stat().st_size for p in files)
        checksums = work / "checksums"
        shutil.rmtree(checksums, ignore_errors=True)
        loader = Loader(LoadOptions(checksum_dir=checksums))
        mapped = Loader(LoadOptions(checksum_dir=checksums, cpu_mapped=True))

        def load(which: Loader, verify: str) -> Callable[[], None]:
            return lambda: which.load(version, device=args.device, verify=verify)  # type: ignore[arg-type]

        methods: dict[str, Callable[[], None]] = {
            "raw_stream": lambda: raw_stream(files),
            "raw_fresh": lambda: raw_fresh(files),
            "safetensors": lambda: stock_safetensors(files, args.device),
            "trust": load(loader, "trust"),
            "fast": load(loader, "fast"),
            "full": load(loader, "full"),
        }
        if not cuda:
            methods |= {"mapped_trust": load(mapped, "trust"), "mapped_fast": load(mapped, "fast"), "mapped_full": load(mapped, "full")}

        sha1 = sha_rate(1)
        sha_n = sha_rate(cores)
        touch = first_touch_rate()
        h2d = h2d_rate(args.device) if cuda else None
        print("== conditions")
        print(f"host: {platform.node()} {platform.machine()} {cores} cores, {platform.platform()}")
        print(f"load average before: {load_average()}")
        print(f"python {platform.python_version()}, torch {torch.__version__}, device {args.device}"
              + (f" ({torch.cuda.get_device_name(args.device)})" if cuda else ""))
        print(f"model: {made.config.num_hidden_layers} layers, hidden {made.config.hidden_size}, {len(files)} safetensors files, "
              f"{total / 1e9:.3f} GB, chunk {64} MiB, block {LoadOptions().block_size >> 20} MiB")
        print(f"sha256: {sha1:.2f} GB/s one thread, {sha_n:.2f} GB/s with {cores} threads; "
              f"fresh-memory first touch {touch:.2f} GB/s (one thread)" + (f"; pinned H2D {h2d:.2f} GB/s" if h2d else ""))

        for fn in methods.values():  # warm the page cache, build the fast-mode record, first-call costs
            fn()
        warm: dict[str, list[float]] = {name: [] for name in methods}
        cpu: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.repeat):
            for name, fn in methods.items():
                cpu_before = cpu_seconds()
                started = time.perf_counter()
                fn()
                warm[name].append(total / (time.perf_counter() - started) / 1e9)
                cpu[name].append((cpu_seconds() - cpu_before) / (total / 1e9))
        best = {name: max(v) for name, v in warm.items()}
        median = {name: statistics.median(v) for name, v in warm.items()}
        print(f"\n== warm page cache: GB/s (best of {args.repeat}, median); CPU-seconds per GB (median, all threads)")
        for name, values in warm.items():
            print(f"{name:14s} {max(values):7.2f}  {statistics.median(values):7.2f}   {statistics.median(cpu[name]):6.3f}")

        cold: dict[str, float] = {}
        cold_note = "skipped (--no-cold)" if args.no_cold else None
        if not args.no_cold:
            for name, fn in methods.items():
                if name.endswith("fast"):
                    continue
                reason = drop_caches()
                if reason is not None:
                    cold_note = f"skipped: cannot drop the page cache ({reason})"
                    break
                started = time.perf_counter()
                fn()
                cold[name] = total / (time.perf_counter() - started) / 1e9
        print("\n== cold page cache: GB/s (one run each, page cache dropped before each)")
        if cold_note:
            print(cold_note)
        for name, value in cold.items():
            print(f"{name:14s} {value:7.2f}")

        limit = min(best["raw_stream"], cores * sha1)
        ratios: dict[str, float] = {
            "trust_vs_raw": best["trust"] / best["raw_stream"],
            "full_vs_limit": best["full"] / limit,
            "trust_vs_safetensors": best["trust"] / best["safetensors"],
            "trust_vs_raw_fresh": best["trust"] / best["raw_fresh"],
            "full_vs_limit_fresh": best["full"] / min(best["raw_fresh"], cores * sha1),
            "fast_vs_raw": best["fast"] / best["raw_stream"],
            # Medians against medians: less flattering than bests, and steadier on a shared host.
            "trust_vs_raw_median": median["trust"] / median["raw_stream"],
            "full_vs_limit_median": median["full"] / min(median["raw_stream"], cores * sha1),
        }
        if cuda and h2d:
            ratios["cuda_vs_h2d"] = best["trust"] / h2d
            ratios["cuda_full_vs_h2d"] = best["full"] / h2d
        else:
            ratios |= {
                "mapped_trust_vs_raw": best["mapped_trust"] / best["raw_stream"],
                "mapped_full_vs_limit": best["mapped_full"] / limit,
                "mapped_trust_vs_safetensors": best["mapped_trust"] / best["safetensors"],
            }
        if cold:
            ratios["cold_trust_vs_raw"] = cold["trust"] / cold["raw_stream"]
            if "mapped_trust" in cold:
                ratios["cold_mapped_trust_vs_raw"] = cold["mapped_trust"] / cold["raw_stream"]
        print(f"load average after: {load_average()}")
        print(f"\n== ratios (best over best unless named _median; 'raw' is raw_stream, one thread reading each file "
              f"into a reused 16 MiB buffer; limit for full = min(raw_stream, {cores} x sha256 one thread) = {limit:.2f} GB/s)")
        for key, value in ratios.items():
            print(f"{key:28s} {value:6.2f}")
        figures = {"device": args.device, "bytes": total, "cores": cores, "sha256_gbps": round(sha1, 3),
                   "warm_gbps": {k: round(v, 3) for k, v in best.items()},
                   "warm_median_gbps": {k: round(v, 3) for k, v in median.items()}, "cold_gbps": {k: round(v, 3) for k, v in cold.items()},
                   "cpu_s_per_gb": {k: round(statistics.median(v), 3) for k, v in cpu.items()}}
        if h2d:
            figures["h2d_gbps"] = round(h2d, 3)
        print(json.dumps({**{k: round(v, 3) for k, v in ratios.items()}, **figures}, sort_keys=True))
        loader.close()
        mapped.close()
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
