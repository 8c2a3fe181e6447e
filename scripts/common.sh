# shellcheck shell=bash
# Helpers shared by the launchers; source it, do not run it.
#
#   mm_preset NAME             default model/batch sizes: tiny, gpt2-s, gpt2-l
#   mm_build_args WORLD        fill MODEL_ARGS MOE_ARGS DATA_ARGS TRAINING_ARGS
#                              LOGGING_ARGS from environment overrides
#   mm_drop_given FLAGS...     drop from those arrays the flags FLAGS give again
#   mm_export_comm_env         NCCL / wandb / threads defaults (only if unset)
#   mm_expand_hostlist EXPR    Slurm hostlist -> one host per line, no scontrol
#   mm_job_hosts               this job's hosts (scontrol, else the parser)
#   mm_run CMD...              run CMD, or print it when DRY_RUN=1
#   mm_run_groups ARRAY...     run the arrays' words as one command, or print
#                              it one array (flag group) per line when DRY_RUN=1
#   mm_slurm_pretrain NAME ... the body of the sbatch launchers (srun + torchrun),
#                              saving to runs/NAME/ckpt and resuming from it
#
# Every value a launcher passes has an environment override with the same
# name as in docs/CLUSTER.md, e.g. `TP=2 TOPK=2 sbatch scripts/...`.

mm_die() { echo "error: $*" >&2; exit 2; }

