"""Pro-Prophet's placement and the inference engine on CUDA + NCCL, one process per GPU (skipped
without >= 2 GPUs).

NOTHING HERE HAS RUN YET: no machine with 2 or more GPUs has run them. They reuse the CPU tests' code:

  * Pro-Prophet (`tests/test_pro_prophet_placement.py`): EP2 with a forced placement plan
    (scheduled and blocking Trans / Agg, and the planned "heaviest expert to all"), top-1 and
    top-2, equals the same run without placement on the same GPUs: losses, every gradient and
    parameter to 1e-5, the bytes of Trans / Agg and fewer token bytes crossing ranks
    (`_check`, the CPU test's own comparison);
  * inference (`tests/test_inference.py`): the EP4 checkpoint loaded under MP2, EP2 and ESP2 on
    NCCL generates greedily the same tokens as the one-process model on the CPU. A greedy token
    could flip where two logits are within CUDA's round-off of each other; the tiny model's large
    init (std 0.2) keeps its continuations far from ties on the CPU.
"""

from __future__ import annotations

import pytest
from test_gpu_equivalence import HAVE_NCCL, N_GPUS, REASON
from test_inference import NEW, PROMPTS, _layouts, reference_model, saved  # noqa: F401  (saved: the fixture)
from test_pro_prophet_placement import _check, _run_cases

from megatron_moe import convert as cv
from megatron_moe.generation import generate
from megatron_moe.inference.engine import load_weights
from megatron_moe.testing import spawn

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(N_GPUS < 2 or not HAVE_NCCL, reason=REASON)]


def test_nccl_forced_placement_plan_equals_no_placement():
    per_rank = spawn(_run_cases, 2, timeout=900, backend="nccl")
    _check(per_rank, 2)


def test_nccl_greedy_generation_under_mp2_ep2_esp2_equals_one_process_cpu(saved):  # noqa: F811
    root, _, cfg = saved
    ckpt = str(root / "ckpt")
    ref = reference_model(cfg)
    load_weights(ref, cv.read_any(ckpt, progress=False).model, ckpt)
    expect = [generate(ref, p, NEW, temperature=0) for p in PROMPTS]
    per_rank = spawn(_layouts, 2, ckpt, [(2, 1, 1), (1, 2, 1), (1, 1, 2)], None, timeout=900, backend="nccl")
    assert len(per_rank) == 2
    for rank, res in enumerate(per_rank):
        assert sorted(res) == [(1, 1, 2), (1, 2, 1), (2, 1, 1)]
        for layout, got in res.items():
            assert got == expect, f"rank {rank} layout {layout} on NCCL: {got} != {expect}"
