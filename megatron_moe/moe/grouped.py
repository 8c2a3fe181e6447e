"""The experts' MLPs as grouped GEMMs: every local expert in one call per GEMM, in the compute dtype.

Legend: R rows of the expert input, X experts in the call (local experts, or owned experts and
replicas), M model dim, H ffn hidden dim of this ESP rank.

The rows are grouped by expert: expert e owns rows [offs[e-1], offs[e]) (offs [X] int32, cumulative,
on the device: nothing about the split reaches the host). Rows at and after offs[X-1] belong to no
expert (a fixed-size buffer whose tail holds dropped choices, `moe.dispatcher.local_plan`): their
outputs and input gradients are zero.

    y = gelu_tanh(x W1_e^T + b1_e) W2_e^T + b2_e        for the rows of expert e

Each GEMM is one `torch._grouped_mm` (CUTLASS grouped GEMM on CUDA, a loop on CPU), in the compute
dtype: autocast's when it is on (autocast does not list `_grouped_mm` on every device), else the
input's. Weight gradients are cast to the parameters' dtype, as autocast's linear does. A dW queue
(`lancet.wgrad_runtime`) can take the two weight-gradient GEMMs as `GroupedRows` and run them later.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron_moe.layers.fused import gelu_tanh, gelu_tanh_backward

_ALIGN_BYTES = 16  # the grouped GEMM's stride rule


class GroupedRows(NamedTuple):
    """Operands of a grouped weight gradient: d W[e] = g[rows of e]^T x[rows of e], [X, O, I]."""

    g: torch.Tensor  # [R, O]
    x: torch.Tensor  # [R, I]
    offs: torch.Tensor  # [X] int32


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM on `t` runs in: autocast's when it is on for t's device, else t's own."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def _pad_to(t: torch.Tensor, dim: int, mult: int) -> torch.Tensor:
    n = t.size(dim)
    extra = -n % mult
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t, pad)


def _aligned(t: torch.Tensor) -> bool:
    mult = _ALIGN_BYTES // t.element_size()
    return t.data_ptr() % _ALIGN_BYTES == 0 and all(s % mult == 0 for s in t.stride() if s != 1)


def gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs)`: a [R, K] x b [X, K, N] -> [R, N] (expert e's rows times b[e]),
    or a [K, R] x b [R, N] -> [X, K, N] (groups along R). Operands whose strides break the grouped
    GEMM's 16-byte rule (tiny test models) are zero-padded copies, which changes no value."""
    with torch.autocast(a.device.type, enabled=False):
        if _aligned(a) and _aligned(b):
            try:
                return torch._grouped_mm(a, b, offs=offs)
            except RuntimeError:
                if a.device.type != "cuda":
                    raise
                return _looped(a, b, offs)  # a dtype or GPU the grouped kernel does not take
        mult = _ALIGN_BYTES // a.element_size()
        if b.dim() == 3:  # [R, K] x [X, K, N]: pad K on both, N on b
            N = b.size(2)
            ap = _pad_to(a, 1, mult).contiguous()
            bp = _pad_to(_pad_to(b, 1, mult), 2, mult).contiguous()
            return torch._grouped_mm(ap, bp, offs=offs)[:, :N]
        # [K, R] x [R, N] -> [X, K, N]: pad K on a (kept K-major: a transposed row block), N on b
        K, N = a.size(0), b.size(1)
        ap = _pad_to(a.t(), 1, mult).contiguous().t()
        bp = _pad_to(b, 1, mult).contiguous()
        return torch._grouped_mm(ap, bp, offs=offs)[:, :K, :N]


