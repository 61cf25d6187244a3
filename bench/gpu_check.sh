#!/usr/bin/env bash
# gpu_loader on a GPU host, in one go (< 5 minutes): the CUDA tests, then the load benchmark.
#
#   bench/gpu_check.sh                 # from anywhere; runs in the repository root
#   SIZE_MB=4096 bench/gpu_check.sh    # a bigger benchmark model (default 2048 MiB)
#   PYTHON=/opt/torch/.venv/bin/python3 bench/gpu_check.sh
#
# Needs a Python whose torch sees a CUDA device, with numpy, safetensors and pytest. pydantic and
# pytest-asyncio are not needed: the project's pytest settings are replaced by a minimal ini, and
# test modules that need the agent API schemas skip themselves. Exit status: non-zero if the
# tests fail or the benchmark breaks. The benchmark's last line is its JSON summary.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE_MB=${SIZE_MB:-2048}

PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3; do
  [ -n "$candidate" ] || continue
  command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
  if "$candidate" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=$candidate
    break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: no Python here has a torch that sees a CUDA device (set PYTHON=...)" >&2
  exit 2
fi

echo "== host"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader || true
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
nproc

ini=$(mktemp --suffix=.ini)
trap 'rm -f "$ini"' EXIT
cat >"$ini" <<'INI'
[pytest]
markers =
    cuda: needs a CUDA device
    slow: multi-process scenarios that take more than a few seconds
    postgres: runs against the PostgreSQL server that make test starts
INI
timeout_flag=()
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then timeout_flag=(--timeout=120); fi

echo "== CUDA tests"
PYTHONPATH=. timeout 170 "$PY" -m pytest -c "$ini" --rootdir . -p no:cacheprovider "${timeout_flag[@]}" \
  -m cuda tests/gpu_loader -q -rs

echo "== load benchmark (${SIZE_MB} MiB)"
PYTHONUNBUFFERED=1 PYTHONPATH=. timeout 170 "$PY" bench/load.py --device cuda:0 --size-mb "$SIZE_MB" --repeat 3
