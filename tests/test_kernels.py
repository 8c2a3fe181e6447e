"""The Triton MoE kernels equal the torch path, forward and backward (on CUDA tensors when a GPU is
present, else on CPU tensors under TRITON_INTERPRET=1, which tests/conftest.py sets): token permute (dispatch), unpermute with combine weights (combine), and top-k
softmax gating with capacity slots (the router's `route`), top-1 and top-2, with drops and dropless."""

import os
from pathlib import Path

import pytest
import torch

from megatron_moe import kernels
from megatron_moe.moe.dispatcher import combine, dispatch, dispatch_index
from megatron_moe.moe.router import capacity, route

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEEDS_TRITON = [
    pytest.mark.skipif(
        not kernels.HAVE_TRITON,
        reason=f"triton is not importable ({kernels.TRITON_ERROR}): pip install -r requirements-gpu.txt",
    ),
    pytest.mark.skipif(
        DEV.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
        reason="no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it before triton loads)",
    ),
]
S, E, M = 150, 6, 40  # S > one token block (64): the slot scan carries counts across blocks


def needs_triton(fn):
    """The skip conditions of a test that runs the kernels."""
    for mark in NEEDS_TRITON:
        fn = mark(fn)
    return fn


CPU = torch.device("cpu")  # the torch references run here (on a GPU machine they would take the Triton path)


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=CPU)


def _logits(seed: int) -> torch.Tensor:
    return _randn(torch.Generator().manual_seed(seed), S, E) * 2.0


def _route(k: int, cf: float, seed: int = 0):
    return route(_logits(seed), k, cf, 1, dropless=cf == 0)


def _dev(*ts: torch.Tensor):
    return [t.to(DEV) for t in ts]


@needs_triton
def test_use_triton_only_for_cuda_tensors():
    assert kernels.use_triton(torch.zeros(1, device=CPU)) is False
    if DEV.type == "cuda":
        assert kernels.use_triton(torch.zeros(1, device=DEV)) is True


@needs_triton
@pytest.mark.parametrize("k", [1, 2])
def test_permute_equals_torch_dispatch_forward_and_backward(k):
    r = _route(k, 0.5)
    assert r.num_dropped > 0, "the case must drop tokens"
    idx = dispatch_index(r)
    rows = E * r.capacity
    g = torch.Generator().manual_seed(1)
    x, up = _randn(g, S, M), _randn(g, rows, M)
    x_ref, x_tri = x.clone().requires_grad_(), x.to(DEV).requires_grad_()
    ref = dispatch(x_ref, idx, rows)
    token, row, up_dev = _dev(idx.token, idx.row, up)
    tri = kernels.permute(x_tri, token, row, rows)
    assert torch.equal(tri.cpu(), ref)
    (ref * up).sum().backward()
    (tri * up_dev).sum().backward()
    assert torch.equal(x_tri.grad.cpu(), x_ref.grad)  # <= 2 fp32 adds onto zero per token: exact


