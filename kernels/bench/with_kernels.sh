#!/usr/bin/env bash
# Run a command with moe_lc_kernels imported from another copy of kernels/, so that a code change is
# timed against its control in the same device call (a TUNING variant cannot express every change).
#   git archive <commit> kernels | tar -x -C _call/base     # the control, before the change
#   bash kernels/bench/with_kernels.sh _call/base/kernels python3 kernels/bench/probe_variants.py
# Must run from the repository root (on the device: inside a device_probe.sh command).
set -euo pipefail
copy=$(cd "$1" && pwd); shift
link=$(mktemp -d)
ln -s "$copy" "$link/moe_lc_kernels"
PYTHONPATH="$PWD:$link${PYTHONPATH:+:$PYTHONPATH}" "$@"
