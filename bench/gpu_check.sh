#!/usr/bin/env bash
# gpu_loader on a GPU host, in one go: the CUDA tests, then the load benchmark, whatever the tests did.
#
#   bench/gpu_check.sh                 # from anywhere; runs in the repository root
#   SIZE_MB=4096 bench/gpu_check.sh    # a smaller benchmark model (default 16384 MiB: setup is noise)
#   REPEAT=2 bench/gpu_check.sh        # fewer benchmark rounds (default 3)
#   PYTHON=/opt/torch/.venv/bin/python3 bench/gpu_check.sh
#
# Needs only a Python whose torch sees a CUDA device, with numpy, safetensors and pytest: it runs
# tests/gpu_loader/test_cuda.py directly (that module imports no pydantic, httpx or aiohttp), under
# a minimal pytest ini instead of the project's settings. The benchmark runs even when a test
# fails; the exit status is non-zero if either failed. The benchmark's last line is its JSON
# summary (keys cuda_vs_h2d, cuda_vs_pinned_read_h2d, first_tensor_ms, full_vs_state_dict, ...).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
SIZE_MB=${SIZE_MB:-16384}
REPEAT=${REPEAT:-3}

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
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "devices", torch.cuda.device_count())'
nproc
free -g | head -2 || true

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
PYTHONPATH=. timeout 300 "$PY" -m pytest -c "$ini" --rootdir . -p no:cacheprovider "${timeout_flag[@]}" \
  tests/gpu_loader/test_cuda.py -q -rs
tests_status=$?

echo "== load benchmark (${SIZE_MB} MiB, ${REPEAT} rounds)"
PYTHONUNBUFFERED=1 PYTHONPATH=. timeout 900 "$PY" bench/load.py --device cuda:0 --size-mb "$SIZE_MB" --repeat "$REPEAT"
bench_status=$?

echo "== gpu_check: tests exit ${tests_status}, benchmark exit ${bench_status}"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
