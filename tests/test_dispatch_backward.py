"""The dispatchers' hand-written index backwards equal what autograd gives for the plain index ops.

`_Combine` (every padded dispatcher's combine) and `_PackRows` (the baseline's kept rows with the counts
in the dispatch all-to-all, `PaddedPlan.dense`) replace chains of autograd nodes; their values and
gradients must be those of the expressions they replace, bit for bit (`torch.equal`), and the rows they
leave unwritten must be exactly the rows nothing reads. The experts on row ranges of a received buffer
(`Experts.forward_segments`, the header path's experts) equal the experts on the gathered rows.
"""

import torch

import pytest

from megatron_moe.kernels import cpu_gelu
from megatron_moe.moe.dispatcher import DispatchIndex, _Combine, _PackRows, combine, combine_rows

T, M, R = 6, 5, 16  # tokens, model dim, buffer rows


def _index(seed: int) -> DispatchIndex:
    """Top-2-like choices: 9 kept choices of 6 tokens (tokens repeat), distinct buffer rows, weights."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    token = torch.tensor([0, 0, 1, 2, 2, 3, 4, 5, 5], device="cpu")
    row = torch.randperm(R, generator=g, device="cpu")[: token.numel()]
    return DispatchIndex(token, row, torch.rand(token.numel(), generator=g, device="cpu"))


def _combine_on(kernel: bool, monkeypatch) -> None:
    """Run the combine on the C kernel (skip without a compiler) or on aten's index ops."""
    if not kernel:
        monkeypatch.setenv("MEGATRON_MOE_NO_CPU_KERNELS", "1")
    elif "no C compiler" in cpu_gelu.status():
        pytest.skip(cpu_gelu.status())


