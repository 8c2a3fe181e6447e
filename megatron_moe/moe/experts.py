"""Experts: GPT-2 MLPs (fc -> tanh-GELU -> proj), E per layer, hidden dim sharded over ESP.

Legend: E experts (E_l = E / N_EP local ones), N tokens per expert buffer,
M model dim, H ffn hidden dim (H_l = H / N_ESP per ESP rank).

Full parameters and their splits (dim 0 over EP, the H dim over ESP):
  fc_w   [E, H, M]   fc_b   [E, H]
  proj_w [E, M, H]   proj_b [E, M]  (split over ESP along M: ESP rank j adds
                                     bias columns j*M/N_ESP.. to its partial
                                     output, so the sum of partials carries the
                                     bias exactly once and each piece has one owner)
The forward returns each ESP rank's *partial* output; schedules sum them.
Dropless MoE gives a ragged input x [R, M] instead of [E_l, N, M]: the R rows
grouped by local expert, `counts` [E_l] rows each; each expert computes its own
row range (no padding rows, no FLOPs on them).
A capacity-padded input [E_l, N, M] with `kept` rows (`moe.kept.KeptRows`: the rows that
hold a kept token) is packed to those rows, computed as a ragged input and scattered back
(zeros elsewhere): the GEMMs never multiply padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_moe.distributed.collectives import scale_grad
from megatron_moe.layers.fused import gelu_tanh
from megatron_moe.layers.sharding import InitSpec, ShardSpec
from megatron_moe.layers.tensor_parallel import make_param
from megatron_moe.moe.kept import KeptRows
from megatron_moe.profiling import annotate

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState


class Experts(nn.Module):
    """The local experts of one MoE layer. x [E_l, N, M] -> partial y [E_l, N, M]."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn_hidden: int,
        ps: "ParallelState",
        seed: int,
        name: str,
        std: float = 0.02,
        proj_std: float = 0.02,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.esp_rank, self.esp_size = ps.rank("esp"), ps.size("esp")
        E, H, M = num_experts, ffn_hidden, hidden
        ep_esp = lambda *d: ShardSpec(tuple(d), expert=True)  # noqa: E731
        self.fc_w = make_param(
            (E, H, M), ep_esp((0, "ep"), (1, "esp")), InitSpec("normal", std), ps, seed, f"{name}.fc_w", device
        )
        self.fc_b = make_param(
            (E, H), ep_esp((0, "ep"), (1, "esp")), InitSpec("zeros"), ps, seed, f"{name}.fc_b", device
        )
        self.proj_w = make_param(
            (E, M, H), ep_esp((0, "ep"), (2, "esp")), InitSpec("normal", proj_std), ps, seed, f"{name}.proj_w", device
        )
        self.proj_b = make_param(
            (E, M), ep_esp((0, "ep"), (1, "esp")), InitSpec("zeros"), ps, seed, f"{name}.proj_b", device
        )
        self.m_lo = self.esp_rank * (M // self.esp_size)
        self.num_local = E // ps.size("ep")
        # (fc, proj) batched linears of a dW queue that defer the weight-gradient GEMMs:
        # fn(x, weight, bias [E_l, 1, O] or None, grad_scale) (`set_dw_queue`)
        self.deferred_bmm = None

    def relayout(self, local: dict[str, torch.Tensor], num_local: int) -> None:
        """Hold another set of experts (Lina's expert packing, `moe.packing`): `local` maps fc_w,
        fc_b, proj_w, proj_b to this rank's new slices [num_local, ...]. The parameters stay the
        same objects (the optimizer, gradient hooks and schedulers keep them), with new data and
        no gradient. Call it between iterations, when no autograd graph that used the experts is
        alive (a live graph keeps each parameter's gradient accumulator, which remembers the old
        shape: its next backward would fail on the shape)."""
        with torch.no_grad():
            for name, p in (("fc_w", self.fc_w), ("fc_b", self.fc_b), ("proj_w", self.proj_w), ("proj_b", self.proj_b)):
                t = local[name]
                if t.shape[0] != num_local or t.shape[1:] != p.shape[1:]:
                    raise ValueError(
                        f"{name}: new slice {tuple(t.shape)} does not fit {num_local} experts like {tuple(p.shape)}"
                    )
                p.data = t.to(device=p.device, dtype=p.dtype).contiguous()
                p.grad = None
        self.num_local = num_local

    def set_dw_queue(self, queue, prefix: str) -> None:
        """Hand both weight-gradient GEMMs to `queue` (Lancet's WgradRuntime) as prefix + "fc1.dW" /
        "fc2.dW"; None: plain autograd."""
        self.deferred_bmm = None if queue is None else (queue.bmm(prefix + "fc1.dW"), queue.bmm(prefix + "fc2.dW"))

    @annotate("moe/experts")
    def forward(
        self,
        x_ENM: torch.Tensor,
        grad_scale: float = 1.0,
        counts: Optional[list[int]] = None,
        kept: Optional[KeptRows] = None,
    ) -> torch.Tensor:
        """`grad_scale` scales the weight gradients (1/N_MP when MP ranks duplicate the work).
        With `counts` the input is ragged: x [R, M] -> partial y [R, M]; with `kept` only the
        kept rows of x [E_l, N, M] are computed (module docstring). A dW queue (Lancet) takes
        the padded batched GEMMs."""
        if counts is not None:
            return self.forward_ragged(x_ENM, counts, grad_scale)
        if kept is not None and self.deferred_bmm is None:
            return self.forward_kept(x_ENM, kept, grad_scale)
        fc_b, proj_b = scale_grad(self.fc_b, grad_scale), scale_grad(self.proj_b, grad_scale)
        if self.deferred_bmm is not None and torch.is_grad_enabled() and x_ENM.requires_grad:
            fc, proj = self.deferred_bmm
            h = gelu_tanh(fc(x_ENM, self.fc_w, fc_b[:, None, :].to(x_ENM.dtype), grad_scale))
            y = proj(h, self.proj_w, None, grad_scale)
        else:
            fc_w, proj_w = scale_grad(self.fc_w, grad_scale), scale_grad(self.proj_w, grad_scale)
            h = gelu_tanh(torch.baddbmm(fc_b[:, None, :].to(x_ENM.dtype), x_ENM, fc_w.transpose(1, 2).to(x_ENM.dtype)))
            y = torch.bmm(h, proj_w.transpose(1, 2).to(h.dtype))
        M, m_l = y.size(-1), proj_b.size(1)
        bias = F.pad(proj_b, (self.m_lo, M - self.m_lo - m_l))  # [E_l, M], zeros off our columns
        return y + bias[:, None, :].to(y.dtype)

    def forward_ragged(self, x_RM: torch.Tensor, counts: list[int], grad_scale: float = 1.0) -> torch.Tensor:
        """x [R, M], rows grouped by local expert (`counts` [E_l], sum R) -> partial y [R, M].

        One GEMM pair per local expert over its own rows (an expert with no rows: empty GEMMs)."""
        if len(counts) != self.num_local or sum(counts) != x_RM.size(0):
            raise ValueError(f"ragged expert input of {x_RM.size(0)} rows does not match counts {counts}")
        if self.deferred_bmm is not None:
            raise ValueError("--moe-dropless cannot be combined with --lancet-wgrad")
        fc_w, proj_w = scale_grad(self.fc_w, grad_scale), scale_grad(self.proj_w, grad_scale)
        fc_b, proj_b = scale_grad(self.fc_b, grad_scale), scale_grad(self.proj_b, grad_scale)
        M, dt = x_RM.size(1), x_RM.dtype
        bias = F.pad(proj_b, (self.m_lo, M - self.m_lo - proj_b.size(1)))  # [E_l, M], zeros off our columns
        return _GroupedMLP.apply(x_RM, fc_w.to(dt), fc_b.to(dt), proj_w.to(dt), bias.to(dt), list(counts))

    def expert_weights(self, grad_scale: float = 1.0) -> list[tuple[torch.Tensor, ...]]:
        """(fc_w [H_l, M], fc_b [H_l], proj_w [M, H_l], proj_b [M_l]) of each local expert, their
        gradients scaled by `grad_scale`."""
        fc_w, proj_w = scale_grad(self.fc_w, grad_scale), scale_grad(self.proj_w, grad_scale)
        fc_b, proj_b = scale_grad(self.fc_b, grad_scale), scale_grad(self.proj_b, grad_scale)
        return [(fc_w[e], fc_b[e], proj_w[e], proj_b[e]) for e in range(self.num_local)]

    def forward_weights(
        self, x_RM: torch.Tensor, counts: list[int], weights: list[tuple[torch.Tensor, ...]]
    ) -> torch.Tensor:
        """x [R, M] grouped by expert (`counts[i]` rows for `weights[i]`, an `expert_weights` tuple of
        a local expert or of a Pro-Prophet replica) -> partial y [R, M]."""
        if len(counts) != len(weights) or sum(counts) != x_RM.size(0):
            raise ValueError(f"ragged expert input of {x_RM.size(0)} rows does not match counts {counts}")
        if self.deferred_bmm is not None:
            raise ValueError("--moe-dropless cannot be combined with --lancet-wgrad")
        M = x_RM.size(1)
        outs, start = [], 0
        for (fc_w, fc_b, proj_w, proj_b), n in zip(weights, counts):  # n = 0: empty GEMMs (zero grads, no FLOPs)
            x = x_RM[start : start + n]
            bias = F.pad(proj_b, (self.m_lo, M - self.m_lo - proj_b.size(0)))  # [M], zeros off our columns
            h = gelu_tanh(torch.addmm(fc_b.to(x.dtype), x, fc_w.t().to(x.dtype)))
            outs.append(torch.addmm(bias.to(h.dtype), h, proj_w.t().to(h.dtype)))
            start += n
        return torch.cat(outs)

    def forward_kept(self, x_ENM: torch.Tensor, kept: KeptRows, grad_scale: float = 1.0) -> torch.Tensor:
        """Padded x [E_l, N, M] -> partial y [E_l, N, M] computed on the `kept` rows only (zeros elsewhere)."""
        E_l, N, M = x_ENM.shape
        if E_l != self.num_local or (kept.rows.numel() and int(kept.rows[-1]) >= E_l * N):
            raise ValueError(f"kept rows do not fit the expert input of shape {tuple(x_ENM.shape)}")
        y_KM = self.forward_ragged(x_ENM.reshape(E_l * N, M).index_select(0, kept.rows), kept.counts, grad_scale)
        return y_KM.new_zeros(E_l * N, M).index_copy(0, kept.rows, y_KM).view(E_l, N, M)


class _GroupedMLP(torch.autograd.Function):
    """The experts' MLPs on a ragged input: x [R, M] (rows grouped by expert, `counts` [E_l]) ->
    y [R, M] = gelu(x W1_e^T + b1_e) W2_e^T + b2_e per row range, with fc_w [E_l, H, M], fc_b [E_l, H],
    proj_w [E_l, M, H], bias [E_l, M].

    One GEMM per expert and step, each writing into its rows of one preallocated output (forward)
    or its slice of one [E_l, ...] gradient (backward): no per-expert gradient buffers to fill and
    add, no concatenation; the activation runs once over all R rows."""

    @staticmethod
    def forward(ctx, x_RM, fc_w, fc_b, proj_w, bias, counts):
        R, M, H = x_RM.size(0), x_RM.size(1), fc_w.size(1)
        spans = [(sum(counts[:e]), sum(counts[: e + 1])) for e in range(len(counts))]
        a_RH = x_RM.new_empty(R, H)
        for e, (lo, hi) in enumerate(spans):
            torch.addmm(fc_b[e], x_RM[lo:hi], fc_w[e].t(), out=a_RH[lo:hi])
        h_RH = gelu_tanh(a_RH)
        y_RM = x_RM.new_empty(R, M)
        for e, (lo, hi) in enumerate(spans):
            torch.addmm(bias[e], h_RH[lo:hi], proj_w[e].t(), out=y_RM[lo:hi])
        ctx.spans = spans
        ctx.save_for_backward(x_RM, a_RH, h_RH, fc_w, proj_w)
        return y_RM

    @staticmethod
    def backward(ctx, gy_RM):
        x_RM, a_RH, h_RH, fc_w, proj_w = ctx.saved_tensors
        gy_RM = gy_RM.contiguous()
        d_proj_w, d_bias = torch.empty_like(proj_w), gy_RM.new_empty(proj_w.shape[:2])
        dh_RH = torch.empty_like(h_RH)
        for e, (lo, hi) in enumerate(ctx.spans):
            torch.mm(gy_RM[lo:hi].t(), h_RH[lo:hi], out=d_proj_w[e])
            torch.sum(gy_RM[lo:hi], dim=0, out=d_bias[e])
            torch.mm(gy_RM[lo:hi], proj_w[e], out=dh_RH[lo:hi])
        da_RH = torch.ops.aten.gelu_backward(dh_RH, a_RH, approximate="tanh")
        d_fc_w, d_fc_b = torch.empty_like(fc_w), da_RH.new_empty(fc_w.shape[:2])
        dx_RM = torch.empty_like(x_RM) if ctx.needs_input_grad[0] else None
        for e, (lo, hi) in enumerate(ctx.spans):
            torch.mm(da_RH[lo:hi].t(), x_RM[lo:hi], out=d_fc_w[e])
            torch.sum(da_RH[lo:hi], dim=0, out=d_fc_b[e])
            if dx_RM is not None:
                torch.mm(da_RH[lo:hi], fc_w[e], out=dx_RM[lo:hi])
        return dx_RM, d_fc_w, d_fc_b, d_proj_w, d_bias, None


def expert_flops(tokens: int, hidden: int, ffn_hidden: int) -> int:
    """Forward FLOPs of one expert MLP on `tokens` tokens (2 GEMMs)."""
    return 4 * tokens * hidden * ffn_hidden
