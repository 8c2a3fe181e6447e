#!/usr/bin/env bash
# Train on one machine with torchrun (CPU with gloo, or the local GPUs).
#
#   NPROC=4 TP=2 EP=2 scripts/launch_local.sh [extra trainer flags]
#   MODEL=gpt2-s NPROC=8 scripts/launch_local.sh --train-iters 50
#   DRY_RUN=1 NPROC=4 scripts/launch_local.sh      # print, do not run
#
# MODEL picks the size defaults (tiny, the default here, gpt2-s or gpt2-l);
# every setting has an environment override (docs/CLUSTER.md), and an extra
# flag replaces the launcher's value of the same flag. Without
# DATA_PATH the trainer uses the bundled sample corpus.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/common.sh
source "$REPO_DIR/scripts/common.sh"

NPROC=${NPROC:-4}
mm_require_uint NPROC "$NPROC"
mm_preset "${MODEL:-tiny}"
mm_export_comm_env
mm_build_args "$NPROC"
mm_drop_given "$@"

# --standalone: a private c10d rendezvous on a free local port.
DISTRIBUTED_ARGS=(--standalone --nnodes 1 --nproc-per-node "$NPROC")

echo "# local: $NPROC processes, TP=$TP EP=$EP ESP=$ESP, $NUM_EXPERTS experts"
mm_show_env
[[ ${DRY_RUN:-0} == 1 ]] || cd "$REPO_DIR"
mm_run torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_DIR/pretrain_gpt_moe.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
