"""Load throughput of gpu_loader against stock safetensors and a raw read of the same files, in one run.

Every method reads the same generated model (``gpu_loader.modelgen``, sharded HF layout, staged as
an agent-style version directory). Warm figures alternate the methods round by round (best of
``--repeat``; the median is printed too), so a noisy shared machine hurts them alike. Cold
figures drop the page cache before each method (needs root; skipped with a note otherwise), in
``--cold-repeat`` interleaved rounds (best kept: one cold sample on a shared host is noisy).

Baselines, measured in this run:

* ``raw_stream``: one thread reads each file start to end into one reused 16 MiB buffer -- what
  the page cache or disk delivers (the strict "raw sequential read").
* ``raw_fresh``: one thread reads each file into a freshly allocated buffer of its size, all held
  until the end -- the least a loader that owns its memory must do (it pays the first touch of
  every page, for as much memory as the model).
* ``sha256 x cores``: SHA-256 of in-memory data, one thread's rate times the core count.
* ``safetensors``: ``safetensors.torch.load_file`` per file (on CPU it maps the file lazily, so
  the timing includes touching one byte per page of every tensor, making the bytes resident).
* ``state_dict``: what users do today to fill a model: build the module on the device
  (``to_empty``), ``safetensors.torch.load_file`` every file onto the same device, then
  ``module.load_state_dict``. Against it, ``full_module``: gpu_loader builds the same module on
  ``meta`` and loads it with ``Loader.load_into(..., verify="full")``, every byte SHA-256-checked;
  and ``trust_module``: the same with ``verify="trust"``, the load a model server makes once its
  agent has verified the version (the agent's record covers every chunk; sizes and headers are
  still checked against the manifest).
* ``h2d`` (CUDA): ``copy_`` of the model's byte count from a pinned 256 MiB buffer to the device,
  measured in every round beside the others (PCIe shifts with clocks and neighbours).
* ``pinned_read_h2d`` (CUDA): the fair pipeline baseline: the same reader count and block size
  as gpu_loader read the files into a ring of pinned buffers and each reader overlaps its
  ``copy_`` to the device on its own stream with its next read; no hashing, no tensors.

gpu_loader runs with its defaults (``owned``: tensors in memory it allocates) and, on CPU, also
with ``cpu_mapped=True`` (tensors are copy-on-write views of the page cache). ``first_tensor_ms``
is the time from ``Loader.session`` to the first tensor handed out (``trust``, median of the
rounds): what a server streaming weights into its layers waits before it can start.

Usage: python bench/load.py [--size-mb 768, 16384 on CUDA] [--shards 4] [--device cpu|cuda:0]
                            [--repeat 3] [--dir PATH] [--no-cold] [--cold-repeat 1]
Last line: one JSON object; keys ``trust_vs_raw``, ``full_vs_limit``, ``trust_vs_safetensors``
(default loader vs ``raw_stream``, ``min(raw_stream, sha256 x cores)`` and safetensors; best
round against best round), ``trust_vs_raw_median`` and ``full_vs_limit_median`` (median against
median), ``full_vs_state_dict`` and ``trust_module_vs_state_dict`` (``full_module`` and
``trust_module`` against ``state_dict``; ``cold_full_module_vs_state_dict`` and
``cold_trust_module_vs_state_dict`` from the cold runs), ``first_tensor_ms``; on
CUDA ``cuda_vs_h2d`` and ``cuda_vs_pinned_read_h2d`` (``trust`` against each); plus the same for
the mapped CPU mode and against ``raw_fresh``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import queue
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

from gpu_loader.loader import Loader, LoadOptions, VerifyMode
from gpu_loader.model import LlamaConfig, build_model
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


def h2d(device: str, total: int) -> Callable[[], None]:
    """Copy ``total`` bytes to the device from one pinned 256 MiB buffer (buffers made once)."""
    size = 256 * 1024 * 1024
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=device)

    def run() -> None:
        for offset in range(0, total, size):
            n = min(size, total - offset)
            dst[:n].copy_(src[:n], non_blocking=True)
        torch.cuda.synchronize(device)

    return run


def pinned_read_h2d(files: list[Path], device: str, readers: int, block: int) -> Callable[[], None]:
    """Readers fill pinned buffers and overlap each copy to the device with their next read."""
    buffers = [torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(2 * readers + 2)]
    streams = [torch.cuda.Stream(device=device) for _ in range(readers)]  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    sizes = [p.stat().st_size for p in files]
    work = [(i, off, min(block, size - off)) for i, size in enumerate(sizes) for off in range(0, size, block)]

    def run() -> None:
        dests = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        free: queue.SimpleQueue[tuple[torch.Tensor, torch.cuda.Event | None]] = queue.SimpleQueue()
        for buffer in buffers:
            free.put((buffer, None))
        fds = [os.open(p, os.O_RDONLY) for p in files]
        items = iter(work)
        lock = threading.Lock()

        def reader(stream: torch.cuda.Stream) -> None:
            torch.cuda.set_device(device)
            view_of = {id(b): b.numpy().data.cast("B") for b in buffers}
            while True:
                with lock:
                    item = next(items, None)
                if item is None:
                    return
                file, offset, length = item
                buffer, fence = free.get()
                if fence is not None:
                    fence.synchronize()
                memory = view_of[id(buffer)][:length]
                done = 0
                while done < length:
                    done += os.preadv(fds[file], [memory[done:]], offset + done)
                with torch.cuda.stream(stream):
                    dests[file][offset : offset + length].copy_(buffer[:length], non_blocking=True)
                    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
                    event.record(stream)
                free.put((buffer, event))

        threads = [threading.Thread(target=reader, args=(s,)) for s in streams]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for stream in streams:
            stream.synchronize()
        for fd in fds:
            os.close(fd)
        dests.clear()

    return run


def state_dict_load(files: list[Path], config: LlamaConfig, device: str) -> None:
    """The path users take today: a module on the device, ``load_file`` onto it, ``load_state_dict``."""
    module = build_model(config).to_empty(device=device)
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path, device=device))
    module.load_state_dict(state)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def first_tensor_ms(loader: Loader, version: Path, device: str) -> float:
    """Milliseconds from opening a trusted session to its first tensor on ``device``."""
    started = time.perf_counter()
    for _name, tensor in loader.session(version, device=device, verify="trust"):
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        return (time.perf_counter() - started) * 1000
    return 0.0


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
    parser.add_argument("--size-mb", type=float, help="model size (default 768 MiB; 16 GiB on CUDA, so setup is noise)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed afterwards)")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache figures")
    parser.add_argument("--cold-repeat", type=int, default=1, help="cold rounds, methods interleaved (best is kept)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if args.size_mb is None:
        args.size_mb = 16384.0 if cuda else 768.0
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

        def load(which: Loader, verify: VerifyMode) -> Callable[[], object]:
            return lambda: which.load(version, device=args.device, verify=verify)

        def load_module(verify: VerifyMode) -> Callable[[], object]:
            def run() -> None:
                module = build_model(made.config)
                loader.load_into(module, version, device=args.device, verify=verify)

            return run

        methods: dict[str, Callable[[], object]] = {
            "raw_stream": lambda: raw_stream(files),
            "raw_fresh": lambda: raw_fresh(files),
            "safetensors": lambda: stock_safetensors(files, args.device),
            "trust": load(loader, "trust"),
            "fast": load(loader, "fast"),
            "full": load(loader, "full"),
            "state_dict": lambda: state_dict_load(files, made.config, args.device),
            "full_module": load_module("full"),
            "trust_module": load_module("trust"),
        }
        if cuda:
            readers = LoadOptions().reader_count(torch.device(args.device))
            methods |= {"h2d": h2d(args.device, total), "pinned_read_h2d": pinned_read_h2d(files, args.device, readers, BLOCK)}
        else:
            methods |= {"mapped_trust": load(mapped, "trust"), "mapped_fast": load(mapped, "fast"), "mapped_full": load(mapped, "full")}

        sha1 = sha_rate(1)
        sha_n = sha_rate(cores)
        touch = first_touch_rate()
        print("== conditions")
        print(f"host: {platform.node()} {platform.machine()} {cores} cores, {platform.platform()}")
        print(f"load average before: {load_average()}")
        print(f"python {platform.python_version()}, torch {torch.__version__}, device {args.device}"
              + (f" ({torch.cuda.get_device_name(args.device)})" if cuda else ""))
        print(f"model: {made.config.num_hidden_layers} layers, hidden {made.config.hidden_size}, {len(files)} safetensors files, "
              f"{total / 1e9:.3f} GB, chunk {64} MiB, block {LoadOptions().block_size >> 20} MiB")
        print(f"sha256: {sha1:.2f} GB/s one thread, {sha_n:.2f} GB/s with {cores} threads; "
              f"fresh-memory first touch {touch:.2f} GB/s (one thread)")

        for fn in methods.values():  # warm the page cache, build the fast-mode record, first-call costs
            fn()
        warm: dict[str, list[float]] = {name: [] for name in methods}
        cpu: dict[str, list[float]] = {name: [] for name in methods}
        first: list[float] = []
        for _ in range(args.repeat):
            for name, fn in methods.items():
                cpu_before = cpu_seconds()
                started = time.perf_counter()
                fn()
                warm[name].append(total / (time.perf_counter() - started) / 1e9)
                cpu[name].append((cpu_seconds() - cpu_before) / (total / 1e9))
            first.append(first_tensor_ms(loader, version, args.device))
        best = {name: max(v) for name, v in warm.items()}
        median = {name: statistics.median(v) for name, v in warm.items()}
        print(f"\n== warm page cache: GB/s (best of {args.repeat}, median); CPU-seconds per GB (median, all threads)")
        for name, values in warm.items():
            print(f"{name:14s} {max(values):7.2f}  {statistics.median(values):7.2f}   {statistics.median(cpu[name]):6.3f}")

        cold: dict[str, float] = {}
        cold_note = "skipped (--no-cold)" if args.no_cold else None
        for _ in range(0 if args.no_cold else args.cold_repeat):
            for name, fn in methods.items():
                if name.endswith("fast") or name == "h2d":
                    continue
                reason = drop_caches()
                if reason is not None:
                    cold_note = f"skipped: cannot drop the page cache ({reason})"
                    break
                started = time.perf_counter()
                fn()
                cold[name] = max(cold.get(name, 0.0), total / (time.perf_counter() - started) / 1e9)
            if cold_note:
                break
        print(f"\n== cold page cache: GB/s (best of {args.cold_repeat} interleaved rounds, page cache dropped before each run)")
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
            "full_vs_state_dict": best["full_module"] / best["state_dict"],
            "full_vs_state_dict_median": median["full_module"] / median["state_dict"],
            "trust_module_vs_state_dict": best["trust_module"] / best["state_dict"],
            "trust_module_vs_state_dict_median": median["trust_module"] / median["state_dict"],
            "first_tensor_ms": statistics.median(first),
        }
        if cuda:
            ratios |= {
                "cuda_vs_h2d": best["trust"] / best["h2d"],
                "cuda_vs_pinned_read_h2d": best["trust"] / best["pinned_read_h2d"],
                "cuda_full_vs_h2d": best["full"] / best["h2d"],
                "cuda_full_vs_pinned_read_h2d": best["full"] / best["pinned_read_h2d"],
                "cuda_vs_h2d_median": median["trust"] / median["h2d"],
            }
        else:
            ratios |= {
                "mapped_trust_vs_raw": best["mapped_trust"] / best["raw_stream"],
                "mapped_full_vs_limit": best["mapped_full"] / limit,
                "mapped_trust_vs_safetensors": best["mapped_trust"] / best["safetensors"],
            }
        if cold:
            ratios["cold_trust_vs_raw"] = cold["trust"] / cold["raw_stream"]
            ratios["cold_full_module_vs_state_dict"] = cold["full_module"] / cold["state_dict"]
            ratios["cold_trust_module_vs_state_dict"] = cold["trust_module"] / cold["state_dict"]
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
        print(json.dumps({**{k: round(v, 3) for k, v in ratios.items()}, **figures}, sort_keys=True))
        loader.close()
        mapped.close()
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