@needs_triton
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("cf", [0.5, 0.0])  # 0.0: dropless
def test_unpermute_equals_torch_combine_forward_and_backward(k, cf):
    r = _route(k, cf)
    assert (r.num_dropped > 0) == (cf > 0)
    idx = dispatch_index(r)
    rows = E * r.capacity
    g = torch.Generator().manual_seed(2)
    buf, up = _randn(g, rows, M), _randn(g, S, M)
    w = idx.weight.detach()
    b_ref, w_ref = buf.clone().requires_grad_(), w.clone().requires_grad_()
    b_tri, w_tri = buf.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()
    ref = combine(b_ref, type(idx)(idx.token, idx.row, w_ref), S)
    token, row, up_dev = _dev(idx.token, idx.row, up)
    tri = kernels.unpermute(b_tri, token, row, w_tri, S)
    (ref * up).sum().backward()
    (tri * up_dev).sum().backward()
    assert torch.equal(tri.cpu(), ref)
    assert torch.equal(b_tri.grad.cpu(), b_ref.grad)
    torch.testing.assert_close(w_tri.grad.cpu(), w_ref.grad, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("cf", [0.5, 1.0, 0.0])
def test_topk_gating_equals_the_router_forward_and_backward(k, cf):
    ref = _route(k, cf, seed=3)
    cap = S if cf == 0 else capacity(S, E, k, cf, 1)
    assert ref.capacity == cap and (ref.num_dropped > 0) == (cf > 0)
    logits = _logits(3)
    gates, expert, slot, weight = (t.cpu() for t in kernels.topk_gating(logits.to(DEV), k, cap))
    assert torch.equal(expert, ref.expert) and torch.equal(slot, ref.slot)
    torch.testing.assert_close(gates, ref.gates, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weight, ref.weight, rtol=1e-6, atol=1e-7)
    g = torch.Generator().manual_seed(4)
    a, b = _randn(g, S, E), _randn(g, S, k)
    leaf_ref, leaf_tri = logits.clone().requires_grad_(), logits.to(DEV).requires_grad_()
    r = route(leaf_ref, k, cf, 1, dropless=cf == 0)
    ((r.gates * a).sum() + (r.weight * b).sum()).backward()
    gt, _, _, wt = kernels.topk_gating(leaf_tri, k, cap)
    a_dev, b_dev = _dev(a, b)
    ((gt * a_dev).sum() + (wt * b_dev).sum()).backward()
    torch.testing.assert_close(leaf_tri.grad.cpu(), leaf_ref.grad, rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("cf", [0.5, 0.25, 0.0])  # top-2 at 0.5: tokens keep 0, 1 or 2; at 0.25: 0 or 1
def test_gating_backward_kernel_equals_autograd_of_the_torch_formulas(k, cf):
    """The backward kernel alone against torch autograd of the same formulas (`gating_weights`), with
    an upstream gradient on the gates and on the weights, drops (kept / dropped / both dropped)."""
    cap = S if cf == 0 else capacity(S, E, k, cf, 1)
    logits = _logits(5)
    ref = route(logits, k, cf, 1, dropless=cf == 0)
    expert, slot = ref.expert, ref.slot
    kept = (slot >= 0).sum(dim=1)
    assert (kept < k).any() == (cf > 0)
    assert k == 1 or (kept == 0).any() == (cf > 0)  # top-2 tokens with both choices dropped
    g = torch.Generator().manual_seed(6)
    a, b = _randn(g, S, E), _randn(g, S, k)
    leaf = logits.clone().requires_grad_()
    gates, weight = kernels.gating_weights(leaf, expert, slot)
    torch.autograd.backward([gates, weight], [a, b])
    args = _dev(gates.detach(), expert, slot, a, b)
    got = kernels.gating_backward(*args).cpu()
    assert got.dtype == torch.float32 and cap == ref.capacity
    torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-7)
    # the weights' gradient reaches the logits where a weight varies: top-1 kept, or top-2 with both
    # kept (a top-2 token keeping one choice has weight 1: nothing flows back)
    without = kernels.gating_backward(*args[:4], torch.zeros_like(args[4])).cpu()
    varies = (kept >= 1).any() if k == 1 else (kept == 2).any()
    assert bool(varies) == (k == 1 or cf != 0.25)
    assert ((without - leaf.grad).abs().max().item() > 1e-3) == bool(varies)


@needs_triton
def test_topk_gating_refuses_k_3():  # the router takes torch's path for k > 2 (`moe.router.route`)
    with pytest.raises(ValueError, match="the fused gating kernel routes top-1 or top-2, got k=3"):
        kernels.topk_gating(_logits(0).to(DEV), 3, 10)


def test_requirements_gpu_repeats_the_gpu_extra():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    root = Path(__file__).resolve().parents[1]
    with open(root / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["gpu"]
    lines = [ln.split("#", 1)[0].strip() for ln in (root / "requirements-gpu.txt").read_text().splitlines()]
    assert [ln for ln in lines if ln and not ln.startswith("-r ")] == extra == ["triton>=2.3"]
