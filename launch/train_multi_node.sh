#!/usr/bin/env bash
# Several nodes: run this once on every node with the same MASTER_ADDR / NNODES and its own
# NODE_RANK (0 .. NNODES-1), or let launch/train.sbatch do it under SLURM:
#   MASTER_ADDR=node001 NNODES=4 NODE_RANK=0 bash launch/train_multi_node.sh recipe=proxy-curriculum
# Environment: MASTER_ADDR (required), MASTER_PORT (29500), NNODES (required), NODE_RANK (required),
# GPUS_PER_NODE (8), RDZV_ID (a job id shared by all nodes; default moe-lc), MAX_RESTARTS (3: a
# lost rank restarts the job, which resumes from the newest complete checkpoint).
# The exit code is the trainer's on the node of rank 0 (launch/trainer_status.sh); the others
# return torchrun's.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/trainer_status.sh
: "${MASTER_ADDR:?set MASTER_ADDR to the first node's hostname}"
: "${NNODES:?set NNODES to the number of nodes}"
: "${NODE_RANK:?set NODE_RANK to this node's index (0-based)}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
run_trainer torchrun \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-moe-lc}" \
    --max-restarts "${MAX_RESTARTS:-3}" -m moe_lc.train "$@"