mm_require_uint() {  # mm_require_uint NAME VALUE: positive integer or die naming NAME
    if ! [[ $2 =~ ^[0-9]+$ ]] || ((10#$2 == 0)); then
        mm_die "$1 must be a positive integer, got '$2'"
    fi
}

# ---------------------------------------------------------------- hosts

# Expand a Slurm hostlist such as "node[01-03,07],gpu5,rack[1-2]-n[1-2]".
# Zero padding follows the lower bound of each range, as Slurm does.
mm_expand_hostlist() {
    local expr=$1 item="" ch depth=0 k
    for ((k = 0; k < ${#expr}; k++)); do
        ch=${expr:k:1}
        case $ch in
            '[') depth=$((depth + 1)) ;;
            ']') depth=$((depth - 1)) ;;
        esac
        if [[ $ch == , && $depth -eq 0 ]]; then
            _mm_expand_item "$item"
            item=""
        else
            item+=$ch
        fi
    done
    ((depth == 0)) || mm_die "unbalanced brackets in hostlist '$expr'"
    [[ -z $item ]] || _mm_expand_item "$item"
}

_mm_expand_item() {  # one comma-free item; recurse so later bracket groups expand too
    local item=$1
    if [[ $item != *\[* ]]; then
        echo "$item"
        return
    fi
    local prefix=${item%%\[*} rest=${item#*\[}
    local ranges=${rest%%\]*} suffix=${rest#*\]}
    local part lo hi n parts=()
    IFS=, read -ra parts <<<"$ranges"
    for part in "${parts[@]}"; do
        lo=${part%%-*}
        hi=${part#*-}
        [[ $lo =~ ^[0-9]+$ && $hi =~ ^[0-9]+$ ]] || mm_die "bad range '$part' in hostlist item '$item'"
        for ((n = 10#$lo; n <= 10#$hi; n++)); do
            _mm_expand_item "$(printf '%s%0*d%s' "$prefix" "${#lo}" "$n" "$suffix")"
        done
    done
}

mm_job_hosts() {
    local list=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
    [[ -n $list ]] || { hostname; return; }
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$list"
    else
        mm_expand_hostlist "$list"
    fi
}

# ---------------------------------------------------------------- environment

mm_export_comm_env() {
    export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}       # 1 on clusters without InfiniBand/EFA
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}       # many ranks per node: no oversubscription
    export WANDB_MODE=${WANDB_MODE:-offline}           # sync later with `wandb sync`
    export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
}

# Print the settings that shape a run (never secrets: WANDB_API_KEY is only
# reported as set or not).
mm_show_env() {
    local name
    for name in NCCL_IB_DISABLE NCCL_DEBUG NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME OMP_NUM_THREADS \
        WANDB_MODE WANDB_PROJECT HF_HUB_OFFLINE MASTER_ADDR MASTER_PORT; do
        [[ -z ${!name:-} ]] || echo "# $name=${!name}"
    done
    if [[ -n ${WANDB_API_KEY:-} ]]; then echo "# WANDB_API_KEY is set (not shown)"; fi
}

mm_run() {
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        printf '%q ' "$@" | sed 's/ $//'
        echo
    else
        "$@"
    fi
}

# mm_run_groups NAME...: the words of the named arrays, in order, are one
# command; run it, or with DRY_RUN=1 print it with one array per line
# (continued with a backslash), so each flag group reads on its own.
mm_run_groups() {
    local name ref cmd=() line sep=""
    for name in "$@"; do
        ref="${name}[@]"
        cmd+=("${!ref}")
    done
    if [[ ${DRY_RUN:-0} != 1 ]]; then
        "${cmd[@]}"
        return
    fi
    local word words
    for name in "$@"; do
        ref="${name}[@]"
        words=("${!ref}")
        ((${#words[@]})) || continue
        line=""
        for word in "${words[@]}"; do line+=" $(mm_quote "$word")"; done
        printf '%s%s' "$sep" "${line# }"
        sep=$' \\\n    '
    done
    echo
}

# mm_quote WORD: WORD as the shell reads it back: bare when safe, else in single quotes.
mm_quote() {
    if [[ $1 =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

# ---------------------------------------------------------------- arguments

# Defaults per model; any variable already set in the environment wins.
# gpt2-s / gpt2-l follow the Lancet paper's GPT2-S-MoE / GPT2-L-MoE (its
# configs: sequence 512, batch 48 / 24 per GPU, switch gating).
mm_preset() {
    case $1 in
        tiny)
            : "${NUM_LAYERS:=4}" "${HIDDEN_SIZE:=128}" "${NUM_HEADS:=4}" "${SEQ_LEN:=128}"
            : "${MICRO_BATCH:=4}" "${TRAIN_ITERS:=100}" "${LR:=1e-3}" "${MIN_LR:=1e-4}"
            : "${LR_WARMUP_ITERS:=10}" "${EVAL_INTERVAL:=50}" "${BF16:=0}" ;;
        gpt2-s)
            : "${NUM_LAYERS:=12}" "${HIDDEN_SIZE:=768}" "${NUM_HEADS:=12}" "${SEQ_LEN:=512}"
            : "${MICRO_BATCH:=48}" "${LR:=6e-4}" "${MIN_LR:=6e-5}" ;;
        gpt2-l)
            : "${NUM_LAYERS:=24}" "${HIDDEN_SIZE:=1024}" "${NUM_HEADS:=16}" "${SEQ_LEN:=512}"
            : "${MICRO_BATCH:=24}" "${LR:=3e-4}" "${MIN_LR:=3e-5}" ;;
        *) mm_die "unknown MODEL preset '$1' (tiny, gpt2-s, gpt2-l)" ;;
    esac
}

# mm_build_args WORLD: the trainer's flags, one array per concern. An empty
# optional value (e.g. DATA_PATH='') leaves its flag out so the trainer's own
# default applies.
# shellcheck disable=SC2034  # the arrays are read by the sourcing launcher
mm_build_args() {
    local world=$1
    TP=${TP:-1}
    ESP=${ESP:-1}
    mm_require_uint TP "$TP"
    mm_require_uint ESP "$ESP"
    ((world % TP == 0)) || mm_die "TP=$TP does not divide the world size $world"
    ((world % ESP == 0)) || mm_die "ESP=$ESP does not divide the world size $world"
    EP=${EP:-$((world / ESP))}                    # all GPUs hold experts
    NUM_EXPERTS=${NUM_EXPERTS:-$((2 * world))}    # two experts per GPU
    mm_require_uint EP "$EP"
    mm_require_uint NUM_EXPERTS "$NUM_EXPERTS"
    local dp=$((world / TP))
    MICRO_BATCH=${MICRO_BATCH:-4}
    GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * dp))}

    MODEL_ARGS=(
        --num-layers "${NUM_LAYERS:?}"
        --hidden-size "${HIDDEN_SIZE:?}"
        --num-attention-heads "${NUM_HEADS:?}"
        --ffn-hidden-size "${FFN_HIDDEN_SIZE:-$((4 * HIDDEN_SIZE))}"
        --seq-length "${SEQ_LEN:?}"
        --max-position-embeddings "${MAX_POS:-$SEQ_LEN}"
    )
    [[ -z ${VOCAB_SIZE:-} ]] || MODEL_ARGS+=(--vocab-size "$VOCAB_SIZE")

    MOE_ARGS=(
        --num-experts "$NUM_EXPERTS"
        --moe-layer-freq "${MOE_LAYER_FREQ:-2}"
        --moe-router-topk "${TOPK:-1}"
        --moe-expert-capacity-factor "${CAPACITY_FACTOR:-1.0}"
        --moe-min-capacity "${MIN_CAPACITY:-4}"
        --moe-router-policy "${ROUTER_POLICY:-position}"
        --moe-aux-loss-coeff "${AUX_LOSS_COEFF:-0.01}"
        --moe-z-loss-coeff "${Z_LOSS_COEFF:-0.0}"
        --moe-schedule "${MOE_SCHEDULE:-auto}"
        --tensor-model-parallel-size "$TP"
        --expert-model-parallel-size "$EP"
        --expert-sharding-parallel-size "$ESP"
    )
    [[ -z ${BACKEND:-} ]] || MOE_ARGS+=(--distributed-backend "$BACKEND")
    [[ -z ${COMM_PROFILE:-} ]] || MOE_ARGS+=(--comm-profile "$COMM_PROFILE")
    [[ ${LINA:-0} != 1 ]] || MOE_ARGS+=(--lina --lina-partition-mb "${LINA_PARTITION_MB:-30}")
    [[ ${LANCET_WGRAD:-0} != 1 ]] || MOE_ARGS+=(--lancet-wgrad)
    [[ ${LANCET_PARTITION:-0} != 1 ]] || MOE_ARGS+=(--lancet-partition)

    DATA_ARGS=()
    if [[ -n ${DATA_PATH:-} ]]; then                 # a blend is "W1 PREFIX1 W2 PREFIX2 ..."
        local data_words=()
        read -ra data_words <<<"$DATA_PATH"
        DATA_ARGS+=(--data-path "${data_words[@]}")
    fi
    [[ -z ${SPLIT:-} ]] || DATA_ARGS+=(--split "$SPLIT")
    [[ -z ${TOKENIZER:-} ]] || DATA_ARGS+=(--tokenizer-name-or-path "$TOKENIZER")

    TRAINING_ARGS=(
        --micro-batch-size "$MICRO_BATCH"
        --global-batch-size "$GLOBAL_BATCH"
        --train-iters "${TRAIN_ITERS:-2000}"
        --optimizer "${OPTIMIZER:-adamw}"
        --lr "${LR:-6e-4}"
        --min-lr "${MIN_LR:-6e-5}"
        --lr-warmup-iters "${LR_WARMUP_ITERS:-100}"
        --lr-decay-style "${LR_DECAY_STYLE:-cosine}"
        --weight-decay "${WEIGHT_DECAY:-0.1}"
        --clip-grad "${CLIP_GRAD:-1.0}"
        --seed "${SEED:-1234}"
        --eval-interval "${EVAL_INTERVAL:-500}"
        --eval-iters "${EVAL_ITERS:-10}"
    )
    [[ ${BF16:-1} != 1 ]] || TRAINING_ARGS+=(--bf16)
    [[ -z ${SAVE_DIR:-} ]] || TRAINING_ARGS+=(--save "$SAVE_DIR" --save-interval "${SAVE_INTERVAL:-1000}")
    [[ -z ${LOAD_DIR:-} ]] || TRAINING_ARGS+=(--load "$LOAD_DIR")
    [[ -z ${EXIT_DURATION_MINS:-} ]] || TRAINING_ARGS+=(--exit-duration-in-mins "$EXIT_DURATION_MINS")

    LOGGING_ARGS=(--log-interval "${LOG_INTERVAL:-10}")
    [[ -z ${LOG_JSON:-} ]] || LOGGING_ARGS+=(--log-json "$LOG_JSON")
    [[ -z ${TENSORBOARD_DIR:-} ]] || LOGGING_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
    if [[ -n ${WANDB_PROJECT:-} ]]; then
        LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-mode "${WANDB_MODE:-offline}")
        [[ -z ${WANDB_EXP_NAME:-} ]] || LOGGING_ARGS+=(--wandb-exp-name "$WANDB_EXP_NAME")
        [[ -z ${WANDB_SAVE_DIR:-} ]] || LOGGING_ARGS+=(--wandb-save-dir "$WANDB_SAVE_DIR")
    fi
    if [[ ${PROFILE:-0} == 1 ]]; then
        LOGGING_ARGS+=(--profile --profile-step-start "${PROFILE_STEP_START:-10}"
                       --profile-step-end "${PROFILE_STEP_END:-12}")
        local ranks=()
        read -ra ranks <<<"${PROFILE_RANKS:-0}"
        LOGGING_ARGS+=(--profile-ranks "${ranks[@]}")
    fi
}

# mm_drop_given FLAGS...: remove from the five flag arrays of mm_build_args each
# flag (with its values) that FLAGS gives again (`--x` and `--no-x` are one flag):
# the trainer refuses a flag given twice, and a launcher's extra flags replace
# its defaults.
mm_drop_given() {
    local given=" " w name arr ref kept skip
    for w in "$@"; do
        [[ $w != --* ]] || { name=${w#--}; name=${name%%=*}; given+="${name#no-} "; }
    done
    for arr in MODEL_ARGS MOE_ARGS DATA_ARGS TRAINING_ARGS LOGGING_ARGS; do
        ref="${arr}[@]"
        kept=() skip=0
        for w in "${!ref}"; do
            if [[ $w == --* ]]; then
                name=${w#--}
                skip=0
                [[ $given != *" ${name#no-} "* ]] || skip=1
            fi
            ((skip)) || kept+=("$w")
        done
        eval "$arr=(\"\${kept[@]}\")"
    done
}

# ---------------------------------------------------------------- Slurm

# mm_abs PATH: PATH when absolute, else REPO_DIR/PATH (the job runs from REPO_DIR).
mm_abs() {
    if [[ $1 == /* ]]; then echo "$1"; else echo "$REPO_DIR/$1"; fi
}

# mm_last_value FLAG WORDS...: the value after the last FLAG among WORDS (empty if none).
mm_last_value() {
    local flag=$1 value="" prev=""
    shift
    for word in "$@"; do
        [[ $prev != "$flag" ]] || value=$word
        prev=$word
    done
    echo "$value"
}

# mm_slurm_pretrain RUN_NAME [TRAINER_FLAGS...]: one torchrun per node via
# srun, c10d rendezvous on the first node of the allocation. Needs REPO_DIR
# and a model preset already applied.
# shellcheck disable=SC2034
mm_slurm_pretrain() {
    local run_name=$1
    shift
    if [[ -z ${SLURM_JOB_ID:-} && ${DRY_RUN:-0} != 1 ]]; then
        mm_die "not inside a Slurm job: submit with sbatch (DRY_RUN=1 prints the commands instead)"
    fi
    NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
    GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
    GPUS_PER_NODE=${GPUS_PER_NODE##*:}             # "a100:8" -> 8
    mm_require_uint NNODES "$NNODES"
    mm_require_uint GPUS_PER_NODE "$GPUS_PER_NODE"
    local world=$((NNODES * GPUS_PER_NODE)) hosts=()
    if [[ -z ${MASTER_ADDR:-} ]]; then
        mapfile -t hosts < <(mm_job_hosts)
        [[ ${#hosts[@]} -gt 0 && -n ${hosts[0]} ]] \
            || mm_die "could not read the first host of SLURM_NODELIST='${SLURM_NODELIST:-}'"
        MASTER_ADDR=${hosts[0]}
    fi
    # One port per job id, so two jobs sharing a node do not collide.
    MASTER_PORT=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
    export MASTER_ADDR MASTER_PORT

    mm_export_comm_env
    BACKEND=${BACKEND:-nccl}
    DATA_PATH=${DATA_PATH-data/processed/wt103}             # '' = the trainer's default
    # Everything of one run lives in runs/$RUN_NAME (relative to REPO_DIR): a
    # resubmitted or requeued job finds its checkpoints there and continues.
    RUN_NAME=${RUN_NAME:-$run_name}
    RUN_DIR=${RUN_DIR:-runs/$RUN_NAME}
    SAVE_DIR=${SAVE_DIR-$RUN_DIR/ckpt}                      # '' = no checkpoints
    if [[ -z ${LOAD_DIR:-} && -n $SAVE_DIR && -f $(mm_abs "$SAVE_DIR")/latest ]]; then
        LOAD_DIR=$SAVE_DIR                                  # it holds a checkpoint: resume
    fi
    WANDB_PROJECT=${WANDB_PROJECT-megatron-moe}             # '' = no wandb
    WANDB_EXP_NAME=${WANDB_EXP_NAME:-$RUN_NAME}
    WANDB_SAVE_DIR=${WANDB_SAVE_DIR-$RUN_DIR}
    LOG_JSON=${LOG_JSON-$RUN_DIR/metrics.jsonl}
    TENSORBOARD_DIR=${TENSORBOARD_DIR-$RUN_DIR/tensorboard}
    mm_build_args "$world"

    DISTRIBUTED_ARGS=(
        --nnodes "$NNODES"
        --nproc-per-node "$GPUS_PER_NODE"
        --rdzv-id "${SLURM_JOB_ID:-0}"
        --rdzv-backend c10d
        --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
    )
    SRUN_ARGS=(srun --nodes "$NNODES" --ntasks "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1)
    # `#SBATCH --signal=USR1@300` signals the job step: torchrun must not die
    # of it and the trainers must get it (mm_usr1_to_workers).
    # shellcheck disable=SC2016  # $0 and $@ are for the inner bash
    SIGNAL_ARGS=(bash -c 'source "$0" && mm_usr1_to_workers "$@"' "$REPO_DIR/scripts/common.sh")
    LAUNCH_ARGS=(torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_DIR/pretrain_gpt_moe.py")
    EXTRA_ARGS=("$@")
    mm_drop_given "$@"

    echo "# $RUN_NAME: $NNODES nodes x $GPUS_PER_NODE GPUs, TP=$TP EP=$EP ESP=$ESP, $NUM_EXPERTS experts"
    echo "# save: ${SAVE_DIR:-none}; load: ${LOAD_DIR:-none (no checkpoint there yet)}"
    echo "# signals: #SBATCH --signal=USR1@300 --requeue; SIGUSR1 -> save and exit 0;" \
         "requeue while the run is unfinished (REQUEUE=${REQUEUE:-1})"
    mm_show_env
    if [[ ${DRY_RUN:-0} != 1 ]]; then
        cd "$REPO_DIR" || mm_die "cannot cd to REPO_DIR=$REPO_DIR"
        [[ -z $LOG_JSON ]] || mkdir -p "$(dirname "$LOG_JSON")"
    fi
    mm_run_groups SRUN_ARGS SIGNAL_ARGS LAUNCH_ARGS MODEL_ARGS MOE_ARGS DATA_ARGS TRAINING_ARGS LOGGING_ARGS \
        EXTRA_ARGS
    [[ ${DRY_RUN:-0} != 1 ]] || return 0
    mm_requeue_if_unfinished
}

# mm_usr1_to_workers CMD...: run CMD (torchrun) with SIGUSR1 ignored (its
# default action would kill torchrun; the trainers install their own handler)
# and pass a SIGUSR1 this shell receives on to every process below it. So the
# trainers get the signal whether Slurm signals the whole step (proctrack/cgroup)
# or only the task's process group (torchrun starts its workers in new sessions).
mm_usr1_to_workers() {
    local child rc
    trap '' USR1
    "$@" &
    child=$!
    trap '_MM_USR1=1; mm_signal_descendants USR1 "$child"' USR1
    while true; do
        _MM_USR1=0
        wait "$child"
        rc=$?
        ((_MM_USR1)) || return "$rc"                # CMD ended (not a trap interrupting wait)
    done
}

# mm_signal_descendants SIG PID: send SIG to PID and every process below it.
mm_signal_descendants() {
    local kid
    for kid in $(pgrep -P "$2"); do
        mm_signal_descendants "$1" "$kid"
    done
    kill -s "$1" "$2" 2>/dev/null || true
}

# After a clean exit (SIGUSR1 or --exit-duration-in-mins) the checkpoint is
# short of --train-iters: put the job back in the queue (it resumes from
# SAVE_DIR). REQUEUE=0 turns this off.
mm_requeue_if_unfinished() {
    [[ ${REQUEUE:-1} == 1 && -n ${SAVE_DIR:-} && -n ${SLURM_JOB_ID:-} ]] || return 0
    local all=("${TRAINING_ARGS[@]}" "${EXTRA_ARGS[@]}") latest=0 target
    target=$(mm_last_value --train-iters "${all[@]}")
    [[ -f $SAVE_DIR/latest ]] && latest=$(<"$SAVE_DIR/latest")
    if [[ -n $target ]] && ((latest < target)); then
        echo "# checkpoint at iteration $latest of $target: requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    fi
}
