#!/usr/bin/env bash
# One node, N GPUs (default: all visible), one process per GPU:
#   bash launch/train_single_node.sh recipe=proxy-8k
#   NPROC=2 bash launch/train_single_node.sh layout=dp2 curriculum.stages.ctx16k.global_batch_tokens=32768 run_dir=runs/dp2
# (on 2 data-parallel ranks every stage needs at least one sequence per rank per step: the smoke
# recipe's last stage has one 16K sequence per step, so the example gives it two).
# Arguments are the trainer's Hydra overrides (see `moe-lc train --help`). With one GPU or none,
# a plain `moe-lc train ...` does the same without torchrun.
# A rank that dies restarts the job up to MAX_RESTARTS times (default 3); each restart resumes
# from the newest complete checkpoint. The exit code is the trainer's (launch/trainer_status.sh):
# 0 done, 1 diverged, 2 bad input, 3 stopped by a signal after saving, 4 a rank was lost.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/trainer_status.sh
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
run_trainer torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC" --max-restarts "${MAX_RESTARTS:-3}" \
    -m moe_lc.train "$@"
