"""--compile: torch.compile per block keeps the bf16 run's losses and gradients within the bf16
tolerances of tests/test_bf16.py (a dense block compiled whole, an MoE block its attention and layer
norms), and refuses Lancet, whose dW queue replaces the linears' autograd."""

import pytest
import torch

from equivalence import global_batch, tiny_config
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.optimizations import check_combination
from megatron_moe.parallel_state import local_state
from test_bf16 import FIRST_TOL, TOL

STEPS = 3


def _curve(compiled: bool):
    cfg = tiny_config(k=2, cf=1.25)  # block 0 dense, block 1 MoE
    torch.manual_seed(0)
    model = GPT2MoE(cfg, local_state())
    if compiled:
        model.compile_blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], None
    for step in range(STEPS):
        ids, labels = global_batch(1, seed=step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lm, aux = model(ids, labels)
        (lm + aux).backward()
        losses.append(float(lm.detach()))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def test_compiled_blocks_follow_the_eager_bf16_curve():
    eager, g_eager = _curve(False)
    compiled, g_comp = _curve(True)
    assert abs(compiled[0] - eager[0]) < FIRST_TOL
    assert max(abs(a - b) for a, b in zip(compiled, eager)) < TOL
    for name, g in g_eager.items():
        assert (g_comp[name] - g).abs().max().item() < TOL, name


def test_compile_refuses_lancet():
    cfg = tiny_config()
    cfg.train.compile, cfg.opts.lancet_wgrad = True, True
    with pytest.raises(ValueError, match="--compile cannot be combined with --lancet-wgrad"):
        check_combination(cfg)
