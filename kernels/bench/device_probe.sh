#!/usr/bin/env bash
# Device call: carried fla wheel + autotune cache, then the given python commands; saves fla's autotune results.
# Usage: bash kernels/bench/device_probe.sh 'python3 kernels/bench/profile_kda.py ...' ['...']
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pk /tmp/tc && ln -sfn "$PWD/kernels" /tmp/pk/moe_lc_kernels
export PYTHONPATH="$PWD:/tmp/pk:/tmp/site" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
[ -f .whl/fla_autotune.tgz ] && tar xzf .whl/fla_autotune.tgz -C /tmp/tc
for cmd in "$@"; do echo "### $cmd"; bash -c "$cmd" 2>&1 | tee -a "$OUT/log.txt"; done
(cd /tmp/tc && find . -name "*.autotune.json" | tar czf "$OUT/fla_autotune.tgz" -T -)
ls -la "$OUT"