@pytest.mark.parametrize("kernel", [True, False])
def test_combine_values_and_gradients_equal_autograd_of_the_index_ops(kernel, monkeypatch):
    """Both implementations of `_Combine`: aten's index ops (bitwise), and on CPU float32 the C loops of
    `cpu_gelu.combine_forward` / `combine_backward` (values and the buffer's gradient bitwise; the weights'
    gradient sums its products in another order)."""
    _combine_on(kernel, monkeypatch)
    idx = _index(0)
    g = torch.Generator(device="cpu").manual_seed(1)
    buf = torch.randn(R, M, generator=g, device="cpu")
    gy = torch.randn(T, M, generator=g, device="cpu")
    out = []
    for hand in (False, True):
        b, w = buf.clone().requires_grad_(), idx.weight.clone().requires_grad_()
        if hand:
            y = _Combine.apply(b, idx.row, idx.token, w, T, True)
        else:  # the expression `combine` used before
            rows = b.index_select(0, idx.row) * w[:, None].to(b.dtype)
            y = b.new_zeros(T, M).index_add_(0, idx.token, rows)
        (y * gy).sum().backward()
        out.append((y.detach(), b.grad, w.grad))
    assert torch.equal(out[1][0], out[0][0]) and torch.equal(out[1][1], out[0][1])
    if kernel:
        torch.testing.assert_close(out[1][2], out[0][2], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(out[1][2], out[0][2])
    assert torch.count_nonzero(out[1][1].abs().sum(1)) == idx.row.numel()  # unread rows: zero gradient


@pytest.mark.parametrize("kernel", [True, False])
def test_combine_rows_equals_autograd_of_the_weighted_index_add(kernel, monkeypatch):
    """`combine_rows` (one rank holding every expert: choice i's output is row i) through `_Combine`."""
    _combine_on(kernel, monkeypatch)
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


def test_combine_without_zero_rest_writes_the_read_rows_alike():
    idx = _index(2)
    buf = torch.randn(R, M, generator=torch.Generator(device="cpu").manual_seed(3), device="cpu")
    grads = []
    for zero_rest in (True, False):
        b = buf.clone().requires_grad_()
        combine(b, idx, T, zero_rest=zero_rest).pow(2).sum().backward()
        grads.append(b.grad)
    assert torch.equal(grads[1][idx.row], grads[0][idx.row])
    assert grads[0][idx.row].abs().sum() > 0


def test_pack_rows_gathers_every_row_in_one_op_and_sums_only_the_kept_rows_gradients():
    idx = _index(4)
    g = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(T, M, generator=g, device="cpu")
    g_send = torch.randn(R, M, generator=g, device="cpu")
    src = torch.zeros(R, dtype=torch.int64, device="cpu").index_put_((idx.row,), idx.token)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    send = _PackRows.apply(xa, src, idx.token, idx.row)
    ref = xb.new_zeros(R, M).index_copy_(0, idx.row, xb.index_select(0, idx.token))  # the zero-filled dispatch
    assert torch.equal(send[idx.row], ref[idx.row])
    assert torch.equal(send, x[src])  # rows without a kept token hold token 0's row, never read
    (send * g_send).sum().backward()
    (ref * g_send).sum().backward()
    assert torch.equal(xa.grad, xb.grad)  # the unkept rows' gradient (nonzero here) is ignored


def test_experts_on_row_ranges_of_a_buffer_equal_the_experts_on_the_gathered_rows():
    """`Experts.forward_segments`: the ranges' outputs and gradients equal `forward_ragged` on the same rows
    gathered (the per-expert weight gradients summed over the ranges), whatever the rows outside the ranges
    hold (nan here): nothing reads them, and the buffer's gradient there is never used either."""
    from megatron_moe.moe.experts import Experts
    from megatron_moe.parallel_state import local_state

    experts = Experts(3, 8, 24, local_state(), seed=3, name="e", device=torch.device("cpu"))
    with torch.no_grad():
        experts.fc_b.normal_(std=0.1, generator=torch.Generator(device="cpu").manual_seed(8))
        experts.proj_b.normal_(std=0.1, generator=torch.Generator(device="cpu").manual_seed(9))
    segments = [[(0, 3), (10, 14)], [], [(5, 7), (16, 17), (20, 24)]]  # expert 1: no rows
    rows = torch.tensor([r for segs in segments for lo, hi in segs for r in range(lo, hi)], device="cpu")
    g = torch.Generator(device="cpu").manual_seed(10)
    buf = torch.full((26, 8), float("nan"), device="cpu")
    buf[rows] = torch.randn(rows.numel(), 8, generator=g, device="cpu")
    gy = torch.full((26, 8), float("nan"), device="cpu")
    gy[rows] = torch.randn(rows.numel(), 8, generator=g, device="cpu")
    xb = buf.clone().requires_grad_()
    y = experts(xb, segments=segments)
    (y[rows] * gy[rows]).sum().backward()
    got = [xb.grad[rows]] + [p.grad.clone() for p in experts.parameters()]
    experts.zero_grad(set_to_none=True)
    xr = buf[rows].clone().requires_grad_()
    counts = [sum(hi - lo for lo, hi in segs) for segs in segments]
    y_ref = experts.forward_ragged(xr, counts)
    (y_ref * gy[rows]).sum().backward()
    torch.testing.assert_close(y[rows], y_ref, rtol=0, atol=1e-6)
    for a, b in zip(got, [xr.grad] + [p.grad for p in experts.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got[1][1].abs().sum() == 0 and got[4][1].abs().sum() == 0  # the expert without rows: zero gradient


def _layer_paths(rank, world):
    """EP2 baseline, one ESP rank, kept rows: the header path (counts in the dispatch all-to-all, dense slots:
    the hand-written gathers) against the overlap path (autograd's index ops) and the padded layer."""
    from equivalence import tiny_config
    from megatron_moe.moe.layer import MoELayer
    from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel

    ps = initialize_model_parallel(1, 2, 1)
    try:
        got, dense = {}, []
        for path in ("kept", "overlap", "padded"):
            cfg = tiny_config(k=2, cf=1.25, moe_expert_path="kept" if path == "padded" else path)
            cfg.moe.moe_kept_only = path != "padded"
            cfg.model.ffn_hidden_size = 128
            layer = MoELayer(cfg, ps, seed=7, name="moe", layer_idx=1)
            g = torch.Generator(device="cpu").manual_seed(40 + rank)
            x = torch.randn(2, cfg.model.seq_length, cfg.model.hidden_size, generator=g, device="cpu")
            x.requires_grad_()
            if path == "kept":
                routes, _, _ = layer.route(x.detach().reshape(1, -1, x.size(-1)), split=False)
                plan = layer.dispatcher.plan(routes, "kept")
                dense.append((plan.header == 0 and plan.sent is not None, plan.dense))
            y, aux = layer(x)
            (y.pow(2).sum() + aux).backward()
            got[path] = (y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()})
        return got, dense
    finally:
        destroy_model_parallel()


def test_two_process_dense_header_path_equals_the_overlap_path_bitwise_and_the_padded_layer():
    from megatron_moe.testing import spawn

    for got, dense in spawn(_layer_paths, 2):
        assert dense == [(True, True)]  # the counts ride the all-to-all and every block's kept slots lead it
        kept, overlap, padded = got["kept"], got["overlap"], got["padded"]
        assert torch.equal(kept[0], overlap[0]) and torch.equal(kept[1], overlap[1])
        assert kept[2].keys() == overlap[2].keys()
        for n in kept[2]:
            assert torch.equal(kept[2][n], overlap[2][n]), n
            torch.testing.assert_close(kept[2][n], padded[2][n], rtol=0, atol=1e-6, msg=n)
        torch.testing.assert_close(kept[0], padded[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(kept[1], padded[1], rtol=0, atol=1e-6)


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
