#!/usr/bin/env bash
# Sourced by the launch scripts: `run_trainer CMD...` runs CMD (torchrun, or srun around it) and
# returns the trainer's own exit code, which torchrun does not pass on (it only says that a
# worker failed): rank 0 writes it to $MOE_LC_STATUS_FILE. The codes (`moe-lc train --help`):
#   0 done   1 diverged   2 bad configuration or input, or run_dir in use by another trainer
#   3 stopped by a signal after saving a checkpoint: requeue, resume=auto continues
#   4 a rank failed or stopped responding (after torchrun's restarts ran out): requeue
# Without a status (rank 0 killed before it could write one), torchrun's own code is returned.
# STATUS_DIR: where the status file goes; it must be where rank 0 runs (default: $TMPDIR or /tmp).
run_trainer() {
    local status rc=0
    status=$(mktemp "${STATUS_DIR:-${TMPDIR:-/tmp}}/moe-lc-status.XXXXXX")
    MOE_LC_STATUS_FILE=$status "$@" || rc=$?
    if [[ -s $status ]]; then
        rc=$(<"$status")
    fi
    rm -f "$status"
    return "$rc"
}
