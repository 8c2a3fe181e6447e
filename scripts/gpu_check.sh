#!/usr/bin/env bash
# GPU check: what a user with one or more CUDA GPUs runs to see this code work, and how fast, on CUDA.
#
#   scripts/gpu_check.sh [OUT_DIR]          (default: runs/gpu_check)
#
# One GPU (every machine):
# 1. tests on CUDA: every layout's code path in one process (tests/test_gpu_readiness.py: torch's
#    fake process group, bf16 GEMMs, host syncs pinned), the Triton kernels (tests/test_kernels.py),
#    the stream abstraction and its users (tests/test_streams.py, tests/test_streams_users.py);
# 2. layouts: tools/check_layouts.py --device cuda (GEMM dtypes, host syncs per layout);
# 3. the MoE layer against DeepSpeed-MoE (when importable) and the grouped-GEMM floor, bf16 autocast,
#    CUDA events (tools/bench_vs_deepspeed.py: 16384 tokens, M=1024, H=4096, E=8, top-2, capacity 1.25),
#    and the dropless layer against its floor;
# 4. the trainer's step (tools/bench_train_step.py: tokens/s, TFLOP/s by the trainer's count, host
#    syncs per step from the driver) for GPT-2 124M and 350M, dense and MoE (every second block,
#    E=8, top-2), with a capacity and dropless;
# 5. generation tokens/s, ours against transformers' generate on the same weights (tools/bench_generate.py).
# Two or more GPUs add the NCCL tests (tests/gpu/) and one benchmark of each optimization on all of
# them (Parm, Lancet, Lina, Pro-Prophet, Lina's inference scheduling).
# OUT_DIR/report.json: the machine, the test counts and every step's rows (or its exit status and log
# tail); a table of the headline figures is printed at the end.
#
# Environment: NGPU (default: every visible GPU), BENCH_SIZE=small (a quick smoke run) or base
# (default), PYTHON (default: python3). Exits 0 when every test passed and every benchmark ran, 1
# otherwise (the report is written either way), 2 on bad input.
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/gpu_check}"
PYTHON="${PYTHON:-python3}"
BENCH_SIZE="${BENCH_SIZE:-base}"

command -v "$PYTHON" >/dev/null || die "PYTHON: '$PYTHON' is not a command"
if [[ -z ${NGPU:-} ]]; then
    NGPU="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
fi
[[ $NGPU =~ ^[0-9]+$ ]] || die "NGPU must be a non-negative integer, got '$NGPU'"
((NGPU >= 1)) || die "needs a CUDA GPU (NGPU=$NGPU)"

case $BENCH_SIZE in
    small) MODEL_ARGS=(--num-layers 2 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 1024
                       --seq-length 256 --micro-batch-size 4 --vocab-size 8192)
           PRO_PROPHET_ARGS=(--hidden-size 256 --ffn-hidden-size 1024 --tokens 2048)
           INFERENCE_ARGS=(--layers 2 --hidden 256 --batch-size 8 --prompt-len 64)
           LAYER_ARGS=(--micro-batch-size 4 --seq-length 1024 --hidden-size 512 --ffn-hidden-size 2048)
           GPT2_SIZES=(124M)
           STEP_ITERS=(--iters 5 --warmup 2) ;;
    base)  MODEL_ARGS=(--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096
                       --seq-length 1024 --micro-batch-size 4 --vocab-size 50304)
           PRO_PROPHET_ARGS=(--hidden-size 1024 --ffn-hidden-size 4096 --tokens 8192)
           INFERENCE_ARGS=(--layers 4 --hidden 1024 --batch-size 16 --prompt-len 256)
           LAYER_ARGS=(--micro-batch-size 16 --seq-length 1024 --hidden-size 1024 --ffn-hidden-size 4096)
           GPT2_SIZES=(124M 350M)
           STEP_ITERS=(--iters 20 --warmup 5) ;;
    *) die "BENCH_SIZE must be small or base, got '$BENCH_SIZE'" ;;
esac
MOE_ARGS=(--num-experts "$((2 * NGPU))" --expert-model-parallel-size "$NGPU" --moe-router-topk 2)
RUN_ARGS=(--device cuda --iters 10 --warmup 3)

mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
unset TRITON_INTERPRET                     # the compiled kernels, on the GPU

# ---------------------------------------------------------------- 1. tests
status=0
TESTS=(tests/test_gpu_readiness.py tests/test_kernels.py tests/test_streams.py tests/test_streams_users.py)
((NGPU >= 2)) && TESTS+=(tests/gpu)
echo "== tests (log: $OUT/pytest.log)"
if ! "$PYTHON" -m pytest -q -rs "${TESTS[@]}" --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1; then
    status=1
fi
tail -n 5 "$OUT/pytest.log"

# ---------------------------------------------------------------- 2-4. one GPU
# one NAME CMD...: a one-process step, rows in OUT/NAME.json, exit status in OUT/NAME.rc
ONE=()
one() {
    local name=$1 rc=0
    shift
    echo "== $name (log: $OUT/$name.log)"
    "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1 || rc=$?
    echo "$rc" >"$OUT/$name.rc"
    ((rc == 0)) || status=1
    tail -n 12 "$OUT/$name.log"
    ONE+=("$name")
}
one layouts "$PYTHON" tools/check_layouts.py --device cuda
LAYER=(--device cuda --bf16 --expert-model-parallel-size 1 --num-experts 8 --moe-router-topk 2
       --moe-expert-capacity-factor 1.25 "${LAYER_ARGS[@]}" --iters 20 --warmup 5)
