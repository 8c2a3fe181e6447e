"""The equivalence tests on CUDA + NCCL, one process per GPU (skipped without >= 2 GPUs).

NOTHING HERE HAS RUN YET: no machine with 2 or more GPUs has run them. These tests
are the check a user with GPUs runs (`scripts/gpu_check.sh` runs them and writes a
JSON report). They reuse the CPU tests' helpers:

  * layouts, Parm (S1 / S2 with SAA) and dropless: `tests/equivalence.py`'s
    `run_layout` in every rank (NCCL, rank r on GPU r: `megatron_moe.testing.spawn(...,
    backend="nccl")`), compared with the one-process CPU reference
    (`reference`): same drops, loss and every gradient to `ATOL`;
  * Lina and Lancet: the trainer (`pretrain_gpt_moe.py --device cuda` under
    torchrun) with each switch, compared with the plain CUDA run (same curve to
    `RTOL_SWITCH`) and the plain run on CPU / gloo (`RTOL_DEVICE`).

Tolerances are looser than the CPU tests' (1e-5): CUDA's kernels (SDPA,
matmul, the Triton gating and combine) round differently from the CPU's, and
NCCL sums in another order than gloo. Pro-Prophet's placement and the inference
engine on NCCL: tests/gpu/test_gpu_placement_inference.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from equivalence import compare, reference, run_layout, tiny_config
from tiny_run import tiny_args

from megatron_moe.testing import free_port, spawn

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
HAVE_NCCL = torch.distributed.is_available() and torch.distributed.is_nccl_available()
REASON = (
    f"needs at least 2 CUDA GPUs and NCCL (found {N_GPUS} GPU(s), NCCL "
    f"{'available' if HAVE_NCCL else 'not available'}); these tests have not run on any machine yet"
)
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(N_GPUS < 2 or not HAVE_NCCL, reason=REASON)]
ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4
RTOL_SWITCH, RTOL_DEVICE = 1e-4, 2e-3

# (mp, ep, esp) on 2 GPUs: the expert layout is independent of MP, so MP2 x EP2 fits on P = 2
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 1, 1)]
PARM = [((2, 2, 1), "s1"), ((2, 2, 1), "s2"), ((2, 1, 2), "s2")]
SUITES = {
    "layouts": [(layout, {"k": k}) for layout in LAYOUTS for k in (1, 2)],
    "parm": [(layout, {"k": k, "schedule": s}) for layout, s in PARM for k in (1, 2)],
    "parm-aas": [((2, 2, 1), {"k": 2, "schedule": "s2", "moe_saa": False})],
    "dropless": [(layout, {"k": k, "moe_dropless": True}) for layout in LAYOUTS for k in (1, 2)],
}


def _rank_suite(rank: int, world: int, cases: list) -> list[dict]:
    """Every case of a suite under NCCL on this rank's GPU (CUDA events in the comm records are
    dropped: they do not pickle)."""
    out = []
    for (mp, ep, esp), kw in cases:
        res = run_layout(tiny_config(**kw), mp, ep, esp)
        res.pop("records", None)
        out.append(res)
    return out


@pytest.mark.parametrize("suite", list(SUITES))
def test_nccl_layout_matches_one_process_cpu_reference(suite):
    cases = SUITES[suite]
    per_rank = spawn(_rank_suite, 2, cases, timeout=900, backend="nccl")
    for i, ((mp, ep, esp), kw) in enumerate(cases):
        ref = reference(tiny_config(**kw), 2 // mp)
        compare([per_rank[r][i] for r in range(2)], ref, f"NCCL {suite} MP{mp} EP{ep} ESP{esp} {kw}", atol=ATOL)


# ---------------------------------------------------------------- Lina and Lancet through the trainer
SWITCHES = {
    "lina": ["--lina"],
    "lancet-wgrad": ["--lancet-wgrad"],
    "lancet-partition": ["--lancet-partition"],
    "lina+lancet": ["--lina", "--lancet-wgrad", "--lancet-partition"],
}


def _train(data: str, tmp: Path, name: str, device: str, flags: list[str]) -> list[float]:
    """Losses of a 4-iteration EP2 run on 2 processes (torchrun) on `device`."""
    log = tmp / f"{name}-{device}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(ROOT / "pretrain_gpt_moe.py"),
        *tiny_args(
            data,
            4,
            "--expert-model-parallel-size",
            "2",
            "--device",
            device,
            *flags,
            "--log-interval",
            "1",
            "--log-json",
            str(log),
        ),
    ]
    # MMOE_CHOOSE: partition every MoE block whatever the planner predicts for this tiny model
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MMOE_CHOOSE": "lancet partitions=2"}
    env.pop("TRITON_INTERPRET", None)  # the compiled kernels on the GPU
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, f"{' '.join(cmd)}:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    with open(log) as f:
        recs = [json.loads(line) for line in f]
    return [r["loss"] for r in recs if r.get("split", "train") == "train" and "grad_norm" in r]


@pytest.fixture(scope="module")
def plain_curves(sample_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    return {dev: _train(sample_data, tmp, "plain", dev, []) for dev in ("cuda", "cpu")}


def test_plain_cuda_run_matches_the_cpu_run(plain_curves):
    cuda, cpu = plain_curves["cuda"], plain_curves["cpu"]
    assert len(cuda) == len(cpu) == 4
    for i, (a, b) in enumerate(zip(cuda, cpu)):
        assert abs(a - b) <= RTOL_DEVICE * max(1.0, abs(b)), f"iteration {i + 1}: CUDA loss {a} vs CPU {b}"


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_switch_on_cuda_matches_the_plain_cuda_run(sample_data, tmp_path, plain_curves, switch):
    curve = _train(sample_data, tmp_path, switch, "cuda", SWITCHES[switch])
    assert len(curve) == len(plain_curves["cuda"])
    for i, (a, b) in enumerate(zip(curve, plain_curves["cuda"])):
        assert abs(a - b) <= RTOL_SWITCH * max(1.0, abs(b)), f"{switch} iteration {i + 1}: loss {a} vs plain {b}"
