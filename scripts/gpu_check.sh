#!/usr/bin/env bash
# GPU check: what a user with >= 2 CUDA GPUs runs to see this code work on CUDA + NCCL.
#
#   scripts/gpu_check.sh [OUT_DIR]          (default: runs/gpu_check)
#
# 1. the GPU tests: tests/gpu/ (layouts, Parm, dropless, Pro-Prophet's placement and the
#    inference engine on NCCL with one process per GPU; Lina and Lancet through the trainer on
#    CUDA), the Triton kernels on CUDA tensors (tests/test_kernels.py) and the stream
#    abstraction and its users' stream order (tests/test_streams.py, tests/test_streams_users.py);
# 2. one benchmark of each optimization on all GPUs of the node: Parm (bench_moe_layer:
#    baseline, s1, s2), the same with the Triton kernels off (MEGATRON_MOE_NO_TRITON=1),
#    Lancet (bench_lancet), Lina (bench_lina), Pro-Prophet (bench_pro_prophet) and Lina's
#    inference scheduling (bench_inference, EP = the GPUs);
# 3. OUT_DIR/report.json: the machine (GPUs, torch, triton, NCCL), the test counts and
#    every benchmark's rows, or its exit status and the tail of its log when it failed.
#
# Environment: NGPU (default: every visible GPU), BENCH_SIZE=small (a quick smoke run) or
# base (default), PYTHON (default: python3). Exits 0 when every test passed and every
# benchmark ran, 1 otherwise (the report is written either way), 2 on bad input.
# Nothing here has been run on a GPU by the authors: no GPU was lent to this project.
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
((NGPU >= 2)) || die "needs at least 2 CUDA GPUs (NGPU=$NGPU): the NCCL tests run one process per GPU"

case $BENCH_SIZE in
    small) MODEL_ARGS=(--num-layers 2 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 1024
                       --seq-length 256 --micro-batch-size 4 --vocab-size 8192)
           PRO_PROPHET_ARGS=(--hidden-size 256 --ffn-hidden-size 1024 --tokens 2048)
           INFERENCE_ARGS=(--layers 2 --hidden 256 --batch-size 8 --prompt-len 64) ;;
    base)  MODEL_ARGS=(--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096
                       --seq-length 1024 --micro-batch-size 4 --vocab-size 50304)
           PRO_PROPHET_ARGS=(--hidden-size 1024 --ffn-hidden-size 4096 --tokens 8192)
           INFERENCE_ARGS=(--layers 4 --hidden 1024 --batch-size 16 --prompt-len 256) ;;
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
echo "== tests (log: $OUT/pytest.log)"
if ! "$PYTHON" -m pytest -q -rs tests/gpu tests/test_kernels.py tests/test_streams.py tests/test_streams_users.py \
        --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1; then
    status=1
fi
tail -n 5 "$OUT/pytest.log"

# ---------------------------------------------------------------- 2. one benchmark of each optimization
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

bench parm bench_moe_layer.py --schedules baseline,s1,s2
MEGATRON_MOE_NO_TRITON=1 bench parm_no_triton bench_moe_layer.py --schedules baseline,s1,s2
bench lancet bench_lancet.py
bench lina bench_lina.py --rounds 2
# their own flags: Pro-Prophet's model of dense FFN + MoE blocks (EP = the GPUs), the inference engine
bench_with pro_prophet bench_pro_prophet.py "${PRO_PROPHET_ARGS[@]}" --skew 0 1.2 --iters 10 --warmup 8
bench_with inference bench_inference.py "${INFERENCE_ARGS[@]}" --experts "$((2 * NGPU))" --skew 1.2 \
    --batches 8 --warmup 2

# ---------------------------------------------------------------- 3. the report
"$PYTHON" - "$OUT" <<'EOF'
import json
import os
import sys
import xml.etree.ElementTree as ET

import torch

out = sys.argv[1]


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
for name in ("parm", "parm_no_triton", "lancet", "lina", "pro_prophet", "inference"):
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
print(f"report: {os.path.join(out, 'report.json')}")
EOF
exit "$status"