one moe_layer "$PYTHON" tools/bench_vs_deepspeed.py "${LAYER[@]}" --variants ours,deepspeed,floor
one moe_layer_dropless "$PYTHON" tools/bench_vs_deepspeed.py "${LAYER[@]}" --moe-dropless --variants ours,floor
for size in "${GPT2_SIZES[@]}"; do
    case $size in
        124M) GPT2=(--num-layers 12 --hidden-size 768 --num-attention-heads 12) ;;
        350M) GPT2=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16) ;;
    esac
    STEP=(--device cuda --bf16 "${GPT2[@]}" --seq-length 1024 --max-position-embeddings 1024
          --micro-batch-size 8 --vocab-size 50304 "${STEP_ITERS[@]}")
    one "train_${size}_dense" "$PYTHON" tools/bench_train_step.py "${STEP[@]}" --num-experts 0
    one "train_${size}_moe" "$PYTHON" tools/bench_train_step.py "${STEP[@]}" --num-experts 8 --moe-router-topk 2 \
        --moe-expert-capacity-factor 1.25
    one "train_${size}_moe_dropless" "$PYTHON" tools/bench_train_step.py "${STEP[@]}" --num-experts 8 \
        --moe-router-topk 2 --moe-dropless
done
GEN=(--device cuda --bf16 --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
     --vocab-size 50304 --batch-size 8 --prompt-len 128 --max-new-tokens 128 --rounds 3)
one generate "$PYTHON" tools/bench_generate.py "${GEN[@]}"

# ---------------------------------------------------------------- 5. two or more GPUs: one benchmark of each optimization
# bench_with NAME TOOL ARGS...: torchrun on every GPU with ARGS only, rows in OUT/NAME.json, exit
# status in OUT/NAME.rc; bench NAME TOOL ARGS...: the same with the trainer's model / MoE / run flags
bench_with() {
    local name=$1 tool=$2 rc=0
    shift 2
    echo "== benchmark $name (log: $OUT/$name.log)"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" "tools/$tool" \
        "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1 || rc=$?
    echo "$rc" >"$OUT/$name.rc"
    ((rc == 0)) || status=1
}
bench() {
    local name=$1 tool=$2
    shift 2
    bench_with "$name" "$tool" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
}

MULTI=()
if ((NGPU >= 2)); then
    MULTI=(parm parm_no_triton lancet lina pro_prophet inference)
    bench parm bench_moe_layer.py --schedules baseline,s1,s2
    MEGATRON_MOE_NO_TRITON=1 bench parm_no_triton bench_moe_layer.py --schedules baseline,s1,s2
    bench lancet bench_lancet.py
    bench lina bench_lina.py --rounds 2
    # their own flags: Pro-Prophet's model of dense FFN + MoE blocks (EP = the GPUs), the inference engine
    bench_with pro_prophet bench_pro_prophet.py "${PRO_PROPHET_ARGS[@]}" --skew 0 1.2 --iters 10 --warmup 8
    bench_with inference bench_inference.py "${INFERENCE_ARGS[@]}" --experts "$((2 * NGPU))" --skew 1.2 \
        --batches 8 --warmup 2
fi

# ---------------------------------------------------------------- 6. the report
"$PYTHON" - "$OUT" "${ONE[*]}" "${MULTI[*]:-}" <<'EOF'
import json
import os
import sys
import xml.etree.ElementTree as ET

import torch

out, one, multi = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()


def tail(path, n=40):
    try:
        with open(path) as f:
            return f.read().splitlines()[-n:]
    except OSError:
        return []


tests = {}
try:
    suites = ET.parse(os.path.join(out, "pytest.xml")).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    tests["skip_reasons"] = sorted({s.get("message", "") for s in suite.iter("skipped")})
except (OSError, ET.ParseError, AttributeError) as e:
    tests = {"error": f"no pytest report: {e}", "log_tail": tail(os.path.join(out, "pytest.log"))}

benchmarks = {}
for name in one + multi:
    rc = int(open(os.path.join(out, name + ".rc")).read().strip() or 1)
    entry = {"rc": rc}
    if rc == 0:
        with open(os.path.join(out, name + ".json")) as f:
            entry["rows"] = json.load(f)
    else:
        entry["log_tail"] = tail(os.path.join(out, name + ".log"))
    benchmarks[name] = entry

try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
report = {
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
    "tests": tests, "benchmarks": benchmarks,
}
tmp = os.path.join(out, "report.json.tmp")
with open(tmp, "w") as f:
    json.dump(report, f, indent=1)
os.replace(tmp, os.path.join(out, "report.json"))
print(f"report: {os.path.join(out, 'report.json')} ({report['gpus'][0] if report['gpus'] else 'no GPU'})")
for name in one:
    rows = benchmarks[name].get("rows")
    if rows is None:
        print(f"  {name}: failed (rc {benchmarks[name]['rc']})")
    elif name.startswith("train_"):
        print(f"  {name}: {rows['ms_median']:.1f} ms/step, {rows['tokens_per_s']:.0f} tokens/s, "
              f"{rows['tflops']:.1f} TFLOP/s, {rows['host_syncs_per_step']} host syncs/step")
    elif name == "generate":
        print("  generate: " + ", ".join(f"{r['variant']} {r['tokens_per_s']:.0f} tokens/s" for r in rows["rows"]))
    elif name.startswith("moe_layer"):
        for r in rows["rows"]:
            ds = "" if r["ratio_vs_deepspeed"] is None else f", {r['ratio_vs_deepspeed']:.2f}x DeepSpeed"
            print(f"  {name} {r['variant']}: {r['ms_median']:.2f} ms, {r['ratio_vs_floor']:.2f}x floor{ds}")
EOF
exit "$status"
