#!/usr/bin/env bash
# Several nodes: run this once on every node with the same MASTER_ADDR / NNODES and its own
# NODE_RANK (0 .. NNODES-1), or let launch/train.sbatch do it under SLURM:
#   MASTER_ADDR=node001 NNODES=4 NODE_RANK=0 bash launch/train_multi_node.sh recipe=proxy-curriculum
# Environment: MASTER_ADDR (required), MASTER_PORT (29500), NNODES (required), NODE_RANK (required),
# GPUS_PER_NODE (8), RDZV_ID (a job id shared by all nodes; default moe-lc).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MASTER_ADDR:?set MASTER_ADDR to the first node's hostname}"
: "${NNODES:?set NNODES to the number of nodes}"
: "${NODE_RANK:?set NODE_RANK to this node's index (0-based)}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec torchrun \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-moe-lc}" \
    -m moe_lc.train "$@"
