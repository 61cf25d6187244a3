"""Every benchmark starts as its docstring says and prints its documented JSON keys, in seconds.

Each ``bench/*.py`` is run exactly as the docs run it (``python bench/X.py ...`` from the
repository root, so ``bench/`` is first on ``sys.path``: a script named after a package it
imports would shadow that package) with tiny sizes, and must exit 0 with a last stdout line that
is one JSON object holding the keys its docstring documents (``a.b`` is key ``b`` inside ``a``).

To add a benchmark, add one ``Bench`` line to ``BENCHES``: a script without one fails
``test_every_benchmark_has_a_smoke_entry``. Modules that benchmarks import but nobody runs go in
``LIBRARIES``.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


@dataclass(frozen=True)
class Bench:
    """One benchmark's smoke run: its script, tiny-size flags, and the JSON keys it must print."""

    script: str
    args: tuple[str, ...]
    keys: tuple[str, ...]
    #: builds network namespaces: runs only as root with ``ip`` and ``tc``
    needs_netns: bool = False
    timeout: float = 60.0


#: per database, in bench/heartbeats.py's line
HEARTBEAT_KEYS = ("heartbeats_per_s", "heartbeat_p99_ms", "notify_all_seconds")

BENCHES = [
    Bench(
        "publish.py",
        ("--size-mb", "8", "--files", "1", "--chunk-mb", "4", "--repeat", "1", "--verify-mb", "8", "--verify-chunk-mb", "4"),
        ("ratio_vs_openssl", "ours_gbps", "openssl_gbps", "verify_vs_read", "others_cores_ours"),
    ),
    Bench(
        "load.py",
        ("--size-mb", "8", "--shards", "1", "--repeat", "1", "--no-cold"),
        ("trust_vs_raw", "full_vs_limit", "trust_vs_safetensors", "full_vs_state_dict", "trust_module_vs_state_dict", "first_tensor_ms"),
    ),
    Bench(
        "fetch.py",
        ("--size", "8MiB", "--files", "1", "--chunk-size", "4MiB", "--repeat", "1"),
        ("ratio_vs_curl", "ratio_vs_curl_verified", "heartbeat_p99_ms_during_fetch", "agent_durable_seconds", "others_cores"),
    ),
    Bench("peer_sendfile.py", ("--rounds", "1"), ("kind", "gb_per_s", "server_cpu_s")),
    Bench("sign.py", ("--files", "20", "--size-mb", "2", "--repeat", "1"), ("sign_seconds", "verify_seconds", "publish_overhead")),
    Bench(
        "simulate.py",
        ("--nodes", "40", "--clusters", "2", "--size", "64MiB", "--chunk", "4MiB"),
        ("time_over_ideal", "origin_egress_over_size"),
    ),
    Bench(
        "fanout.py",
        ("--nodes", "2", "--size", "8MiB", "--files", "1", "--chunk-size", "1MiB", "--rate", "1Gbit", "--timeout", "60"),
        ("time_over_ideal", "origin_egress_over_size", "speedup_over_origin"),
        needs_netns=True,
    ),
    Bench(
        "coldstart.py",
        ("--size", "8MiB", "--rate", "1Gbit", "--warm", "1", "--chunk-size", "1MiB", "--timeout", "120"),
        ("coldstart_over_ideal", "speedup_over_sequential", "first_tensor_ms"),
        needs_netns=True,
        timeout=240.0,
    ),
    Bench(
        "heartbeats.py",
        ("--nodes", "50", "--wave-rates", "100", "--wave-seconds", "2", "--rates", "100", "--step-seconds", "1", "--idle-seconds", "1"),
        tuple(f"{db}.{key}" for db in ("sqlite", "postgres") for key in HEARTBEAT_KEYS),
    ),
    Bench(
        "ui_idle.py",
        ("--nodes", "50", "--versions", "3", "--pages", "3", "--seconds", "1"),
        ("queries_many_pages_over_idle", "idle.queries_per_s", "many_pages.queries_per_s", "many_pages.cpu_share", "extra_queries_per_s_many_pages", "page_load_ms"),
        timeout=120.0,  # a control plane started and stopped, and three measured windows
    ),
]

#: modules of bench/ that benchmarks import and nobody runs
LIBRARIES = {"hostcpu.py", "topology.py"}


def _netns_unavailable() -> str | None:
    """Why this machine cannot build namespaces for a benchmark (the check ``bench/topology.py`` makes)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


def _lookup(found: dict[str, object], dotted: str) -> object:
    value: object = found
    for part in dotted.split("."):
        assert isinstance(value, dict), f"key {dotted!r}: {part!r} is inside a non-object in {found}"
        assert part in value, f"key {dotted!r} missing from {found}"
        value = value[part]
    return value


def test_every_benchmark_has_a_smoke_entry() -> None:
    scripts = {p.name for p in BENCH.glob("*.py")} - LIBRARIES
    assert scripts == {b.script for b in BENCHES}


@pytest.mark.parametrize("bench", BENCHES, ids=[b.script for b in BENCHES])
def test_benchmark_docstring_names_how_to_run_it(bench: Bench) -> None:
    doc = ast.get_docstring(ast.parse((BENCH / bench.script).read_text())) or ""
    assert f"python bench/{bench.script}" in doc


@pytest.mark.parametrize("bench", BENCHES, ids=[b.script for b in BENCHES])
def test_benchmark_runs_as_documented_and_prints_its_keys(bench: Bench) -> None:
    if bench.needs_netns and (why := _netns_unavailable()):
        pytest.skip(why)
    argv = [sys.executable, f"bench/{bench.script}", *bench.args]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=bench.timeout, check=False)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"{' '.join(argv)} printed nothing; stderr:\n{done.stderr[-3000:]}"
    found = json.loads(lines[-1])
    assert isinstance(found, dict), lines[-1]
    for key in bench.keys:
        _lookup(found, key)
