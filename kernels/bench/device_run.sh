#!/usr/bin/env bash
# One device call: install the carried fla wheel, make moe_lc_kernels importable, run the bench.
# Usage (repo root, on the GPU machine): bash kernels/bench/device_run.sh [bench args...]
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p /tmp/pk && ln -sfn "$PWD/kernels" /tmp/pk/moe_lc_kernels
export PYTHONPATH="$PWD:/tmp/pk:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
python3 kernels/bench/bench_kda.py --out "${OUT:-.}" "$@" 2>&1 | tee "${OUT:-.}/log.txt"
