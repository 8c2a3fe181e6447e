"""The dispatchers' hand-written index backwards equal what autograd gives for the plain index ops.

`_Combine` (every padded dispatcher's combine) replaces a chain of autograd nodes; its values and
gradients must be those of the expression it replaces, bit for bit (`torch.equal`). The grouped experts
equal autograd through each expert's own MLP.
"""

import torch

from megatron_moe.moe.dispatcher import DispatchIndex, _Combine, combine_rows

T, M, R = 6, 5, 16  # tokens, model dim, buffer rows


def _index(seed: int) -> DispatchIndex:
    """Top-2-like choices: 9 kept choices of 6 tokens (tokens repeat), distinct buffer rows, weights."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    token = torch.tensor([0, 0, 1, 2, 2, 3, 4, 5, 5], device="cpu")
    row = torch.randperm(R, generator=g, device="cpu")[: token.numel()]
    return DispatchIndex(token, row, torch.rand(token.numel(), generator=g, device="cpu"))


def test_combine_values_and_gradients_equal_autograd_of_the_index_ops():
    """`_Combine`'s values and both gradients equal autograd's of the index ops, bit for bit."""
    idx = _index(0)
    g = torch.Generator(device="cpu").manual_seed(1)
    buf = torch.randn(R, M, generator=g, device="cpu")
    gy = torch.randn(T, M, generator=g, device="cpu")
    out = []
    for hand in (False, True):
        b, w = buf.clone().requires_grad_(), idx.weight.clone().requires_grad_()
        if hand:
            y = _Combine.apply(b, idx.row, idx.token, w, T)
        else:  # the expression `combine` used before
            rows = b.index_select(0, idx.row) * w[:, None].to(b.dtype)
            y = b.new_zeros(T, M).index_add_(0, idx.token, rows)
        (y * gy).sum().backward()
        out.append((y.detach(), b.grad, w.grad))
    assert torch.equal(out[1][0], out[0][0]) and torch.equal(out[1][1], out[0][1])
    assert torch.equal(out[1][2], out[0][2])
    assert torch.count_nonzero(out[1][1].abs().sum(1)) == idx.row.numel()  # unread rows: zero gradient


def test_combine_rows_equals_autograd_of_the_weighted_index_add():
    """`combine_rows` (one rank holding every expert: choice i's output is row i) through `_Combine`."""
    idx = _index(8)
    g = torch.Generator(device="cpu").manual_seed(9)
    y_KM = torch.randn(idx.token.numel(), M, generator=g, device="cpu")
    gy = torch.randn(T, M, generator=g, device="cpu")
    a, wa = y_KM.clone().requires_grad_(), idx.weight.clone().requires_grad_()
    b, wb = y_KM.clone().requires_grad_(), idx.weight.clone().requires_grad_()
    ya = combine_rows(a, DispatchIndex(idx.token, idx.row, wa), T)
    yb = b.new_zeros(T, M).index_add_(0, idx.token, b * wb[:, None])
    assert torch.equal(ya, yb)
    (ya * gy).sum().backward()
    (yb * gy).sum().backward()
    assert torch.equal(a.grad, b.grad)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-6, atol=1e-6)


def test_grouped_mlp_values_and_gradients_equal_autograd_of_each_experts_mlp():
    """`Experts.forward_ragged` (one `_GroupedMLP`: preallocated outputs, the activation's gradient computed in
    place in one shared buffer) against autograd through each expert's own linear -> tanh-GELU -> linear."""
    from megatron_moe.moe.experts import Experts
    from megatron_moe.parallel_state import local_state

    experts = Experts(3, 8, 24, local_state(), seed=3, name="e", device=torch.device("cpu"))
    with torch.no_grad():  # nonzero biases, so their gradients and their place in the output are checked too
        experts.fc_b.normal_(std=0.1, generator=torch.Generator(device="cpu").manual_seed(8))
        experts.proj_b.normal_(std=0.1, generator=torch.Generator(device="cpu").manual_seed(9))
    counts = [5, 0, 7]  # an expert without rows too
    g = torch.Generator(device="cpu").manual_seed(10)
    x = torch.randn(sum(counts), 8, generator=g, device="cpu").requires_grad_()
    gy = torch.randn(sum(counts), 8, generator=g, device="cpu")
    (experts.forward_ragged(x, counts) * gy).sum().backward()
    got = [x.grad] + [p.grad for p in (experts.fc_w, experts.fc_b, experts.proj_w, experts.proj_b)]
    params = [p.detach().clone().requires_grad_() for p in (experts.fc_w, experts.fc_b, experts.proj_w, experts.proj_b)]
    xr = x.detach().clone().requires_grad_()
    ys, lo = [], 0
    for e, n in enumerate(counts):
        fc_w, fc_b, proj_w, proj_b = (p[e] for p in params)
        h = torch.nn.functional.gelu(torch.addmm(fc_b, xr[lo : lo + n], fc_w.t()), approximate="tanh")
        ys.append(torch.addmm(proj_b, h, proj_w.t()))
        lo += n
    y_ref = torch.cat(ys)
    torch.testing.assert_close(experts.forward_ragged(x.detach(), counts), y_ref.detach(), rtol=0, atol=1e-6)
    (y_ref * gy).sum().backward()
    for a, b in zip(got, [xr.grad] + [p.grad for p in params]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert got[1][1].abs().sum() == 0 and got[3][1].abs().sum() == 0  # the expert without rows: zero gradient