def _looped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`gmm` one group at a time, for CUDA dtypes or GPUs without a grouped kernel (fp32 training, say):
    reading the offsets costs one host sync per call, which the bf16 path never pays."""
    ends = [0] + offs.tolist()
    if b.dim() == 3:
        out = a.new_zeros(a.size(0), b.size(2))
        for e in range(b.size(0)):
            out[ends[e] : ends[e + 1]] = a[ends[e] : ends[e + 1]] @ b[e]
        return out
    return torch.stack([a[:, ends[e] : ends[e + 1]] @ b[ends[e] : ends[e + 1]] for e in range(len(ends) - 1)])


def wgrad(rows: GroupedRows) -> torch.Tensor:
    """d W [X, O, I] of `GroupedRows` (groups with no rows: zeros)."""
    return gmm(rows.g.t(), rows.x, rows.offs)


def _row_experts(offs: torch.Tensor, R: int) -> torch.Tensor:
    """Expert of every row [R] int64 (X for a row past the last expert's)."""
    return torch.searchsorted(offs, torch.arange(R, device=offs.device, dtype=torch.int32), right=True)


def _sum_by_expert(t: torch.Tensor, eid: torch.Tensor, X: int, dtype: torch.dtype) -> torch.Tensor:
    """Per expert, the sum of its rows of t [R, D] -> [X, D] in `dtype` (rows of no expert dropped)."""
    return t.new_zeros(X + 1, t.size(1), dtype=dtype).index_add_(0, eid, t.to(dtype))[:X]


class Saved(NamedTuple):
    """What the backward of one grouped MLP needs (`mlp_forward`)."""

    x: torch.Tensor
    offs: torch.Tensor
    eid: torch.Tensor  # expert of every row (X: none)
    a: torch.Tensor  # pre-activation [R, H]
    h: torch.Tensor  # activation [R, H]
    fc_w: torch.Tensor
    proj_w: torch.Tensor
    tail: bool
    bias_dtypes: tuple


def mlp_forward(x, offs, fc_w, fc_b, proj_w, bias, tail: bool) -> tuple[torch.Tensor, Saved]:
    """y [R, M] of the module docstring, no autograd (x, fc_w, proj_w in the compute dtype; biases any)."""
    X, R = fc_w.size(0), x.size(0)
    eid = _row_experts(offs, R)
    at = eid.clamp(max=X - 1)
    a = gmm(x, fc_w.transpose(1, 2), offs).add_(fc_b.to(x.dtype).index_select(0, at))
    h = gelu_tanh(a)
    y = gmm(h, proj_w.transpose(1, 2), offs).add_(bias.to(x.dtype).index_select(0, at))
    if tail:  # rows of no expert: zeros (the grouped GEMM leaves them unwritten)
        y = torch.where((eid < X)[:, None], y, 0)
    return y, Saved(x, offs, eid, a, h, fc_w, proj_w, tail, (fc_b.dtype, bias.dtype))


def mlp_backward(gy: torch.Tensor, s: Saved):
    """(dx, d_fc_b, d_bias, fc1 rows, fc2 rows) from gy [R, M]: the weights' gradients as `GroupedRows`
    (`wgrad` computes them; a dW queue computes them later)."""
    X = s.fc_w.size(0)
    gy = gy.to(s.x.dtype).contiguous()
    # rows past the experts' (`tail`) hold no values in dh, da and dx: the sums by expert put them in a
    # spare row that is cut off, the grouped weight gradients read rows up to offs[-1] only, and dx is
    # masked, so that nothing from them reaches the tokens' gradients
    d_bias = _sum_by_expert(gy, s.eid, X, s.bias_dtypes[1])
    da = gelu_tanh_backward(gmm(gy, s.proj_w, s.offs), s.a)
    d_fc_b = _sum_by_expert(da, s.eid, X, s.bias_dtypes[0])
    dx = gmm(da, s.fc_w, s.offs)
    if s.tail:
        dx = torch.where((s.eid < X)[:, None], dx, 0)
    return dx, d_fc_b, d_bias, GroupedRows(da, s.x, s.offs), GroupedRows(gy, s.h, s.offs)


class _GroupedMLP(torch.autograd.Function):
    """`mlp_forward` / `mlp_backward` as one autograd node."""

    @staticmethod
    def forward(ctx, x, offs, fc_w, fc_b, proj_w, bias, tail: bool, defer):
        y, saved = mlp_forward(x, offs, fc_w, fc_b, proj_w, bias, tail)
        ctx.saved, ctx.defer = saved, defer
        return y

    @staticmethod
    def backward(ctx, gy):
        dx, d_fc_b, d_bias, fc1, fc2 = mlp_backward(gy, ctx.saved)
        del ctx.saved
        if ctx.defer is not None:  # the weights' dW GEMMs by the queue (`lancet.wgrad_runtime`)
            ctx.defer.submit(fc2, fc1)
            return dx, None, None, d_fc_b, None, d_bias, None, None
        return dx, None, wgrad(fc1), d_fc_b, wgrad(fc2), d_bias, None, None


def grouped_mlp(
    x_RM: torch.Tensor,
    offs: torch.Tensor,
    fc_w: torch.Tensor,
    fc_b: torch.Tensor,
    proj_w: torch.Tensor,
    bias: torch.Tensor,
    tail: bool = False,
    defer=None,
) -> torch.Tensor:
    """y [R, M] in the compute dtype (module docstring): fc_w [X, H, M], fc_b [X, H], proj_w [X, M, H],
    bias [X, M] (each ESP rank's partial output carries its own columns of the bias). `tail`: rows at
    and after offs[X-1] may exist (they give zeros). `defer`: a dW queue's handle (`ExpertDW`), which
    then gets the two weight-gradient GEMMs; fc_w and proj_w get no gradient from this call."""
    dt = compute_dtype(x_RM)
    return _GroupedMLP.apply(x_RM.to(dt), offs, fc_w.to(dt), fc_b, proj_w.to(dt), bias, tail, defer)


def expert_rows_mlp(
    x_RM: torch.Tensor,
    counts: list[int],
    fc_w: torch.Tensor,
    fc_b: torch.Tensor,
    proj_w: torch.Tensor,
    bias: torch.Tensor,
    defer=None,
) -> torch.Tensor:
    """`grouped_mlp` of rows grouped by expert with host `counts` (sum = R)."""
    ends, total = [], 0
    for c in counts:
        total += int(c)
        ends.append(total)
    offs = to_device(torch.tensor(ends, dtype=torch.int32, device="cpu"), x_RM.device)
    return grouped_mlp(x_RM, offs, fc_w, fc_b, proj_w, bias, False, defer)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without a stream sync: a CUDA copy from pageable memory waits for
    the stream (`copy_` with non_blocking=False synchronizes), from pinned memory it is queued."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
