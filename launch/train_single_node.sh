#!/usr/bin/env bash
# One node, N GPUs (default: all visible), one process per GPU:
#   bash launch/train_single_node.sh recipe=proxy-8k
#   NPROC=2 bash launch/train_single_node.sh layout=dp2 run_dir=runs/dp2
# Arguments are the trainer's Hydra overrides (see `moe-lc train --help`). With one GPU or none,
# a plain `moe-lc train ...` does the same without torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC" -m moe_lc.train "$@"
